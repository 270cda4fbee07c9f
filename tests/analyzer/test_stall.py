"""Stalls, judged on telemetry timestamps: the job's, and a rank that went silent."""

from __future__ import annotations

import json
import tracemalloc
from dataclasses import replace

import numpy as np
import pyarrow as pa

from trainvitals.analyzer import Analyzer
from trainvitals.analyzer.stall import StallDetector
from trainvitals.analyzer.views import RankView

from .synthetic import fleet, run


def test_a_stall_caused_by_one_rank_names_it() -> None:
    def fault(step: int, cols: dict) -> None:
        if step == 100:
            cols["ranks"]["compute_time_s"][3] += 120  # rank 3 hangs; the others wait

    (alert,) = run(StallDetector(), fleet(150, fault=fault))
    assert (alert.kind, alert.step, alert.rank) == ("stall", 100, 3)
    assert alert.value > 100 and "waited 1" in alert.message


def test_a_pause_of_the_whole_job_names_nobody() -> None:
    def fault(step: int, cols: dict) -> None:
        if step == 100:
            cols["steps"]["dt"] += 300  # a shared filesystem froze every rank alike

    (alert,) = run(StallDetector(), fleet(150, fault=fault))
    assert (alert.step, alert.rank) == (100, None) and "no progress for 30" in alert.message


def test_a_rank_that_paused_before_its_forward_is_named_by_its_data_time() -> None:
    """A rank stuck 90 s before its forward (its data loader, say); the others waited inside
    a collective, which their wait_time_s does not show (gloo), so only its data_time_s
    tells who held the job up."""

    def fault(step: int, cols: dict) -> None:
        if step == 100:
            cols["steps"]["dt"] += 90
            cols["ranks"]["data_time_s"] = np.full(8, 0.01)
            cols["ranks"]["data_time_s"][5] = 90.0

    (alert,) = run(StallDetector(), fleet(150, fault=fault))
    assert (alert.kind, alert.step, alert.rank) == ("stall", 100, 5)
    assert "rank 5 spent 90 s waiting for its data (data_time_s" in alert.message


def test_a_frozen_rank_is_named_by_its_stopped_time() -> None:
    """A rank frozen 60 s (SIGSTOP, then SIGCONT): its CPU time and data time did not move,
    the others waited inside a collective (gloo), and only its stopped_time_s shows it."""

    def fault(step: int, cols: dict) -> None:
        cols["ranks"]["stopped_time_s"] = np.full(8, 0.01)
        if step == 100:
            cols["steps"]["dt"] += 60
            cols["ranks"]["stopped_time_s"][2] = 60.0

    (alert,) = run(StallDetector(), fleet(150, fault=fault))
    assert (alert.kind, alert.step, alert.rank) == ("stall", 100, 2)
    assert "rank 2 spent 60 s stopped (neither running nor waiting for a CPU" in alert.message


def test_own_times_are_means_so_a_logged_step_names_a_rank_by_their_total() -> None:
    """Logged every 10 steps, a rank's 90 s data wait in one of them reads as a 9 s mean:
    over the 10 steps the gap spans, 90 s, which is what the job waited."""

    def fault(step: int, cols: dict) -> None:
        if step == 100:
            cols["steps"]["dt"] += 90
            cols["ranks"]["data_time_s"] = np.full(8, 0.001)
            cols["ranks"]["data_time_s"][4] = 9.0

    views = [replace(v, step=v.step * 10) for v in fleet(150, fault=fault)]
    (alert,) = run(StallDetector(), views)
    assert (alert.step, alert.rank) == (1000, 4)
    assert "rank 4 spent 90 s waiting for its data" in alert.message


def test_a_rank_that_stops_reporting_is_named() -> None:
    def without_rank_6(views):
        for v in views:
            r = v.ranks
            if v.step >= 50:
                keep = r.rank != 6
                cols = {k: getattr(r, k)[keep] for k in ("loss", "wait_time_s")}
                r = RankView(rank=r.rank[keep], **cols)
            yield replace(v, ranks=r)

    (alert,) = run(StallDetector(), without_rank_6(fleet(150)))
    assert alert.rank == 6 and 100 <= alert.step <= 112 and "reported nothing" in alert.message


def test_jittery_clean_runs_do_not_stall() -> None:
    def jitter(step: int, cols: dict) -> None:
        cols["steps"]["dt"] *= 1 + (step % 7) / 2  # 1 to 4 s between logged steps

    for seed in range(4):
        assert run(StallDetector(), fleet(300, seed=seed, fault=jitter)) == []


