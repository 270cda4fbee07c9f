"""Goodput: how much of a run's wall time trained the model, and where the rest went.

From a stored run's steps (step, time_unix_s, step_time_s) and events:
- wall time: from the start of the first logged step (its time minus its step time) to
  the last logged step's time;
- the usual time per step: median over consecutive logged steps of gap / steps spanned;
- restarts ('restart' events): the gap between the last step logged before the event and
  the first logged after it, less the normal time of the steps trained in between. The
  event's step is the first step the restarted job trains; the steps from there up to
  the last step logged before the restart are *re-done*: trained twice, their time
  (count x usual step time) is lost too. A store keeps the first copy of each step (its
  key is (run, step)), so re-done steps are counted from the event, not from the rows;
- checkpoints ('checkpoint' events): their detail's `duration_s`, where given; an
  asynchronous one ('checkpoint_stall' at its start, trainer/checkpointer.py) costs only
  the stall, its `stall_s`, and its 'checkpoint' event at completion costs nothing. A
  declared save (`monitor.pause("checkpoint")`: a 'pause:checkpoint' event with its
  `duration_s`) counts too; where a gap holds both, the save inside the pause is the same
  time, so the gap's checkpoint time is the larger of the two, and its count the events';
- evaluations: declared ones (`monitor.pause("eval")`: 'pause:eval' events) by their
  `duration_s`. Not training, but not a stall either: a gap they fill is no stall;
- the supervisor's actions (supervisor/agent.py) are counted, not timed: their cost is the
  restart gap and the re-done steps above ('action:fence' nodes fenced, 'action:rollback'
  rollbacks and the steps they sent training back, 'action:relaunch' relaunches);
- stalls: whatever else a gap holds beyond its steps' normal time, in gaps that the stall
  detector's rule calls a stall (stall.is_stall, same thresholds);
- productive time: the rest. Goodput = productive / wall.
Small per-step jitter is productive time: only the causes above count as lost. Each cause
is taken out of the gap that holds its event, and at most what that gap holds beyond its
steps' normal time, in the order above: an event outside the wall time (a checkpoint
saved after the last logged step) or one that did not hold training up (an asynchronous
checkpoint) costs nothing, and goodput stays within 0..1.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from .stall import StallSettings, is_stall

# The event kinds goodput reads: a store's readers select these and no others.
EVENT_KINDS = (
    "restart", "checkpoint", "checkpoint_stall", "pause:checkpoint", "pause:eval",
    "action:fence", "action:rollback",
)  # fmt: skip


@dataclass(frozen=True)
class Goodput:
    run_id: str
    wall_s: float
    productive_s: float
    restart_s: float
    restarts: int
    redone_steps: int
    redone_s: float
    checkpoint_s: float
    checkpoints: int
    stall_s: float
    stalls: int
    step_s: float  # the usual time per step
    fences: int = 0  # nodes the supervisor fenced
    rollbacks: int = 0  # checkpoint rollbacks by the supervisor
    rolled_back_steps: int = 0  # steps those rollbacks sent training back by
    eval_s: float = 0.0  # declared evaluations (monitor.pause("eval"))
    evals: int = 0

    @property
    def ratio(self) -> float:
        return self.productive_s / self.wall_s if self.wall_s > 0 else math.nan

    def to_dict(self) -> dict:
        return {**asdict(self), "ratio": self.ratio}

    def summary(self) -> str:
        d = _duration
        return (
            f"goodput of run {self.run_id}: {self.ratio:.1%} of {d(self.wall_s)} trained "
            f"the model; lost: restarts {d(self.restart_s)} ({self.restarts}), re-done "
            f"steps {d(self.redone_s)} ({self.redone_steps} steps), checkpoints "
            f"{d(self.checkpoint_s)} ({self.checkpoints}), "
            + (f"evaluations {d(self.eval_s)} ({self.evals}), " if self.evals else "")
            + "stalls "
            f"{d(self.stall_s)} ({self.stalls})"
            + (
                f"; supervisor: {self.fences} node(s) fenced, {self.rollbacks} rollback(s) "
                f"of {self.rolled_back_steps} steps"
                if self.fences or self.rollbacks
                else ""
            )
        )


def _duration(seconds: float) -> str:
    """In the unit that keeps a short run's losses readable: '12 s', '23.0 min', '5.20 h'."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


