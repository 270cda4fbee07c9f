"""Non-finite values: where they started, in forward order, and on which rank."""

from __future__ import annotations

import math

from trainvitals.analyzer.detectors import NonFiniteDetector

from .synthetic import fleet, run


def test_first_layer_in_forward_order_with_nonfinite_activations() -> None:
    def fault(step: int, cols: dict) -> None:
        if step == 30:
            cols["layers"]["act_nonfinite_count"][[2, 3]] = 100
            cols["layers"]["nonfinite_count"][:] = 50  # gradients: every layer
            cols["steps"]["loss"] = math.nan

    (alert,) = run(NonFiniteDetector(), fleet(40, layers=4, fault=fault))
    assert (alert.step, alert.layer, alert.severity) == (30, 2, "critical")
    assert "layer in forward order: 2 (activations)" in alert.message


def test_the_rank_whose_local_loss_went_nonfinite_is_named() -> None:
    def fault(step: int, cols: dict) -> None:
        if step == 30:
            cols["ranks"]["loss"][5] = math.inf
            cols["steps"]["loss"] = math.inf

    (alert,) = run(NonFiniteDetector(), fleet(40, ranks=8, fault=fault))
    assert (alert.step, alert.rank) == (30, 5) and "started on rank 5" in alert.message


def test_every_rank_hit_names_nobody_and_an_episode_alerts_once() -> None:
    def fault(step: int, cols: dict) -> None:
        if 30 <= step < 35 or step == 38:
            cols["ranks"]["loss"][:] = math.nan
            cols["steps"]["loss"] = math.nan

    alerts = run(NonFiniteDetector(), fleet(40, ranks=4, fault=fault))
    assert [(a.step, a.rank) for a in alerts] == [(30, None), (38, None)]
    assert "every rank is hit" in alerts[0].message


def test_clean_fleet_is_finite() -> None:
    assert run(NonFiniteDetector(), fleet(100)) == []
