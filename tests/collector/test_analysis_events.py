"""Checkpoint events reach the divergence detector live and in replay alike, also when
they arrive in a later batch than their step; ground-truth fault events reach neither."""

from __future__ import annotations

import math
import random
from pathlib import Path

import orjson

from trainvitals.analyzer import Analyzer
from trainvitals.analyzer.replay import comparable, replay_store, stored_alerts
from trainvitals.collector.analysis import follow
from trainvitals.collector.store import Store
from trainvitals.schema import BatchBuilder, to_arrow


def _losses(n: int, onset: int) -> list[float]:
    """A loss falling towards 2.5 with 2% noise that climbs by 60% over 200 steps from
    `onset` and stays up."""
    rng = random.Random(7)
    return [
        (2.5 + 2 * math.exp(-s / 150))
        * math.exp(math.log(1.6) * min(1.0, max(0, s - onset) / 200) + rng.gauss(0, 0.02))
        for s in range(n)
    ]


def _batch(run_id: str, steps: range, losses: list[float], events: list[tuple[int, str]]):
    b = BatchBuilder(run_id)
    for s in steps:
        b.append(
            "steps",
            step=s,
            time_unix_s=1000.0 + s,
            loss=losses[s],
            grad_norm=1.0,
            lr=1e-3,
            tokens=512,
            step_time_s=0.5,
            tokens_per_s=1024.0,
            tflops_per_s_per_device=0.1,
            mfu_ratio=0.25,
        )
    for step, kind in events:
        b.append("events", step=step, rank=-1, kind=kind, detail="{}", time_unix_s=1000.0 + step)
    return to_arrow(orjson.loads(b.to_json()))[1]


def test_live_and_replayed_divergence_name_the_same_checkpoint(tmp_path: Path) -> None:
    path, n, onset = str(tmp_path / "store.duckdb"), 1000, 600
    losses = _losses(n, onset)
    store = Store(path)
    follow(store, Analyzer(), delay_s=0.0)
    store.start()
    for start in range(0, n, 100):
        # The checkpoint of step 580 and a fault's ground truth come with the steps of
        # 600-699: after step 580 itself was analysed.
        late = [(580, "checkpoint"), (590, "fault:spike")] if start == 600 else []
        events = [(start + 50, "checkpoint")] if start not in (500, 600) else []
        tables = _batch("r", range(start, start + 100), losses, events + late)
        store.submit("r", tables).result(timeout=60)
    store.close()

    replayed_store = Store(path, read_only=True)
    try:
        con = replayed_store.cursor()
        live = stored_alerts(con)
        replayed = [a.to_dict() for a in replay_store(con)]
    finally:
        replayed_store.close()
    (alert,) = [a for a in live if a["kind"] == "loss_diverging"]
    assert onset <= alert["start_step"] < 680
    assert "Roll back to the checkpoint saved at step 580, the last before" in alert["message"]
    assert sorted(map(comparable, replayed)) == sorted(map(comparable, live))
