"""Goodput of a run: productive time against restarts, re-done steps, checkpoints, stalls."""

from __future__ import annotations

import json

import pytest

from trainvitals.analyzer.goodput import goodput

T0 = 1.7e9


def _run() -> tuple[dict, dict]:
    """1 s steps. A 30 s checkpoint after step 199; a 200 s stall before step 400; at step
    599 the job dies, restarts 100 s later from its checkpoint at step 550 and trains steps
    550-599 again (the store keeps their first copies only); it ends at step 999."""
    steps, times, t = [], [], T0
    for step in range(1000):
        t += 1.0
        if step == 200:
            t += 30
        if step == 400:
            t += 200
        if step == 600:
            t += 100 + 50  # down for 100 s, then 50 steps trained a second time
        steps.append(step)
        times.append(t)
    events = {
        "step": [200, 550],
        "kind": ["checkpoint", "restart"],
        "detail": [json.dumps({"duration_s": 30}), "{}"],
        "time_unix_s": [times[199] + 15, times[599] + 100],
    }
    return {"step": steps, "time_unix_s": times, "step_time_s": [1.0] * 1000}, events


def test_goodput_splits_lost_time_by_cause() -> None:
    g = goodput("r", *_run())
    assert g.step_s == pytest.approx(1.0)
    assert g.wall_s == pytest.approx(1000 + 30 + 200 + 150)
    assert (g.checkpoints, g.checkpoint_s) == (1, pytest.approx(30))
    assert (g.stalls, g.stall_s) == (1, pytest.approx(200))
    assert (g.restarts, g.restart_s) == (1, pytest.approx(100))
    assert (g.redone_steps, g.redone_s) == (50, pytest.approx(50))
    assert g.productive_s == pytest.approx(1000)
    assert g.ratio == pytest.approx(1000 / 1380)
    assert g.summary() == (
        "goodput of run r: 72.5% of 23.0 min trained the model; lost: restarts 100 s (1), "
        "re-done steps 50 s (50 steps), checkpoints 30 s (1), stalls 3.3 min (1)"
    )


def test_a_clean_run_is_all_productive() -> None:
    steps = {"step": list(range(100)), "time_unix_s": [T0 + s for s in range(100)]}
    g = goodput("r", steps, {})
    assert g.ratio == pytest.approx(1.0) and g.stalls == g.restarts == 0


def _steady(n: int) -> dict:
    return {"step": list(range(n)), "time_unix_s": [T0 + s for s in range(n)]}


def test_a_checkpoint_after_the_last_logged_step_is_outside_the_wall_time() -> None:
    # 100 steps of 1 s, then a 120 s save that ends at T0 + 219: not in the wall time
    # (first step's start to last logged step), so it costs none of it.
    saved = {"step": [99], "kind": ["checkpoint"], "detail": ['{"duration_s": 120}']}
    g = goodput("r", _steady(100), {**saved, "time_unix_s": [T0 + 219]})
    assert (g.wall_s, g.productive_s) == (pytest.approx(100), pytest.approx(100))
    assert (g.checkpoints, g.checkpoint_s, g.ratio) == (0, 0.0, pytest.approx(1.0))


def test_a_cause_costs_at_most_what_its_gap_holds() -> None:
    # An asynchronous 120 s save reported between two 1 s steps held nothing up; a 30 s
    # synchronous one at step 50 holds its gap up by 30 s.
    steps = _steady(100)
    steps["time_unix_s"] = [t + (30 if s >= 51 else 0) for s, t in enumerate(steps["time_unix_s"])]
    events = {
        "step": [20, 50],
        "kind": ["checkpoint", "checkpoint"],
        "detail": ['{"duration_s": 120}', '{"duration_s": 30}'],
        "time_unix_s": [T0 + 20.5, T0 + 80.5],
    }
    g = goodput("r", steps, events)
    assert (g.checkpoints, g.checkpoint_s) == (2, pytest.approx(30))
    assert (g.wall_s, g.productive_s) == (pytest.approx(130), pytest.approx(100))
    assert 0 <= g.ratio <= 1


def test_an_async_checkpoint_costs_its_stall_and_supervisor_actions_are_counted() -> None:
    # 1 s steps; an async save stalls step 50's gap by 2 s, and completes 10 s later with
    # nothing held up. The supervisor fences a node and rolls back 12 steps.
    steps = _steady(100)
    steps["time_unix_s"] = [t + (2 if s > 50 else 0) for s, t in enumerate(steps["time_unix_s"])]
    events = {
        "step": [50, 50, 70, 70],
        "kind": ["checkpoint_stall", "checkpoint", "action:fence", "action:rollback"],
        "detail": [
            '{"stall_s": 2}',
            '{"stall_s": 2, "save_s": 10, "async": true}',
            '{"node": "node1"}',
            '{"redone_steps": 12}',
        ],
        "time_unix_s": [T0 + 50.5, T0 + 61.5, T0 + 70.5, T0 + 70.6],
    }
    g = goodput("r", steps, events)
    assert (g.checkpoints, g.checkpoint_s) == (1, pytest.approx(2))
    assert (g.fences, g.rollbacks, g.rolled_back_steps) == (1, 1, 12)
    assert g.summary().endswith("; supervisor: 1 node(s) fenced, 1 rollback(s) of 12 steps")


def _paused_at_50(seconds: float) -> dict:
    """1 s steps, with `seconds` more in the gap before step 51."""
    steps = _steady(100)
    times = steps["time_unix_s"]
    steps["time_unix_s"] = [t + (seconds if s > 50 else 0) for s, t in enumerate(times)]
    return steps


def _pause(kind: str, seconds: float, at_s: float) -> dict:
    detail = json.dumps({"duration_s": seconds})
    return {"step": [50], "kind": [kind], "detail": [detail], "time_unix_s": [at_s]}


def test_a_declared_evaluation_is_its_own_cause_not_a_stall() -> None:
    steps = _paused_at_50(120)
    undeclared = goodput("r", steps, {})
    assert (undeclared.stalls, undeclared.stall_s) == (1, pytest.approx(120))
    g = goodput("r", steps, _pause("pause:eval", 120, T0 + 170.5))
    assert (g.evals, g.eval_s, g.stalls, g.stall_s) == (1, pytest.approx(120), 0, 0.0)
    assert g.productive_s == pytest.approx(100)
    assert "evaluations 2.0 min (1), stalls 0 s (0)" in g.summary()


def test_a_declared_save_is_checkpoint_time_counted_once_with_the_trainers_event() -> None:
    steps = _paused_at_50(60)
    alone = goodput("r", steps, _pause("pause:checkpoint", 60, T0 + 110.5))
    assert (alone.checkpoints, alone.checkpoint_s, alone.stalls) == (1, pytest.approx(60), 0)
    # The trainer's save (58 s) inside its declared pause (60 s): one save of 60 s.
    saved = _pause("checkpoint", 58, T0 + 109.5)
    both = {k: saved[k] + v for k, v in _pause("pause:checkpoint", 60, T0 + 110.5).items()}
    g = goodput("r", steps, both)
    assert (g.checkpoints, g.checkpoint_s, g.stalls) == (1, pytest.approx(60), 0)
    assert "evaluations" not in g.summary()
