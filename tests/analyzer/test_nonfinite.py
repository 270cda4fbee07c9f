"""Non-finite values: where they started, in forward order, and on which rank."""

from __future__ import annotations

import math

from trainvitals.analyzer import Analyzer
from trainvitals.analyzer.detectors import NonFiniteDetector
from trainvitals.schema import SCHEMA_VERSION, to_arrow

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


def _hooks_batch(step: int, n_layers: int = 3, **changes: dict) -> dict:
    """One logged step as the hooks export it (schema columns), every value finite;
    `changes` replaces columns: steps={...}, layers={...}."""
    doc = {
        "schema_version": SCHEMA_VERSION,
        "run_id": "r",
        "steps": {
            "step": [step],
            "time_unix_s": [1e9 + step],
            "loss": [5.0 - step * 0.01],
            "grad_norm": [1.0],
            "tokens": [1000],
            "step_time_s": [1.0],
            "tokens_per_s": [1000.0],
            "tflops_per_s_per_device": [1.0],
            "mfu_ratio": [0.1],
            "nonfinite_count": [0],
            "nonfinite_steps": [0],
        },
        "layers": {
            "step": [step] * n_layers,
            "layer": list(range(n_layers)),
            "grad_norm": [1.0] * n_layers,
            "act_rms": [1.0] * n_layers,
            "act_max_abs": [3.0] * n_layers,
            "param_norm": [10.0] * n_layers,
            "nonfinite_count": [0] * n_layers,
            "act_nonfinite_count": [0] * n_layers,
            "act_nonfinite_steps": [0] * n_layers,
        },
    }
    for table, columns in changes.items():
        doc[table].update(columns)
    return doc


def _analyze(docs: list[dict]) -> list:
    analyzer = Analyzer()
    return [a for doc in docs for a in analyzer.observe(*to_arrow(doc))]


def test_nonfinite_on_an_unlogged_step_is_flagged_at_the_next_logged_step() -> None:
    # log_every=10, a NaN in layer 1's output at step 15, skipped by the loop (GradScaler):
    # at step 20 only the hooks' counts over steps 11..20 and the max-abs show it.
    bad = {
        "steps": {"nonfinite_steps": [1]},
        "layers": {"act_nonfinite_steps": [0, 1, 1], "act_max_abs": [3.0, math.nan, math.nan]},
    }
    docs = [_hooks_batch(s, **(bad if s == 20 else {})) for s in range(0, 60, 10)]
    (alert,) = _analyze(docs)
    assert (alert.kind, alert.step, alert.layer, alert.severity) == ("nonfinite", 20, 1, "critical")
    assert "1 step(s) since the previous logged one held a NaN/inf" in alert.message
    assert "metric=act_nonfinite_steps" in alert.message


def test_a_reported_nan_max_is_nonfinite_and_a_missing_one_is_not() -> None:
    nan_max = {"layers": {"act_max_abs": [3.0, 3.0, math.nan]}}
    (alert,) = _analyze([_hooks_batch(0), _hooks_batch(10, **nan_max)])
    assert (alert.step, alert.layer) == (10, 2) and "2 (activations)" in alert.message
    not_reported = {"layers": {"act_max_abs": [None, None, None], "param_norm": [None] * 3}}
    assert _analyze([_hooks_batch(0), _hooks_batch(10, **not_reported)]) == []


def test_nonfinite_parameters_name_their_layer() -> None:
    nan_params = {"layers": {"param_norm": [10.0, math.inf, math.nan]}}
    (alert,) = _analyze([_hooks_batch(0), _hooks_batch(10, **nan_params)])
    assert (alert.step, alert.layer) == (10, 1) and "1 (parameters)" in alert.message
