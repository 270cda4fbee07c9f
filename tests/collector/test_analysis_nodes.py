"""The live driver waits for every node's ranks rows of a step, up to a deadline; a node
that never sends them is named by the analyzer (the detector replay runs too)."""

from __future__ import annotations

from trainvitals.analyzer import Analyzer
from trainvitals.analyzer.live import LiveAnalysis
from trainvitals.schema import BatchBuilder, to_arrow


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _batch(run_id: str, step: int | None, ranks: range, world: int | None = None) -> dict:
    b = BatchBuilder(run_id)
    if world is not None:
        b.append("runs", started_unix_s=1000.0, model="m", model_config_json="{}", n_params=1,
                 n_layers=0, layer_names_json="[]", world_size=world, dp=world, tp=1,
                 device_type="cpu", device_name="cpu", hosts_json="[]", flops_per_token=6.0,
                 peak_flops_per_s=1e12, peak_flops_source="given")  # fmt: skip
    if step is not None:
        b.append("steps", step=step, time_unix_s=1000.0 + step, loss=2.0, grad_norm=1.0,
                 tokens=512, step_time_s=0.5, tokens_per_s=1024.0,
                 tflops_per_s_per_device=0.1, mfu_ratio=0.25)  # fmt: skip
    for r in ranks:
        b.append("ranks", step=step or 0, rank=r, step_time_s=0.5, tokens_per_s=256.0, loss=2.0)
    return to_arrow(b.to_dict())[1]


def _live(clock: _Clock) -> LiveAnalysis:
    return LiveAnalysis(Analyzer(), lambda _alerts: None, delay_s=1.0, clock=clock)


def _due(live: LiveAnalysis) -> dict[str, tuple[dict, dict]]:
    with live._cond:
        return live._take_due()


def test_a_step_waits_for_the_other_nodes_ranks_rows() -> None:
    clock = _Clock()
    live = _live(clock)
    # rank 0: the runs row, step 10 and its node's ranks 0-1; node 1 (ranks 2-3) comes later
    live.committed("r", _batch("r", 10, range(2), world=4))
    clock.now += 5.0  # past delay_s, before the deadline
    assert _due(live) == {}
    live.committed("r", _ranks("r", 10, 2, 4))
    clock.now += 0.1
    (_meta, window) = _due(live)["r"]
    assert window["ranks"].column("rank").to_pylist() == [0, 1, 2, 3]


def _ranks(run_id: str, step: int, first: int, end: int) -> dict:
    b = BatchBuilder(run_id)
    for r in range(first, end):
        b.append("ranks", step=step, rank=r, step_time_s=0.5, tokens_per_s=256.0, loss=2.0)
    return to_arrow(b.to_dict())[1]


def test_a_node_that_never_sends_is_a_finding_after_the_deadline() -> None:
    clock = _Clock()
    live = _live(clock)
    live.committed("r", _batch("r", 10, range(2), world=4))
    clock.now += 9.9
    assert _due(live) == {}
    clock.now += 0.2  # the deadline (10 s after the steps row) has passed
    (meta, window) = _due(live)["r"]
    assert window["ranks"].num_rows == 2
    (alert,) = Analyzer().observe("r", {**meta, **window})
    assert (alert.kind, alert.rank, alert.value) == ("ranks_missing", 2, 2.0)
    assert "ranks 2, 3" in alert.message


def test_steps_without_any_ranks_rows_wait_only_delay_s() -> None:
    clock = _Clock()
    live = _live(clock)
    live.committed("r", _batch("r", 10, range(0), world=4))
    clock.now += 1.1
    assert "r" in _due(live)


def test_a_window_being_analysed_still_counts_in_the_lag() -> None:
    # Readers wait for lag 0 before reading a run's alerts (the alerting end-to-end test
    # did): a window taken off the buffer but not yet analysed must keep the lag above 0,
    # or its alerts are read before they are stored.
    clock = _Clock()
    live = _live(clock)
    live.committed("r", _batch("r", 10, range(1), world=1))
    clock.now += 1.5
    assert live.lag_s == 1.5
    assert "r" in live.windows()[0]  # taken by the analysis thread's source
    clock.now += 2.0
    assert live.lag_s == 3.5  # in flight: its alerts are not stored yet (the thread clears
    # it once it has emitted them, and sets busy off with it: `drain` waits for that)
