"""Loss spikes named after the layer that moved first and the rank whose loss made them."""

from __future__ import annotations

from trainvitals.analyzer.detectors import LossSpikeDetector

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
    assert "moved together" in alert.message and "stands out" in alert.message


def test_clean_fleets_raise_no_spike() -> None:
    for seed in range(8):
        assert run(LossSpikeDetector(), fleet(300, seed=seed)) == []
