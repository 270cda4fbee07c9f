"""Intermittent straggler: one rank that holds the whole job up for single steps, again.

A straggler (straggler.py) is slow in most logged steps of its window. A rank that waits
seconds for one batch in 25 or 100 (a shared file system's bad moments), or stops now and
then for a garbage-collector pause or a page-fault storm, is slow in none of its windows,
and far under the stall's 60 s, yet every rank waits for it each time: in a real 4-rank
run, a rank waiting 10x its compute time for one batch in 25 cost the job 9% of its time
and raised nothing (bench/straggler_shapes.py, the hiccup shapes).

Judged per logged step, on telemetry only:
- a hiccup: the step took at least `min_step_ratio` x the run's typical step (the median
  of its last `typical_steps` logged steps), and a rank held the others back for at
  least `min_explained` of the extra time: it computed, waited for its data, was stopped,
  or arrived at the synchronisation points that much longer or later than an ordinary
  rank (the straggler detector's four signals, in seconds; `held_back_s`). On a busy
  machine slow steps slow every rank alike: in 22 clean real runs of 100-1,000 logged
  steps (4 and 8 ranks, quiet and beside 8 busy processes on 2 cores, two of them saving
  a checkpoint every 25 steps), the rank that explained the most slow steps explained 3
  at most, for at most 0.4% of the run's time;
- a slow step right after one of the same rank's is no new hiccup: a rank that turned
  slow for good is a straggler, the straggler detector's to name, and the typical step
  soon follows it.
A rank is named (one alert, an episode) once the hiccups it caused among the last
`window_steps` training steps number `min_hiccups` and cost the job `min_lost_share` of
the logged time since the first of them (of the last `share_span_steps` steps, at
least); the episode resolves when they number fewer or cost under half that share (a
rank costing about the share itself is not raised and resolved in turn). A rank the
straggler detector names (slow in most steps now: the onset of a straggler can look like
hiccups at first) is handed over: its episode resolves saying so, and its hiccups so far
are dropped, so that one slow rank has one open alert.

With `log_every` above 1 a logged step stands for the steps since the previous one: their
time is the gap between the two steps' `time_unix_s`, and the ranks' compute, data and
stopped times are the hooks' means over them. A hiccup among them shows as their time
beyond the typical (`min_step_ratio` - 1 typical steps at least), which one rank's own
times must explain as above, summed over the steps; lateness is not judged there (the
hooks report it for the logged step alone), so a rank held off the CPU between logged
steps is not seen.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import dataclass, field

import numpy as np

from .alerts import Alert
from .detectors import data_query
from .rolling import RollingWindow
from .runinfo import host_is_device, name_rank
from .straggler import StragglerDetector, sync_time_s
from .views import RankView, StepView

SECTION = "intermittent"
# Logged steps whose times must be known before a step can be called slow: the first
# steps of a run (warm-up, allocation) set no norm.
_MIN_TYPICAL = 20
# How each signal says what the rank did, in an alert.
_DID = {
    "compute_time_s": "computed",
    "wait_time_s": "arrived late at the synchronisation points",  # only that is known
    "data_time_s": "waited for its data",
    "stopped_time_s": "was stopped",
}


@dataclass(frozen=True)
class IntermittentSettings:
    """Thresholds of the intermittent-straggler detector (section "intermittent")."""

    # A logged step is slow at this many times the run's typical step. A 15% straggler's
    # steps are 1.15x; the slow steps of a busy machine slow every rank alike.
    min_step_ratio: float = 1.5
    # Logged steps whose median step time is the run's typical step.
    typical_steps: int = 100
    # Share of a slow step's extra time that a rank must explain for it to be its hiccup.
    min_explained: float = 0.5
    # Training steps over which a rank's hiccups are counted.
    window_steps: int = 500
    # Hiccups within the window that name a rank: one or two are any rank's bad luck.
    min_hiccups: int = 3
    # ... and the share of the window's logged time they cost the job, at least. In the
    # clean runs above, a busy neighbour made one rank explain 3 slow steps in 1,000, 0.2%
    # of the time: the share, not the count, keeps those apart.
    min_lost_share: float = 0.03
    # The share is of the logged time since the rank's first hiccup in the window, or of
    # the last this many steps where that is longer: hiccups that began late in a window
    # that began clean are not diluted by its clean steps (logged every 10 steps, one in 25
    # from step 250 were named 100-180 steps in), and a few close together in a short span
    # are not a share. The clean runs' busiest rank above cost at most 1.2 steps' time in
    # 500, 0.6% of 200.
    share_span_steps: int = 200

    def __post_init__(self) -> None:
        _check(self.min_step_ratio > 1, "min_step_ratio", "must be > 1", self.min_step_ratio)
        _check(self.typical_steps >= 3, "typical_steps", "must be >= 3", self.typical_steps)
        _check(
            0.5 <= self.min_explained <= 1, "min_explained", "must be in [0.5, 1]",
            self.min_explained,
        )  # fmt: skip
        _check(self.window_steps >= 2, "window_steps", "must be >= 2", self.window_steps)
        _check(self.min_hiccups >= 2, "min_hiccups", "must be >= 2", self.min_hiccups)
        _check(
            1 <= self.share_span_steps <= self.window_steps, "share_span_steps",
            f"must be in [1, window_steps ({self.window_steps})]", self.share_span_steps,
        )  # fmt: skip
        _check(
            0 < self.min_lost_share < 1, "min_lost_share", "must be in (0, 1)",
            self.min_lost_share,
        )  # fmt: skip


def _check(ok: bool, name: str, rule: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{SECTION}.{name} {rule}, got {value!r}")


def held_back_s(r: RankView, device_type: str, arrival: bool = True) -> tuple[np.ndarray, list]:
    """Per rank, the seconds it held the others back at this step, and the column that
    says why: by how much its compute time, data wait or stopped time exceeded an ordinary
    rank's, or how much later than an ordinary rank it arrived at the step's
    synchronisation points, whichever is most. Ordinary: the lower quartile of the times
    (the upper of the arrival waits; the last to arrive waits least), not the median,
    which two ranks of four waiting alike would move by half. Lateness is what the others
    waited; a rank's own time that shows half of it or more is named as the cause. Data
    waits count on CPU ranks only, as for the straggler detector (an accelerator's host
    time holds its waits for the device). `arrival` False: own times only."""
    own = {"compute_time_s": r.compute_time_s, "stopped_time_s": r.stopped_time_s}
    if host_is_device(device_type):
        own["data_time_s"] = r.data_time_s
    own = {c: t - np.quantile(t, 0.25) for c, t in own.items() if np.isfinite(t).all()}
    late_s = np.zeros(len(r))
    if arrival and np.isfinite(r.wait_time_s).all():
        collectives_s = (r.all_gather_time_s, r.reduce_scatter_time_s, r.all_reduce_time_s)
        sync_s = sync_time_s(r.wait_time_s, collectives_s)
        late_s = np.nan_to_num(np.quantile(sync_s, 0.75) - sync_s, nan=0.0)
    if not own:
        return late_s, ["wait_time_s"] * len(r)
    names = list(own)
    own_s = np.stack([own[n] for n in names])
    cause, most_own_s = own_s.argmax(axis=0), own_s.max(axis=0)
    held_s = np.maximum(most_own_s, late_s)
    columns = [
        names[c] if most_own_s[i] >= 0.5 * held_s[i] else "wait_time_s" for i, c in enumerate(cause)
    ]
    return held_s, columns


@dataclass(frozen=True)
class _Hiccup:
    step: int
    rank: int
    lost_s: float
    column: str


@dataclass
class IntermittentStragglerDetector:
    settings: IntermittentSettings = field(default_factory=IntermittentSettings)
    kind: str = "intermittent_straggler"
    # The run's straggler detector, observed before this one at each step (None: alone).
    straggler: StragglerDetector | None = None

    def __post_init__(self) -> None:
        s = self.settings
        self._typical = RollingWindow(s.typical_steps)
        self._times: deque[tuple[int, float]] = deque()  # (step, step time) in the window
        self._hiccups: deque[_Hiccup] = deque()
        # (step, rank) of every slow step a rank explained in the window, hiccup or not
        self._slow_steps: deque[tuple[int, int]] = deque()
        self._last_culprits: set[int] = set()  # the ranks that explained the last step
        self._open: dict[int, Alert] = {}  # rank -> its episode's alert
        self._previous: tuple[int, float] | None = None  # (step, time_unix_s) logged last

    def observe(self, s: StepView) -> list[Alert]:
        r = s.ranks
        previous, self._previous = self._previous, (s.step, s.time_unix_s)
        steps, step_time_s = 1, s.step_time_s
        if previous is not None and s.step - previous[0] > 1:
            # the time of every step since the last logged one, not this one's alone
            steps = s.step - previous[0]
            step_time_s = (s.time_unix_s - previous[1]) / steps
        if r is None or len(r) < 3 or not step_time_s > 0 or not math.isfinite(step_time_s):
            return []
        typical_s = self._typical.median() if len(self._typical) >= _MIN_TYPICAL else math.nan
        self._typical.push(step_time_s)
        self._slide(s.step, steps * step_time_s)
        culprits: set[int] = set()
        # The steps' time beyond their typical: one slow step among them, at least.
        extra_s = steps * (step_time_s - typical_s)
        least_s = (self.settings.min_step_ratio - 1) * typical_s
        if extra_s >= least_s:
            # One step: a rank explains half its extra time. Several: a rank's own time
            # beyond an ordinary rank's is a slow step's extra time by itself, whatever
            # else slowed them (on a busy machine, a few seconds' slowness of every rank
            # over ten steps would otherwise hide a hiccup among them).
            need_s = self.settings.min_explained * extra_s if steps == 1 else least_s
            culprits = self._hiccups_at(s, r, extra_s, need_s, steps)
        self._last_culprits = culprits
        return self._judge(s)

    def _slide(self, step: int, time_s: float) -> None:
        """The time of the steps up to `step` since the last logged one into the window,
        and steps and hiccups that left it out."""
        first = step - self.settings.window_steps + 1
        self._times.append((step, time_s))
        while self._times[0][0] < first:
            self._times.popleft()
        while self._hiccups and self._hiccups[0].step < first:
            self._hiccups.popleft()
        while self._slow_steps and self._slow_steps[0][0] < first:
            self._slow_steps.popleft()

    def _hiccups_at(
        self, s: StepView, r: RankView, extra_s: float, need_s: float, steps: int
    ) -> set[int]:
        """The ranks that explain this slow step (two that waited alike both do); each is
        recorded as a hiccup unless it also explained the logged step before. Over `steps`
        steps since the last logged one, the ranks' own times are means over them (the
        hooks'), and their lateness is the logged step's alone: not counted."""
        held_s, columns = held_back_s(r, s.run.device_type, arrival=steps == 1)
        held_s = held_s * steps
        culprits = set()
        for i in np.flatnonzero(held_s >= need_s):
            rank = int(r.rank[i])
            culprits.add(rank)
            self._slow_steps.append((s.step, rank))
            if rank not in self._last_culprits:
                lost_s = float(min(held_s[i], extra_s))
                self._hiccups.append(_Hiccup(s.step, rank, lost_s, columns[i]))
        return culprits

    def _judge(self, s: StepView) -> list[Alert]:
        """At most one row per step (the alerts table's key): a hand-over to the straggler
        detector first, then a new episode."""
        persistent = self.straggler.named_ranks() if self.straggler is not None else set()
        if persistent:
            self._hiccups = deque(h for h in self._hiccups if h.rank not in persistent)
            for rank in sorted(persistent & set(self._open)):
                return [self._hand_over(s, rank)]
        by_rank: dict[int, list[_Hiccup]] = {}
        for h in self._hiccups:
            by_rank.setdefault(h.rank, []).append(h)
        named = {rank for rank, hs in by_rank.items() if self._names(hs, 1.0)}
        for rank in sorted(named - set(self._open)):
            return [self._raise(s, rank, by_rank[rank])]
        for rank in sorted(self._open):
            if not self._names(by_rank.get(rank, []), 0.5):
                return [self._resolve(s, rank, by_rank.get(rank, []))]
        return []

    def _names(self, hiccups: list[_Hiccup], share_part: float) -> bool:
        """Whether these hiccups name their rank: `share_part` of the share the settings
        ask (half, to keep an open episode: a rank costing about the share itself would
        otherwise be raised and resolved in turn)."""
        s = self.settings
        if len(hiccups) < s.min_hiccups:
            return False
        return self._share(hiccups) >= share_part * s.min_lost_share

    def _since(self, hiccups: list[_Hiccup]) -> int:
        """The first step of the time the hiccups' share is of: the first of them, or the
        first of the last `share_span_steps` steps where that is earlier (a window that
        began clean would otherwise dilute hiccups that began late)."""
        return min(hiccups[0].step, self._times[-1][0] - self.settings.share_span_steps + 1)

    def _share(self, hiccups: list[_Hiccup], since: int | None = None) -> float:
        """The share of the time since `since` (`_since`'s step when None) that these
        hiccups cost: the logged time, and the steps before the run's first logged one
        (a run younger than `share_span_steps`) at the typical step's time. A young run's
        first steps are its noisiest (allocators, caches, data workers starting, all on a
        busy machine): three waits of 88 ms in its first 33 steps were 3% of their time
        and named a rank of a clean 60-step run; they are 0.5% of 200 steps."""
        since = self._since(hiccups) if since is None else since
        span_s = sum(t for step, t in self._times if step >= since)
        unseen = self._times[0][0] - since  # steps before the first logged one, if any
        if unseen > 0 and len(self._typical) >= _MIN_TYPICAL:
            span_s += unseen * self._typical.median()
        return sum(h.lost_s for h in hiccups) / span_s

    def _raise(self, s: StepView, rank: int, hiccups: list[_Hiccup]) -> Alert:
        lost_s = sum(h.lost_s for h in hiccups)
        since = self._since(hiccups)
        share = self._share(hiccups, since)
        column = Counter(h.column for h in hiccups).most_common(1)[0][0]
        steps = ", ".join(str(h.step) for h in hiccups[-5:])
        alert = Alert.at(
            s,
            kind=self.kind,
            severity="warning",
            message=(
                f"{name_rank(s.run, rank)} held the whole job up {len(hiccups)} times in the "
                f"last {self.settings.window_steps} steps (last at steps {steps}): each time "
                f"it {_DID[column]} and the others waited about "
                f"{1e3 * lost_s / len(hiccups):.0f} ms for it, {lost_s:.1f} s in all, "
                f"{100 * share:.0f}% of {self._span_words(since)}; "
                + self._between(rank, len(hiccups))
                + " Data: "
                + data_query(s.run_id, "ranks", column, hiccups[0].step, s.step)
            ),
            value=share,
            baseline=self.settings.min_lost_share,
            rank=rank,
            start_step=hiccups[0].step,
        )
        self._open[rank] = alert
        return alert

    def _span_words(self, since: int) -> str:
        """What the share is of, in words (see `_share`)."""
        first = self._times[0][0]
        if since >= first:
            return f"the logged time since step {since}"
        return (
            f"the time of the last {self.settings.share_span_steps} steps (this run's "
            f"{self._times[-1][0] - first + 1} so far, the rest at its typical step)"
        )

    def _between(self, rank: int, hiccups: int) -> str:
        """What the rank did between its hiccups: kept pace, or stayed slow for more steps
        (the onset of a straggler that is slow only just over the bar, at first)."""
        more = sum(1 for _, r in self._slow_steps if r == rank) - hiccups
        if more <= 0:
            return (
                "between those steps it made none "
                f"{self.settings.min_step_ratio:g}x the typical step (too rarely slow for a "
                "straggler, too briefly for a stall: a shared file system's bad moments, a "
                "collector pause, a page-fault storm)."
            )
        return (
            f"it also held the job up in {more} step{'s' if more > 1 else ''} right after "
            "those: it may be turning into a straggler, which the straggler detector names "
            "once it stays slow."
        )

    def _hand_over(self, s: StepView, rank: int) -> Alert:
        """Resolve the episode of a rank the straggler detector now names."""
        return self._open.pop(rank).resolved_at(
            s.step,
            s.time_unix_s,
            f"{name_rank(s.run, rank)} is now slow in most steps, not in single ones: the "
            "straggler alert names it from here.",
        )

    def _resolve(self, s: StepView, rank: int, hiccups: list[_Hiccup]) -> Alert:
        alert = self._open.pop(rank)
        lost_s = sum(h.lost_s for h in hiccups)
        return alert.resolved_at(
            s.step,
            s.time_unix_s,
            f"{name_rank(s.run, rank)} no longer holds the job up: {len(hiccups)} hiccups, "
            f"{lost_s:.1f} s, in the last {self.settings.window_steps} steps.",
        )
