"""Throttling: one rank's NVML reasons or SM clock, against its own baseline and the fleet."""

from __future__ import annotations

from trainvitals.analyzer.throttle import ThrottleDetector, decode

from .synthetic import fleet, run


def _from(step0: int, column: str, ranks, value=None, factor=None):
    def fault(step: int, cols: dict) -> None:
        if step >= step0:
            if value is not None:
                cols["ranks"][column][ranks] = value
            else:
                cols["ranks"][column][ranks] *= factor

    return fault


def test_decode_names_the_main_bits() -> None:
    assert decode(0x4 | 0x40 | 0x1) == ["SW power cap", "HW thermal slowdown"]


def test_persistent_thermal_throttling_of_one_rank_is_named() -> None:
    fault = _from(100, "throttle_reasons", 2, value=0x20)
    (alert,) = run(ThrottleDetector(), fleet(150, fault=fault))
    assert (alert.kind, alert.rank) == ("throttle", 2) and 107 <= alert.step <= 110
    assert "SW thermal slowdown" in alert.message


def test_a_fleet_wide_power_cap_is_not_a_fault() -> None:
    fault = _from(100, "throttle_reasons", slice(None), value=0x4)
    assert run(ThrottleDetector(), fleet(150, fault=fault)) == []
    idle = _from(100, "throttle_reasons", 3, value=0x1)  # idle is not a slowdown
    assert run(ThrottleDetector(), fleet(150, fault=idle)) == []


def test_a_clock_drop_below_its_own_baseline_is_named() -> None:
    (alert,) = run(ThrottleDetector(), fleet(150, fault=_from(100, "sm_clock_mhz", 4, factor=0.8)))
    assert (
        alert.rank == 4 and 104 <= alert.step <= 106 and "below its own baseline" in alert.message
    )
    everyone = _from(100, "sm_clock_mhz", slice(None), factor=0.8)
    assert run(ThrottleDetector(), fleet(150, fault=everyone)) == []


def test_clean_fleets_are_not_throttled() -> None:
    for seed in range(4):
        assert run(ThrottleDetector(), fleet(300, seed=seed)) == []
