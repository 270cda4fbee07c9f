"""Ranks missing from a step (`ranks_missing`), and a relaunch on fewer nodes, which is not."""

from __future__ import annotations

import json

import pyarrow as pa

from trainvitals.analyzer import Analyzer
from trainvitals.analyzer.coverage import MissingRanksDetector


def _launch(steps: range, ranks: int) -> dict[str, pa.Table]:
    rows = [(s, r) for s in steps for r in range(ranks)]
    return {
        "steps": pa.table({"step": list(steps), "time_unix_s": [float(s) for s in steps]}),
        "ranks": pa.table({"step": [s for s, _ in rows], "rank": [r for _, r in rows]}),
    }


def _restart(detail: dict) -> pa.Table:
    return pa.table({"step": [90], "rank": [0], "kind": ["restart"],
                     "detail": [json.dumps(detail)], "time_unix_s": [125.0]})  # fmt: skip


def test_a_relaunch_on_fewer_nodes_is_no_missing_node_when_its_restart_says_so() -> None:
    # 8 ranks to step 99; relaunched on 4 from step 90 (a node fenced). The store keeps the
    # run's first runs row (world size 8); the trainer's restart event says 4.
    def missing(detail: dict) -> list:
        analyzer = Analyzer(lambda: [MissingRanksDetector()])
        first = {**_launch(range(100), 8), "runs": pa.table({"world_size": [8]})}
        alerts = analyzer.observe("r", first)
        return alerts + analyzer.observe("r", {**_launch(range(90, 200), 4),
                                               "events": _restart(detail)})  # fmt: skip

    assert missing({"resumed_from_step": 89, "world_size": 4}) == []
    (alert,) = missing({"resumed_from_step": 89})  # an older trainer's restart
    assert alert.step == 100 and "4 of 8 ranks sent no telemetry for step 100" in alert.message