# What goodput reads of a stored run; `?` parameters: the run id, then EVENT_KINDS.
STEPS_SQL = "SELECT step, time_unix_s, step_time_s FROM steps WHERE run_id = ? ORDER BY step"
EVENTS_SQL = (
    "SELECT step, kind, detail, time_unix_s FROM events WHERE run_id = ? "
    "AND list_contains(?, kind) ORDER BY time_unix_s"
)


def stored_goodput(run_id: str, query: Callable[[str, list], Any]) -> Goodput:
    """Goodput of a stored run. `query(sql, params)` returns a pyarrow table (Store.query,
    or a DuckDB connection's): the dashboard's figure and `trainvitals replay`'s are this
    one function's."""
    table = query(STEPS_SQL, [run_id])
    # numpy columns, not Python lists: a million steps' lists took longer than the rest.
    steps = {name: table.column(name).to_numpy() for name in table.column_names}
    events = query(EVENTS_SQL, [run_id, list(EVENT_KINDS)]).to_pydict()
    return goodput(run_id, steps, events)


def goodput(
    run_id: str,
    steps: dict[str, Any],
    events: dict[str, list],
    min_gap_s: float = StallSettings.min_gap_s,
    min_intervals: float = StallSettings.min_intervals,
) -> Goodput:
    """Goodput of one run from its steps columns (step, time_unix_s, step_time_s: lists
    or numpy arrays) and events columns (step, kind, detail, time_unix_s: lists)."""
    step = np.asarray(steps["step"], dtype=np.int64)
    t = np.asarray(steps["time_unix_s"], dtype=np.float64)
    step_time = np.asarray(steps.get("step_time_s", [math.nan] * len(step)), dtype=np.float64)
    if (np.diff(t) < 0).any():  # read in step order, a run's times rise: sorted rarely
        order = np.argsort(t, kind="stable")
        step, t, step_time = step[order], t[order], step_time[order]
    if (np.diff(step) <= 0).any():  # the first copy of a step counts, as in a store
        _, first = np.unique(step, return_index=True)
        keep = np.sort(first)
        step, t, step_time = step[keep], t[keep], step_time[keep]
    empty = Goodput(run_id, 0.0, 0.0, 0.0, 0, 0, 0.0, 0.0, 0, 0.0, 0, math.nan, *_actions(events))
    if len(step) < 2:
        return empty
    gap, spanned = np.diff(t), np.diff(step)
    ok = spanned > 0
    per_step = float(np.median(gap[ok] / spanned[ok])) if ok.any() else math.nan
    first_s = step_time[0] if math.isfinite(step_time[0]) else per_step
    wall = float(t[-1] - t[0] + max(first_s, 0.0))
    ev = _events_by_gap(events, step, t)
    # What each gap holds beyond its steps' normal time, handed out cause by cause.
    spare = np.maximum(gap - np.maximum(spanned, 0) * per_step, 0.0)
    checkpoint = np.minimum(ev.checkpoint_s, spare)
    spare -= checkpoint
    evaluation = np.minimum(ev.eval_s, spare)
    spare -= evaluation
    redone = np.where(ev.restarted, np.minimum(ev.redone_steps * per_step, spare), 0.0)
    spare -= redone
    restart = np.where(ev.restarted, spare, 0.0)
    stalled = ~ev.restarted & ok & _stalls(spare, spanned, per_step, min_gap_s, min_intervals)
    stall = np.where(stalled, spare, 0.0)
    lost = checkpoint.sum() + evaluation.sum() + redone.sum() + restart.sum() + stall.sum()
    return Goodput(
        run_id,
        wall,
        wall - float(lost),
        float(restart.sum()),
        ev.restarts,
        int(ev.redone_steps.sum()),
        float(redone.sum()),
        float(checkpoint.sum()),
        ev.checkpoints,
        float(stall.sum()),
        int(stalled.sum()),
        per_step,
        *_actions(events),
        float(evaluation.sum()),
        ev.evals,
    )


