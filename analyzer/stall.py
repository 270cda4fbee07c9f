"""Stall: the job, or one rank, stopped making progress for a while.

Judged on telemetry timestamps only (steps.time_unix_s), never on the clock of the
machine running the analyzer, so a replay raises exactly the live alerts:
- the job stalled: the gap between two consecutive logged steps exceeds `min_gap_s`
  *and* `min_intervals` times the typical time per step (rolling median of the last
  `window` gaps, each divided by the steps it spans) times the steps it spans. When the
  ranks table shows everybody waiting for one late rank at the step that ended the gap,
  that rank is named;
- a rank went silent: it reported before, and logged steps kept coming without it for
  more than `min_gap_s` and `min_intervals` typical gaps between logged steps.
The alert comes with the first step after the gap: a stall still going on sends no step
at all, so live, a *current* stall is seen by the clock, outside the analyzer: the
collector exports each run's last step time (trainvitals_last_step_timestamp_seconds)
and the TrainvitalsRunStalled rule (deploy/prometheus/alerts.yml) fires on it.
A pause the training loop declared (`monitor.pause`: a checkpoint save, an evaluation;
its `pause:<phase>` event carries its duration) is not the job's stall: the time it covers
is taken out of the gap first. An undeclared checkpoint save or a restart longer than the
thresholds shows up here as a stall; goodput (goodput.py) tells them apart using the run's
events.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from .alerts import Alert
from .detectors import data_query
from .rolling import RollingWindow
from .runinfo import name_rank, name_ranks
from .views import PAUSE_EVENT_KINDS, RunEvent, StepView


def is_stall(gap_s, steps, per_step_s: float, min_gap_s: float, k: float):
    """The rule shared with goodput: a gap long in absolute terms and against the norm.
    Elementwise on numpy arrays of gaps and steps (goodput judges a whole run at once)."""
    return np.logical_and(gap_s > min_gap_s, gap_s > k * per_step_s * steps)


# A rank's own time that can hold up the job, and how a message says it was spent.
OWN_TIME = (
    ("data_time_s", "waiting for its data"),
    ("compute_time_s", ""),
    ("stopped_time_s", "stopped (neither running nor waiting for a CPU: SIGSTOP, a freezer, "
     "a debugger, a paused VM)"),
)  # fmt: skip


@dataclass(frozen=True)
class StallSettings:
    """Thresholds of the stall detector (section "stall")."""

    # A gap in the telemetry shorter than this never counts, in seconds: a checkpoint save
    # or an evaluation pauses a job for tens of seconds as a matter of course.
    min_gap_s: float = 60.0
    # ... and it must also exceed this many typical times per step (times the steps it
    # spans): 10x is a pause, not noise, on any step time.
    min_intervals: float = 10.0
    # Gaps between logged steps whose median is the typical time per step.
    window: int = 50
    # Gaps needed before the typical time is trusted.
    min_history: int = 5

    def __post_init__(self) -> None:
        if not self.min_gap_s > 0:
            raise ValueError(f"stall.min_gap_s must be > 0 seconds, got {self.min_gap_s!r}")
        if not self.min_intervals > 1:
            raise ValueError(f"stall.min_intervals must be > 1, got {self.min_intervals!r}")
        if self.window < 1:
            raise ValueError(f"stall.window must be >= 1, got {self.window!r}")
        if not 1 <= self.min_history <= self.window:
            raise ValueError(
                f"stall.min_history must be in 1..stall.window ({self.window}), "
                f"got {self.min_history!r}"
            )


@dataclass
class StallDetector:
    settings: StallSettings = field(default_factory=StallSettings)
    kind: str = "stall"
    _per_step: RollingWindow = field(init=False, repr=False)  # seconds per step
    _gaps: RollingWindow = field(init=False, repr=False)  # seconds between logged steps
    _prev: tuple[int, float] | None = None
    # (start, end) of the declared pauses heard of, newest last (a few: gaps look back one)
    _pauses: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=64))
    # Per rank seen, in ascending rank order (`_ranks`: their ids): sized by the ranks
    # that reported, not by the largest id, which ingest allows up to 2**31 - 1.
    _ranks: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64), repr=False)
    _seen_t: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)
    _seen_step: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64), repr=False)
    _silent: np.ndarray = field(default_factory=lambda: np.zeros(0, bool), repr=False)

    def __post_init__(self) -> None:
        self._per_step = RollingWindow(self.settings.window)
        self._gaps = RollingWindow(self.settings.window)

    def observe_events(self, events: list[RunEvent]) -> None:
        """Declared pauses (`pause:<phase>` events, at their end, with their duration), and
        restarts: a relaunched job's ranks are heard afresh, so ranks of the job before it
        that the new one lacks (a node fenced, a relaunch on fewer nodes) are not silent."""
        for e in events:
            if e.kind in PAUSE_EVENT_KINDS and e.duration_s > 0:
                self._pauses.append((e.time_unix_s - e.duration_s, e.time_unix_s))
            elif e.kind == "restart":
                self._forget_ranks()

    def _forget_ranks(self) -> None:
        self._ranks = np.zeros(0, np.int64)
        self._seen_t, self._seen_step = np.zeros(0), np.zeros(0, np.int64)
        self._silent = np.zeros(0, bool)

    def _paused_s(self, t0: float, t1: float) -> float:
        """Seconds of (t0, t1) that declared pauses cover."""
        return sum(max(0.0, min(end, t1) - max(start, t0)) for start, end in self._pauses)

    def observe(self, s: StepView) -> list[Alert]:
        t = s.time_unix_s
        if t is None or not math.isfinite(t):
            return []
        ready = len(self._per_step) >= self.settings.min_history
        parts, rank, value, baseline = [], None, None, None
        start = s.step
        if self._prev is not None:
            step0, t0 = self._prev
            n, paused_s = s.step - step0, self._paused_s(t0, t)
            gap = t - t0 - paused_s  # a declared pause is not the job's stall
            if gap >= 0 and n > 0:
                per_step = self._per_step.median() if ready else math.nan
                cfg = self.settings
                if ready and is_stall(gap, n, per_step, cfg.min_gap_s, cfg.min_intervals):
                    rank, why = self._late_rank(s, gap - per_step * n, n)
                    declared = f" besides {paused_s:.0f} s of declared pauses" if paused_s else ""
                    parts.append(
                        f"the job made no progress for {gap:.0f} s{declared} between step "
                        f"{step0} and step {s.step}, {gap / (per_step * n):.0f}x the usual "
                        f"{per_step * n:.3g} s{why}"
                    )
                    value, baseline, start = gap, per_step * n, step0
                else:
                    self._per_step.push(gap / n)
                    self._gaps.push(gap)
        self._prev = (s.step, t)
        silent = self._silent_slots(s, ready)
        if len(silent):
            first, ids = silent[0], self._ranks[silent]
            rank = ids[0] if rank is None else rank
            since = int(self._seen_step[first])
            start = min(start, since)
            parts.append(
                f"{name_ranks(s.run, ids.tolist())} reported nothing for "
                f"{t - self._seen_t[first]:.0f} s (last at step {since}) while the "
                "other ranks went on: a dead exporter, a lost node, or a rank that left"
            )
        if not parts:
            return []
        return [
            Alert(
                run_id=s.run_id,
                step=s.step,
                kind=self.kind,
                severity="critical",
                message="; ".join(parts)
                + ". Data: "
                + data_query(s.run_id, "ranks", "step_time_s", start, s.step),
                time_unix_s=t,
                value=value,
                baseline=baseline,
                rank=None if rank is None else int(rank),
            )
        ]

    def _late_rank(self, s: StepView, excess_s: float, steps: int) -> tuple[int | None, str]:
        """The rank everybody waited for at the step that ended the gap, if that is clear:
        the one the others waited for at the step's synchronisation point (wait_time_s),
        else the one that alone spent the gap before its forward (data_time_s), in its
        own work (compute_time_s) or stopped (stopped_time_s: a frozen process). The
        second covers backends whose waits do not show where the others really waited (on
        gloo they wait inside FSDP's collectives). Those three are means over the `steps`
        since the previous logged step: their total is what the gap held."""
        r = s.ranks
        if r is None or len(r) < 2:
            return None, ""
        waits = np.isfinite(r.wait_time_s).all()
        if waits:
            late = int(np.argmin(r.wait_time_s))
            others = float(np.median(np.delete(r.wait_time_s, late)))
            if others >= 0.5 * excess_s:
                return int(r.rank[late]), (
                    f"; the other ranks waited {others:.0f} s for "
                    f"{name_rank(s.run, r.rank[late])}, the last to arrive"
                )
        for column, doing in OWN_TIME:
            own = getattr(r, column)
            if own is None or not np.isfinite(own).all():
                continue
            own = own * steps
            late = int(np.argmax(own))
            others = float(np.median(np.delete(own, late)))
            if own[late] - others >= 0.5 * excess_s:
                what = f" {doing}" if doing else ""
                return int(r.rank[late]), (
                    f"; {name_rank(s.run, r.rank[late])} spent {own[late]:.0f} s{what} "
                    f"({column}; the other ranks' median {others:.3g} s): the job waited for it"
                )
        return None, "; no rank kept the others waiting (the whole job paused)" if waits else ""

    def _silent_slots(self, s: StepView, ready: bool) -> np.ndarray:
        """Slots (positions in `_ranks`) of the ranks that just went silent."""
        r = s.ranks
        if r is None or not len(r):
            return np.empty(0, np.int64)
        slots = self._slots(r.rank)
        self._seen_t[slots] = s.time_unix_s
        self._seen_step[slots] = s.step
        self._silent[slots] = False
        if not ready:
            return np.empty(0, np.int64)
        age = s.time_unix_s - self._seen_t
        bar = max(self.settings.min_gap_s, self.settings.min_intervals * self._gaps.median())
        with np.errstate(invalid="ignore"):
            gone = np.flatnonzero((age > bar) & ~self._silent)  # NaN: never seen
        self._silent[gone] = True
        return gone

    def _slots(self, ranks: np.ndarray) -> np.ndarray:
        """Slots of `ranks` (distinct ids), adding the ranks not seen before."""
        known = self._ranks
        dense = len(known) and known[-1] == len(known) - 1  # known ids: 0..K-1
        if dense and int(ranks.min()) >= 0 and int(ranks.max()) < len(known):
            return ranks  # every rank 0..K-1 seen already (the usual case): rank = slot
        new = np.setdiff1d(ranks, known, assume_unique=True)
        if len(new):
            merged = np.union1d(known, new)
            old = np.searchsorted(merged, known)
            self._ranks = merged
            self._seen_t = _regrid(self._seen_t, old, len(merged), math.nan)
            self._seen_step = _regrid(self._seen_step, old, len(merged), 0)
            self._silent = _regrid(self._silent, old, len(merged), False)
        return np.searchsorted(self._ranks, ranks)


def _regrid(values: np.ndarray, at: np.ndarray, size: int, fill: float | bool) -> np.ndarray:
    """`values` moved to positions `at` of a new array of `size`, the rest `fill`."""
    out = np.full(size, fill, dtype=values.dtype)
    out[at] = values
    return out
