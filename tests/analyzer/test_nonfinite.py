"""Non-finite values: where they started, in forward order, and on which rank."""

from __future__ import annotations

import json
import math
from dataclasses import replace

from trainvitals.analyzer import Analyzer
from trainvitals.analyzer.detectors import NonFiniteDetector
from trainvitals.analyzer.runinfo import RunInfo
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
    assert "layer in forward order: layer 2 (activations)" in alert.message  # no names known


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


def _runs(names: list[str], hosts: list[str]) -> dict:
    """The runs table of a run with these layer names and rank hosts."""
    row = {
        "started_unix_s": 1000.0, "model": "m", "model_config_json": "{}", "n_params": 10,
        "n_layers": len(names), "layer_names_json": json.dumps(names),
        "world_size": len(hosts), "dp": len(hosts), "tp": 1, "device_type": "cpu",
        "device_name": "cpu", "hosts_json": json.dumps(hosts), "flops_per_token": 60.0,
        "peak_flops_per_s": 1e12, "peak_flops_source": "measured",
    }  # fmt: skip
    return {k: [v] for k, v in row.items()}


NAMES = ["tok_embeddings", "layers.0", "layers.1"]


def test_a_layer_is_named_by_its_name_and_keeps_its_index() -> None:
    first = {**_hooks_batch(0), "runs": _runs(NAMES, ["host-a"])}
    bad = _hooks_batch(10, layers={"act_nonfinite_count": [0, 0, 7], "nonfinite_count": [3] * 3})
    (alert,) = _analyze([first, bad])
    assert alert.layer == 2 and "forward order: layers.1 (activations)" in alert.message


def test_a_nan_born_in_the_loss_names_the_loss_not_a_layers_gradients() -> None:
    # The loss goes NaN after the forward: backward makes every gradient NaN in the same
    # step, while every block output stayed finite.
    nan_loss = {
        "steps": {"loss": [math.nan], "grad_norm": [math.nan], "nonfinite_count": [3],
                  "nonfinite_steps": [1]},
        "layers": {"grad_norm": [math.nan] * 3, "nonfinite_count": [1] * 3},
    }  # fmt: skip
    first = {**_hooks_batch(0), "runs": _runs(NAMES, ["host-a"])}
    (alert,) = _analyze([first, _hooks_batch(10, **nan_loss)])
    assert alert.layer is None and "it started in the loss" in alert.message
    assert not any(name in alert.message for name in NAMES)
    assert "/steps?metric=loss" in alert.message


def test_a_loss_nan_on_an_unlogged_step_is_named_before_the_outputs_it_poisoned() -> None:
    # log_every=10: the loss went NaN at step 17, the NaN weights made every output NaN
    # from step 18 on. At step 20: the loss on 4 steps, the outputs on 3.
    poisoned = {
        "steps": {"loss": [math.nan], "nonfinite_steps": [4]},
        "layers": {"act_nonfinite_steps": [3, 3, 3], "act_rms": [math.nan] * 3},
    }
    (alert,) = _analyze([_hooks_batch(10), _hooks_batch(20, **poisoned)])
    assert alert.layer is None and "it started in the loss" in alert.message
    assert "on 4 step(s)" in alert.message and "at most 3" in alert.message


def test_gradients_alone_name_the_last_layer_in_forward_order() -> None:
    # A NaN born in layer 1's backward reaches layer 0's gradients, not layer 2's.
    grads = {"steps": {"grad_norm": [math.nan]}, "layers": {"nonfinite_count": [2, 1, 0]}}
    first = {**_hooks_batch(0), "runs": _runs(NAMES, ["host-a"])}
    (alert,) = _analyze([first, _hooks_batch(10, **grads)])
    assert alert.layer == 1 and "in backward order: layers.0" in alert.message


def test_the_rank_is_named_with_its_host() -> None:
    def fault(step: int, cols: dict) -> None:
        if step == 30:
            cols["ranks"]["loss"][3] = math.nan
            cols["steps"]["loss"] = math.nan

    hosts = RunInfo(hosts=("host-a", "host-a", "host-b", "host-b"))
    views = (replace(v, run=hosts) for v in fleet(40, ranks=4, fault=fault))
    (alert,) = run(NonFiniteDetector(), views)
    assert alert.rank == 3 and "started on rank 3 on host-b" in alert.message