def _actions(events: dict[str, list]) -> tuple[int, int, int]:
    """(nodes fenced, rollbacks, steps rolled back) from the supervisor's events."""
    fences = rollbacks = rolled_back = 0
    for kind, detail in zip(events.get("kind", []), events.get("detail", []), strict=True):
        if kind == "action:fence":
            fences += 1
        elif kind == "action:rollback":
            rollbacks += 1
            steps = _detail(detail).get("redone_steps")
            rolled_back += steps if isinstance(steps, int) else 0
    return fences, rollbacks, rolled_back


@dataclass(frozen=True)
class _GapEvents:
    """The restart and checkpoint events inside the wall time, per gap between logged steps."""

    restarted: np.ndarray  # bool: a restart event in the gap
    redone_steps: np.ndarray  # steps trained again after that restart
    checkpoint_s: np.ndarray  # checkpoint durations reported in the gap
    eval_s: np.ndarray  # declared evaluations' durations in the gap
    restarts: int
    checkpoints: int
    evals: int


def _events_by_gap(events: dict[str, list], step: np.ndarray, t: np.ndarray) -> _GapEvents:
    n = len(t) - 1
    restarted, redone = np.zeros(n, bool), np.zeros(n, np.int64)
    checkpoint_s, paused_s, eval_s = np.zeros(n), np.zeros(n), np.zeros(n)
    restarts = checkpoints = evals = 0
    saved = np.zeros(n, bool)  # a 'checkpoint' or 'checkpoint_stall' event in the gap
    declared = np.zeros(n, np.int64)  # 'pause:checkpoint' events in the gap
    for kind, ev_step, ev_t, detail in zip(
        events.get("kind", []),
        events.get("step", []),
        events.get("time_unix_s", []),
        events.get("detail", []),
        strict=True,
    ):
        i = int(np.searchsorted(t, ev_t)) - 1  # the gap (t[i], t[i + 1]] holding the event
        if not 0 <= i < n:
            continue  # outside the wall time: it cost none of it
        if kind == "restart":
            restarts += 1
            restarted[i] = True
            redone[i] += max(0, int(step[: i + 1].max()) - int(ev_step) + 1)
        elif kind in ("checkpoint", "checkpoint_stall"):
            d = _detail(detail)
            checkpoints += kind == "checkpoint"
            # An async save's time is its stall, charged at its start; its completion is free.
            key = "stall_s" if kind == "checkpoint_stall" else "duration_s"
            checkpoint_s[i] += _seconds(d, key)
            saved[i] = True
        elif kind in ("pause:checkpoint", "pause:eval"):
            seconds = _seconds(_detail(detail), "duration_s")
            if kind == "pause:eval":
                evals, eval_s[i] = evals + 1, eval_s[i] + seconds
            else:
                paused_s[i], declared[i] = paused_s[i] + seconds, declared[i] + 1
    # A declared save wraps the trainer's own checkpoint event: the same time, counted once.
    checkpoints += int(declared[~saved].sum())
    checkpoint_s = np.maximum(checkpoint_s, paused_s)
    return _GapEvents(restarted, redone, checkpoint_s, eval_s, restarts, checkpoints, evals)


def _stalls(
    spare: np.ndarray, spanned: np.ndarray, per_step: float, min_gap_s: float, k: float
) -> np.ndarray:
    """Gaps that the stall rule calls a stall, on what is left of them after checkpoints."""
    return np.asarray(is_stall(spare + spanned * per_step, spanned, per_step, min_gap_s, k))


def _seconds(detail: dict, key: str) -> float:
    """A duration from an event's detail; 0 where missing, not a number, or not positive."""
    value = detail.get(key)
    return float(value) if isinstance(value, int | float) and value > 0 else 0.0


def _detail(detail: str | None) -> dict:
    try:
        value = json.loads(detail or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
