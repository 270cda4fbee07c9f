"""Throttling: one rank's NVML reasons or SM clock, against its own baseline and the fleet."""

from __future__ import annotations

from dataclasses import replace

import pytest

from trainvitals.analyzer.runinfo import RunInfo
from trainvitals.analyzer.throttle import ThrottleDetector, ThrottleSettings, decode
from trainvitals.analyzer.throughput import ThroughputSettings

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


def test_a_throttled_rank_is_named_with_its_host() -> None:
    hosts = RunInfo(hosts=tuple(f"node-{r // 4}" for r in range(8)))
    views = (
        replace(v, run=hosts) for v in fleet(150, fault=_from(100, "throttle_reasons", 6, 0x40))
    )
    (alert,) = run(ThrottleDetector(), views)
    assert alert.rank == 6 and alert.message.startswith("rank 6 on node-1 throttled")


def test_settings_change_what_is_flagged_and_bad_ones_name_their_field() -> None:
    fault = _from(100, "sm_clock_mhz", 4, factor=0.8)
    tolerant = ThrottleDetector(ThrottleSettings(clock_drop=0.3))  # a 20% drop is allowed
    assert run(tolerant, fleet(150, fault=fault)) == []
    with pytest.raises(ValueError, match=r"throttle\.clock_drop must be in \(0, 1\)"):
        ThrottleSettings(clock_drop=1.5)
    with pytest.raises(ValueError, match=r"throttle\.min_hits must be in \[1, window=10\]"):
        ThrottleSettings(min_hits=0)
    with pytest.raises(ValueError, match=r"throughput\.min_drop must be in \(0, 1\)"):
        ThroughputSettings(min_drop=0)
    with pytest.raises(ValueError, match=r"throughput\.recent_steps must be >= 3"):
        ThroughputSettings(recent_steps=2)
