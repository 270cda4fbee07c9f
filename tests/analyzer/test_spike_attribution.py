"""Loss spikes named after the layer that moved first and the rank whose loss made them."""

from __future__ import annotations

import math
import re
from dataclasses import replace

import numpy as np

from trainvitals.analyzer.attribution import LayerHistory
from trainvitals.analyzer.detectors import LossSpikeDetector
from trainvitals.analyzer.runinfo import RunInfo
from trainvitals.analyzer.views import LayerView

from .synthetic import fleet, run

SPIKE = 150


def _spike(step: int, cols: dict, factor: float = 3.0) -> None:
    """The loss and every layer's gradient jump together (a shared bad batch)."""
    if step == SPIKE:
        cols["steps"]["loss"] *= factor
        cols["ranks"]["loss"] *= factor
        cols["layers"]["grad_norm"] *= factor


def test_the_layer_that_moved_first_is_named() -> None:
    def fault(step: int, cols: dict) -> None:
        if SPIKE - 2 <= step <= SPIKE:  # layer 2's gradient blows up two steps early
            cols["layers"]["grad_norm"][2] *= 8
            cols["layers"]["act_max_abs"][2] *= 4
        _spike(step, cols)

    (alert,) = run(LossSpikeDetector(), fleet(200, seed=1, fault=fault))
    assert (alert.kind, alert.step, alert.layer, alert.rank) == ("loss_spike", SPIKE, 2, None)
    assert "first to move: layer 2 grad_norm" in alert.message
    assert f"at step {SPIKE - 2}" in alert.message and "/api/v1/runs/r/layers?" in alert.message


def test_the_rank_with_the_bad_batch_is_named() -> None:
    def fault(step: int, cols: dict) -> None:
        if step == SPIKE:
            cols["ranks"]["loss"][5] *= 8
            cols["steps"]["loss"] = cols["ranks"]["loss"].mean()

    (alert,) = run(LossSpikeDetector(), fleet(200, ranks=8, seed=2, fault=fault))
    assert (alert.step, alert.rank) == (SPIKE, 5)
    assert "rank 5 " in alert.message and "data-parallel peers' median" in alert.message


def test_the_rank_with_the_bad_batch_is_named_with_its_host() -> None:
    def fault(step: int, cols: dict) -> None:
        if step == SPIKE:
            cols["ranks"]["loss"][5] *= 8
            cols["steps"]["loss"] = cols["ranks"]["loss"].mean()

    hosts = RunInfo(hosts=tuple(f"node-{r // 4}" for r in range(8)))
    views = (replace(v, run=hosts) for v in fleet(200, ranks=8, seed=2, fault=fault))
    (alert,) = run(LossSpikeDetector(), views)
    assert alert.rank == 5 and "rank 5 on node-1 " in alert.message


def test_with_tensor_parallelism_both_ranks_of_the_replica_are_named() -> None:
    # dp=4 x tp=2: ranks 4 and 5 are data-parallel index 2 and share its batch.
    def fault(step: int, cols: dict) -> None:
        if step == SPIKE:
            cols["ranks"]["loss"][[4, 5]] *= 8
            cols["steps"]["loss"] = cols["ranks"]["loss"].mean()

    (alert,) = run(LossSpikeDetector(), fleet(200, ranks=8, tp=2, seed=3, fault=fault))
    assert alert.rank in (4, 5) and "rank 4" in alert.message and "rank 5" in alert.message


def test_a_shared_spike_names_no_layer_and_no_rank() -> None:
    (alert,) = run(LossSpikeDetector(), fleet(200, seed=4, fault=_spike))
    assert (alert.step, alert.layer, alert.rank) == (SPIKE, None, None)
    assert "every layer moved in the same step" in alert.message and "stands out" in alert.message
    assert not re.search(r"\blayer \d", alert.message)  # quoting the largest would blame it


def test_clean_fleets_raise_no_spike() -> None:
    for seed in range(8):
        assert run(LossSpikeDetector(), fleet(300, seed=seed)) == []


def test_the_layer_that_moved_first_is_named_as_the_run_names_it() -> None:
    def fault(step: int, cols: dict) -> None:
        if SPIKE - 2 <= step <= SPIKE:
            cols["layers"]["grad_norm"][2] *= 8
        _spike(step, cols)

    names = RunInfo(layer_names=("tok_embeddings", "layers.0", "layers.1", "output"))
    views = (replace(v, run=names) for v in fleet(200, seed=1, fault=fault))
    (alert,) = run(LossSpikeDetector(), views)
    assert alert.layer == 2 and "first to move: layers.1 grad_norm" in alert.message


def _falling(steps: int, jump_at: int | None = None, factor: float = 8.0) -> LayerHistory:
    """Five layers' gradient norms falling 20x over the run with 5% noise, as early in
    training, every layer's multiplied by `factor` at `jump_at` (a bad batch)."""
    rng = np.random.default_rng(3)
    history = LayerHistory()
    for step in range(steps):
        grad = 10 * math.exp(-step / 15) * rng.lognormal(0, 0.05, 5)
        if step == jump_at:
            grad *= factor * np.array([1.0, 0.6, 1.4, 0.8, 1.2])
        history.push(step, LayerView.of(grad_norm=grad, update_rms=[1e-3] * 5, act_rms=[1.0] * 5))
    return history


def test_a_trending_statistic_does_not_hide_a_layer_that_moved() -> None:
    # Against the median of a falling window every jump looks small and the noise large
    # (the MAD of the values): the level is the last few values, the noise the spread of
    # step-to-step changes.
    verdict = _falling(46, jump_at=45).deviations()
    assert verdict.layers_together == 5 and verdict.leader is None
    layer, stat, text = verdict.explain()
    assert (layer, stat) == (None, "grad_norm") and text.startswith("every layer moved")
    assert _falling(46).deviations().first == []  # the fall alone is no deviation


def test_some_layers_moving_together_name_none_and_say_how_many() -> None:
    history = LayerHistory()
    rng = np.random.default_rng(4)
    for step in range(40):
        grad = rng.lognormal(0, 0.05, 6)
        if step == 39:
            grad[[0, 2, 3]] *= [9.0, 5.0, 3.0]  # 9x is not 1.5x the others' change in log
        history.push(step, LayerView.of(grad_norm=grad, update_rms=[1e-3] * 6, act_rms=[1.0] * 6))
    verdict = history.deviations()
    assert verdict.leader is None
    assert verdict.explain()[2].startswith("3 of 6 layers moved in the same step")