def test_a_huge_rank_id_costs_memory_by_ranks_seen_not_by_its_value() -> None:
    # Ingest accepts rank ids up to 2**31 - 1; per-rank state sized by the largest id
    # allocated 16 GiB for one such row. Here rank 2**31 - 1 reports, then goes silent.
    big = 2**31 - 1

    def sparse_ids(views):
        for v in views:
            r = v.ranks
            keep = slice(None) if v.step < 50 else slice(0, -1)
            rank = r.rank.copy()
            rank[-1] = big
            cols = {k: getattr(r, k)[keep] for k in ("loss", "wait_time_s")}
            yield replace(v, ranks=RankView(rank=rank[keep], **cols))

    tracemalloc.start()
    try:
        (alert,) = run(StallDetector(), sparse_ids(fleet(150, ranks=4)))
        peak_bytes = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert alert.rank == big and f"rank {big} reported nothing" in alert.message
    assert peak_bytes < 16 * 2**20


def _steps_with_a_gap(gap_s: float) -> pa.Table:
    """200 steps of 1 s; step 100 comes `gap_s` after step 99."""
    times = [float(s) + (gap_s - 1.0 if s >= 100 else 0.0) for s in range(200)]
    return pa.table({"step": list(range(200)), "time_unix_s": times, "loss": [2.0] * 200})


def _pause(phase: str, end_s: float, duration_s: float) -> pa.Table:
    """A declared pause's event as the hooks send it: at its end, after step 99."""
    detail = json.dumps({"duration_s": duration_s})
    return pa.table({"step": [99], "rank": [0], "kind": [f"pause:{phase}"], "detail": [detail],
                     "time_unix_s": [end_s]})  # fmt: skip


def test_a_declared_pause_is_taken_out_of_the_gap() -> None:
    def stalls(gap_s: float, events: pa.Table | None) -> list:
        tables = {"steps": _steps_with_a_gap(gap_s)}
        if events is not None:
            tables["events"] = events
        return Analyzer(lambda: [StallDetector()]).observe("r", tables)

    # A 300 s checkpoint save between steps 99 and 100, declared: no stall; undeclared: one.
    assert stalls(301.0, _pause("checkpoint", 99.0 + 300.0, 300.0)) == []
    (undeclared,) = stalls(301.0, None)
    assert undeclared.step == 100 and "no progress for 301 s" in undeclared.message
    # An evaluation of 100 s declared, inside a 400 s gap: the other 300 s are a stall.
    (longer,) = stalls(401.0, _pause("eval", 99.0 + 100.0, 100.0))
    assert "no progress for 301 s besides 100 s of declared pauses" in longer.message


def _launch(steps: range, ranks: int, t0_s: float) -> dict[str, pa.Table]:
    """Steps 1 s apart from `t0_s`, each with a ranks row per rank."""
    rows = [(s, r) for s in steps for r in range(ranks)]
    ones = [1.0] * len(rows)
    return {
        "steps": pa.table({"step": list(steps), "time_unix_s": [t0_s + s for s in steps]}),
        "ranks": pa.table(
            {
                "step": [s for s, _ in rows],
                "rank": [r for _, r in rows],
                "step_time_s": ones,
                "wait_time_s": ones,
            }
        ),
    }


def test_ranks_a_relaunch_on_fewer_nodes_left_behind_are_not_silent() -> None:
    # 8 ranks to step 99; the supervisor fences a node and relaunches on 4 ranks from the
    # checkpoint at step 89, which says `restart`: ranks 4-7 are gone, not silent.
    restart = pa.table({"step": [90], "rank": [0], "kind": ["restart"], "detail": ["{}"],
                        "time_unix_s": [125.0]})  # fmt: skip

    def stalls(events: dict) -> list:
        analyzer = Analyzer(lambda: [StallDetector()])
        alerts = analyzer.observe("r", _launch(range(100), 8, 0.0))
        return alerts + analyzer.observe("r", {**_launch(range(90, 300), 4, 30.0), **events})

    assert stalls({"events": restart}) == []
    (silent,) = stalls({})  # without the restart: four ranks left the job
    assert silent.step == 130 and "ranks 4, 5, 6, 7 reported nothing for 61 s" in silent.message
