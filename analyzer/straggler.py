"""Straggler: a rank whose own work is persistently slower than its cohort's.

In a synchronous job every rank's step takes as long as the slowest rank's, so wall time
names nobody. Each rank's excess at a step does, by three signals judged apart: the log of
its compute time over the median rank's (the hooks report the training thread's CPU time
on CPU ranks, CUDA event time on GPU ranks), how much later than the median rank it
arrived at the step's synchronisation points (the step's end and the model's timed
collectives: `sync_time_s`), as a fraction of the step (the only one from a producer
without compute times), and, on CPU ranks, how much longer than the median rank it
waited for its data (`data_time_s`), as a fraction of the step (a slow file system or a
starved loader on its node: off the CPU, and the others wait for it in the forward's first
collectives, which tell only where they are timed; an accelerator's host time also holds
its waits for the device, and NCCL's collectives are timed) and how much
longer than the median rank its process was stopped, as a fraction of the step
(hooks/stopped.py: a rank stopped from outside uses no more CPU time, and most of its
stops land inside a collective, where every rank waits anyway, so neither other signal
moves enough).

Per signal, the bar is the run's own rank-to-rank spread, not a fixed percentage: a
robust sigma of the excesses (1.4826 x the median over recent steps of the cohort's median absolute
excess, its slowest rank left out) times `spread_multiple`, never under `min_excess`. A
busy machine widens the spread and raises the bar with it. A rank is slow when its
excess cleared the bar in at least `persist_fraction` of the logged steps of its window,
the last `persist_steps` training steps (at least `min_logged_steps` logged ones, so that
a sparse log_every still gives the fraction something to count; one noisy step, or a
few, never count) and, judged by its compute time, it also kept others waiting: it
arrived after every other rank, or after every other of its data-parallel peers (the
ranks it last synchronised with), in `min_last_fraction` of them, or twice as often as
chance among many (a busy neighbour inflates a rank's CPU time more than its progress).
An episode raises one alert (ranks that turn slow at the same step share it) with its
onset in `start_step` and its cost in seconds per step, and ends with one resolve row
once its ranks stayed under half the bar as persistently.

`excess`, `arrival_excess`, `share_excess`, `rank_scores`, `kept_waiting` and `in_bursts` are pure
functions of a window: the dashboard's "Slowest ranks" table calls them too, on bucket
means.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from .alerts import Alert
from .attribution import MAD_TO_SIGMA
from .detectors import data_query
from .rolling import median as fast_median
from .runinfo import host_is_device, name_rank, name_ranks
from .views import RankView, StepView

SECTION = "straggler"
# A clean rank is in a burst at a logged step when it cleared the bar (by either signal)
# in this many logged steps in a row: a busy neighbour's slowdown, not one noisy step.
BURST_STEPS = 3


@dataclass(frozen=True)
class StragglerSettings:
    """Thresholds of the straggler detector (section "straggler")."""

    # Training steps (not logged ones) over which a slowdown must last to count. On clean
    # 4-rank CPU runs with 8 busy processes on 2 cores, one rank ran 23% slower for about
    # 18 steps (a busy neighbour): a straggler must outlast that. 25 still names one
    # within 30 steps. Every step logged, the window holds 25 logged steps; at log_every=4, 7.
    persist_steps: int = 25
    # Logged steps the window holds at least: where log_every leaves fewer in
    # persist_steps steps, the window reaches back further (at log_every=10, 60 steps).
    # 5 is the fewest in which persist_fraction (0.8) leaves room for one noisy step; at
    # 5, one of 4 clean 1,000-step dp=4 runs logged every 10 steps with 8 busy processes
    # on 2 cores named a busy neighbour's 40-step slowdown (4 of 5 logged steps; sparse
    # logging rarely shows the bursts that make a cohort restless). 6 did not, and named
    # a 15% straggler on the same loaded machine as soon (bench/detect.py).
    min_logged_steps: int = 6
    # Share of the window's logged steps in which the rank's excess must clear the bar
    # (0.8: 20 of 25). One noisy step, or five, in the window do not decide either way.
    persist_fraction: float = 0.8
    # The bar in robust sigmas of the run's rank-to-rank spread (per step, the slowest rank
    # left out). Clean 4-rank CPU runs with 8 busy processes on 2 cores came within 3.7
    # sigmas of it over 25 steps; 15% stragglers on the same loaded machine cleared 5.1
    # to 8.2 sigmas, and a quiet run's sigma is 1.2%, under the floor's reach.
    spread_multiple: float = 5.0
    # Floor of the bar, as an excess (log of the compute ratio; 0.06 ~ 6% slower). Keeps a
    # very even cohort (a spread near 0) from flagging rank-to-rank differences of 1-2%,
    # and sits under the 10% slowdown worth naming on a quiet machine.
    min_excess: float = 0.06
    # Floor of the stopped signal's bar: a share of the step stopped beyond the median
    # rank's. Its noise (the stopped clock's GIL waits) was about 1% of the wall time on
    # every rank alike, idle or with 8 busy processes on 2 cores, rank to rank within
    # 0.5% (bench/results/stopped_clock.txt); a rank stopped 12 ms of every 100 ms
    # showed about 6%.
    min_stopped_share: float = 0.03
    # Floor of the data signal's bar: a share of the step spent waiting for data beyond
    # the median rank's. The hooks time the wait from the optimizer step's end to the
    # forward (before FSDP's all-gather), about 0.5 ms of a 140-180 ms step on every rank
    # of a quiet 4-rank CPU run; a rank waiting as long as it computes showed 25%
    # (bench/straggler_shapes.py, `how=data`).
    min_data_share: float = 0.03
    # Logged steps over which the run's spread is measured. Long enough that a straggler
    # or one busy stretch does not move it much; short enough to follow a machine whose
    # load changes over the run.
    spread_steps: int = 500
    # Share of the same steps in which a rank slow by its compute time must also have
    # arrived at the synchronisation point after every rank that is not (it made the job
    # wait), at most: among n ranks it must have been last at least twice as often as
    # chance (2/n) asks for, so a cohort of 8 needs 25%. Measured on 4 CPU ranks with 8
    # busy processes on 2 cores: 15-40% stragglers arrived last in 65-68% of their steps;
    # clean ranks whose compute time ran 20-40% over for 20 steps (a busy neighbour slows
    # its CPU time more than its progress) in 27-45%. The same test is made among the
    # rank's data-parallel peers where there are 3 or more: with tensor parallelism each
    # peer group leaves its gradient reduction at its own time, and which group reaches
    # the hooks' collective first is a toss-up (a 15% straggler among 8 CPU ranks, dp=4 x
    # tp=2, was last of all in 20% of its first 25 steps, last of its 4 peers in 64%).
    min_last_fraction: float = 0.5
    # An episode ends when its ranks stayed under this fraction of the bar (with the same
    # persistence as the onset): hysteresis, so a straggler near the bar is one episode.
    resolve_fraction: float = 0.5
    # A restless cohort: where, before the window, ranks outside any episode were in a
    # burst (over the bar in BURST_STEPS logged steps in a row) in more than this share of
    # their logged steps, the cohort shares its machine with other work, and there busy
    # neighbours slow clean ranks by 10-40% for up to about 30 steps at a time. Measured:
    # 0 on quiet runs (an idle 16-core machine; 4 and 8 ranks alone on 2 cores); 0.1-10%
    # on 4-rank runs with 8 busy processes on 2 cores, once their first burst had passed
    # (before it, 0: the first one is judged as on a quiet machine).
    restless_share: float = 0.002
    # There the window is this many training steps (twice the longest busy-neighbour
    # slowdown measured): a straggler is named about 50 steps after it began, not 20.
    restless_persist_steps: int = 60

    def __post_init__(self) -> None:
        _check(self.persist_steps >= 3, "persist_steps", "must be >= 3", self.persist_steps)
        _check(
            3 <= self.min_logged_steps <= self.persist_steps, "min_logged_steps",
            f"must be in [3, persist_steps ({self.persist_steps})]", self.min_logged_steps,
        )  # fmt: skip
        _check(
            0.5 < self.persist_fraction <= 1, "persist_fraction", "must be in (0.5, 1]",
            self.persist_fraction,
        )  # fmt: skip
        _check(self.spread_multiple > 0, "spread_multiple", "must be > 0", self.spread_multiple)
        _check(0 < self.min_excess < 10, "min_excess", "must be in (0, 10)", self.min_excess)
        for name in ("min_stopped_share", "min_data_share"):
            value = getattr(self, name)
            _check(0 < value < 1, name, "must be in (0, 1)", value)
        _check(
            self.restless_persist_steps >= self.persist_steps, "restless_persist_steps",
            f"must be >= persist_steps ({self.persist_steps})", self.restless_persist_steps,
        )  # fmt: skip
        _check(
            0 < self.restless_share <= 1, "restless_share", "must be in (0, 1]",
            self.restless_share,
        )  # fmt: skip
        _check(
            self.spread_steps >= self.restless_persist_steps, "spread_steps",
            f"must be >= restless_persist_steps ({self.restless_persist_steps})",
            self.spread_steps,
        )  # fmt: skip
        _check(
            0 <= self.min_last_fraction <= 1, "min_last_fraction", "must be in [0, 1]",
            self.min_last_fraction,
        )  # fmt: skip
        _check(
            0 < self.resolve_fraction < 1, "resolve_fraction", "must be in (0, 1)",
            self.resolve_fraction,
        )  # fmt: skip

    def bar(self, sigma: float) -> float:
        """The excess a rank must clear, given the run's spread `sigma`."""
        return max(self.min_excess, self.spread_multiple * sigma)

    def for_stops(self) -> StragglerSettings:
        """These settings for the stopped signal: its bar's floor is min_stopped_share."""
        return replace(self, min_excess=self.min_stopped_share)

    def for_data(self) -> StragglerSettings:
        """These settings for the data signal: its bar's floor is min_data_share."""
        return replace(self, min_excess=self.min_data_share)

    def window_steps(self, burst_share: float) -> int:
        """Training steps a slowdown must last, given the share of clean ranks' logged
        steps spent in bursts before the window: longer in a restless cohort, where busy
        neighbours slow clean ranks for tens of steps."""
        restless = burst_share > self.restless_share
        return self.restless_persist_steps if restless else self.persist_steps

    def steps_needed(self, logged: int) -> int:
        """Of a window of `logged` logged steps, how many must clear the bar (or stay under
        half of it, to resolve)."""
        return math.ceil(self.persist_fraction * logged - 1e-9)


def _check(ok: bool, name: str, rule: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{SECTION}.{name} {rule}, got {value!r}")


# ---------------------------------------------------------------------------- scoring


def excess(times_s: np.ndarray) -> np.ndarray:
    """Log of each rank's time over the median rank's at the same step.

    Rows are steps and columns ranks (a 1-D array is one step). NaN (not reported) and
    non-positive times give NaN and stay out of the median. A log ratio is symmetric and
    its spread does not depend on the step's length.
    """
    if times_s.ndim == 1 and np.all(times_s > 0):  # the detector's case: one whole step
        logs = np.log(times_s)
        return logs - fast_median(logs)
    with np.errstate(divide="ignore", invalid="ignore"):
        logs = np.where(times_s > 0, np.log(times_s), np.nan)
    if logs.ndim == 1:
        return logs - np.nanmedian(logs) if np.isfinite(logs).any() else logs
    ok = np.isfinite(logs).any(axis=1)
    out = np.full_like(logs, np.nan)
    out[ok] = logs[ok] - np.nanmedian(logs[ok], axis=1, keepdims=True)
    return out


def step_spread(excess_rows: np.ndarray) -> np.ndarray:
    """Per step: the cohort's median absolute excess, its slowest rank left out.

    The median excess is 0, so this is the cohort's MAD, but for the slowest rank: a
    straggler among 4 ranks would otherwise widen the spread it is judged against by half
    (measured: a sigma of 0.039 instead of 0.025 on a loaded 4-rank run with a 15%
    straggler) and hide itself.
    """
    rows = np.atleast_2d(excess_rows)
    if rows.shape[0] == 1 and np.isfinite(rows).all():  # the detector's case
        row = rows[0]
        return np.array([fast_median(np.abs(np.delete(row, np.argmax(row))))])
    out = np.full(len(rows), np.nan)
    for i, row in enumerate(rows):
        row = row[np.isfinite(row)]
        if len(row) > 1:
            out[i] = fast_median(np.abs(np.delete(row, np.argmax(row))))
    return out


def arrival_excess(wait_time_s: np.ndarray, step_time_s: float | np.ndarray) -> np.ndarray:
    """How much later than the median rank each rank arrived at the step's synchronisation
    point, as a fraction of the step: (median wait - its wait) / step time.

    The last to arrive waits least, so a rank that arrived late waited less than the median
    rank by what the job waited for it. Rows are steps and columns ranks (a 1-D array is one
    step), `step_time_s` one per row; NaN (not reported) stays out of the median. Close to a
    log ratio of arrival times, so the same bar rule applies.
    """
    if wait_time_s.ndim == 1 and np.isfinite(wait_time_s).all():  # the detector's case
        return (fast_median(wait_time_s) - wait_time_s) / step_time_s
    rows = np.atleast_2d(wait_time_s)
    ok = np.isfinite(rows).any(axis=1)
    late_s = np.full_like(rows, np.nan, dtype="float64")
    late_s[ok] = np.nanmedian(rows[ok], axis=1, keepdims=True) - rows[ok]
    steps_s = np.broadcast_to(np.asarray(step_time_s, dtype="float64"), (len(rows),))
    with np.errstate(divide="ignore", invalid="ignore"):
        out = late_s / np.where(steps_s > 0, steps_s, np.nan)[:, None]
    return out if wait_time_s.ndim == 2 else out[0]


def sync_time_s(wait_s: np.ndarray, collectives_s: tuple[np.ndarray, ...]) -> np.ndarray:
    """Time each rank spent where it waits for the others: the step's end (`wait_s`) plus
    each kind of the model's collectives that was timed on every rank of the step (a row of
    a grid); a kind some rank did not time is left out of that step, and a NaN wait stays
    NaN. Every rank's transfer is alike, so what tells them apart is the
    wait for the last to arrive: the rank the others waited for spends the least.

    FSDP makes its ranks wait for a late one in its all-gathers and reduce-scatters, not at
    the step's end: a rank held back by a CPU quota waited 3 ms a step at the step's end,
    the others 4 ms, and 96 ms less than they did in the collectives, in 353 ms steps
    (bench/results/external_faults_quota.txt)."""
    total = np.array(wait_s, dtype="float64")
    for times_s in collectives_s:
        timed = np.isfinite(times_s).all(axis=-1, keepdims=True)
        total += np.where(timed, np.nan_to_num(times_s), 0.0)
    return total


def share_excess(times_s: np.ndarray, step_time_s: float | np.ndarray) -> np.ndarray:
    """How much longer than the median rank each rank spent stopped, or waiting for its
    data, as a fraction of the step: (its time - the median's) / step time; the seconds the
    job waited for it, over the step. Rows are steps and columns ranks (a 1-D array is one
    step), `step_time_s` one per row; NaN (not reported) stays out of the median."""
    if times_s.ndim == 1 and np.isfinite(times_s).all():  # the detector's case
        return (times_s - fast_median(times_s)) / step_time_s
    rows = np.atleast_2d(times_s)
    steps_s = np.broadcast_to(np.asarray(step_time_s, dtype="float64"), (len(rows),))
    with np.errstate(all="ignore"):  # a row without values: NaN
        median = np.nanmedian(rows, axis=1, keepdims=True)
        out = (rows - median) / np.where(steps_s > 0, steps_s, np.nan)[:, None]
    return out if times_s.ndim == 2 else out[0]


def in_bursts(x: np.ndarray, bar: float) -> np.ndarray:
    """Per step and rank of `x` (steps x ranks of one signal's excess): whether the rank
    cleared `bar` at this step and the BURST_STEPS - 1 before it (a busy neighbour's
    slowdown rather than one noisy step; False for the first steps)."""
    with np.errstate(invalid="ignore"):
        above = x >= bar
    out = np.zeros_like(above)
    n = len(above)
    if n >= BURST_STEPS:
        run = above[BURST_STEPS - 1 :].copy()
        for back in range(1, BURST_STEPS):
            run &= above[BURST_STEPS - 1 - back : n - back]
        out[BURST_STEPS - 1 :] = run
    return out


def sigma_of(spreads: np.ndarray) -> float:
    """The run's robust sigma from per-step spreads: 1.4826 x their median (0 when none)."""
    spreads = spreads[np.isfinite(spreads)]
    return MAD_TO_SIGMA * fast_median(spreads) if len(spreads) else 0.0


@dataclass(frozen=True)
class RankScores:
    """The judgement over a window of steps of the ranks judged (`columns` of the window)."""

    columns: np.ndarray  # the window's columns judged, ascending
    window: np.ndarray  # their steps x ranks excesses
    above: np.ndarray  # per rank: steps whose excess cleared the bar
    below: np.ndarray  # per rank: steps whose excess stayed under resolve_fraction x the bar
    slow: np.ndarray  # per rank, bool: cleared the bar in persist_fraction of the steps
    bar: float  # the excess a rank had to clear

    def median(self, ranks: np.ndarray | slice = slice(None)) -> np.ndarray:
        """Median excess over the window of these ranks (positions in `columns`; a log
        ratio: exp(x) - 1 is how much slower than the median rank)."""
        cols = self.window[:, ranks]
        if cols.size and np.isfinite(cols).all():
            return fast_median(cols, axis=0)
        with np.errstate(all="ignore"):
            return np.nanmedian(cols, axis=0) if len(cols) else np.full(cols.shape[1], np.nan)

    def order(self) -> np.ndarray:
        """Positions in `columns`, slowest first: slow ranks, then by median excess."""
        return np.lexsort((-np.nan_to_num(self.median(), nan=-np.inf), ~self.slow))


def rank_scores(
    window: np.ndarray, sigma: float, s: StragglerSettings, columns: np.ndarray | None = None
) -> RankScores:
    """Judge ranks over `window` (steps x ranks of `excess`) against the run's spread.

    A rank is slow when its excess cleared the bar in `persist_fraction` of the window's
    steps. The detector passes the logged steps of its last `persist_steps` steps and the
    `columns` that can matter this step; the dashboard a time window of bucket means,
    every column. NaN (not reported) counts as neither above nor below.
    """
    if columns is None:
        columns = np.arange(window.shape[1])
    judged = window[:, columns]
    bar = s.bar(sigma)
    with np.errstate(invalid="ignore"):
        above = (judged >= bar).sum(axis=0)
        below = (judged < s.resolve_fraction * bar).sum(axis=0)
    need = s.steps_needed(len(window))
    return RankScores(columns, judged, above, below, (above >= need) & (need > 0), bar)


def kept_waiting(
    waits_s: np.ndarray, columns: np.ndarray, ranks: np.ndarray, tp: int, s: StragglerSettings
) -> np.ndarray:
    """Which ranks of `columns`, slow by their compute time, also arrived after every other
    rank, or after every other of their data-parallel peers (rank % tp alike) where they
    have two or more, in min(min_last_fraction, 2 / ranks compared) of the steps of
    `waits_s` (steps x ranks, the global `ranks` in column order). Peers: with tensor
    parallelism the peer groups leave their gradient reductions at different times, so a
    straggler is reliably last of its group only. O(steps x ranks), only while some are
    slow."""
    if not len(columns):
        return np.zeros(0, bool)
    others = waits_s.copy()
    others[:, columns] = np.inf  # the other slow ranks are not the ones kept waiting
    ok = _last_share(waits_s[:, columns], others) >= _last_needed(len(ranks), s)
    if tp > 1:
        tp_index = ranks % tp
        for i, column in enumerate(columns):
            peers = tp_index == tp_index[column]
            n_peers = int(peers.sum())
            if not ok[i] and n_peers >= 3:
                share = _last_share(waits_s[:, [column]], others[:, peers])[0]
                ok[i] = share >= _last_needed(n_peers, s)
    return ok


def _last_share(waits_s: np.ndarray, others: np.ndarray) -> np.ndarray:
    """Per column of `waits_s`: the share of steps it waited no longer than any of
    `others` (the last to arrive waits least)."""
    return (waits_s <= others.min(axis=1, keepdims=True)).mean(axis=0)


def _last_needed(n: int, s: StragglerSettings) -> float:
    """Share of steps a rank must have arrived last in among `n` ranks: twice chance,
    at most `min_last_fraction`."""
    return min(s.min_last_fraction, 2 / n)


# ---------------------------------------------------------------------------- detector


@dataclass
class _Signal:
    """One way of telling a slow rank, its rings one row per logged step: each rank's
    excess (NaN where this signal has none), the seconds it cost, and the per-step
    spreads over `spread_steps`."""

    column: str  # the ranks column behind it, for the alert's data link
    slower: str  # how a message says a rank's excess, from its percentage {pct}
    log_ratio: bool  # an excess is a log ratio (else a fraction of the step)
    settings: StragglerSettings  # its bar's floor is min_excess (or min_stopped_share)
    excess: np.ndarray
    cost_s: np.ndarray
    spreads: np.ndarray

    @classmethod
    def empty(
        cls, column: str, slower: str, log_ratio: bool, s: StragglerSettings, n: int
    ) -> _Signal:
        return cls(
            column,
            slower,
            log_ratio,
            s,
            np.full((s.restless_persist_steps, n), np.nan),
            np.zeros((s.restless_persist_steps, n)),
            np.full(s.spread_steps, np.nan),
        )

    def sigma(self) -> float:
        """The run's robust sigma of this signal (`sigma_of` its per-step spreads)."""
        return sigma_of(self.spreads)

    def bar(self, sigma: float) -> float:
        """The excess a rank must clear by this signal, given its spread `sigma`."""
        return self.settings.bar(sigma)

    def percent(self, x: float) -> float:
        """An excess (or a bar) as a percentage: how much slower, or how much of a step
        later, than the median rank."""
        return 100 * (math.expm1(x) if self.log_ratio else x)

    def put(self, row: int, spread_row: int, x: np.ndarray | None, cost_s: np.ndarray) -> None:
        """This step's excesses (None: the signal has none at this step) and costs."""
        self.excess[row] = np.nan if x is None else x
        self.cost_s[row] = cost_s
        self.spreads[spread_row] = np.nan if x is None else step_spread(x)[0]


@dataclass
class _Episode:
    alert: Alert
    members: np.ndarray  # column indices of the ranks it named
    signal: _Signal  # the signal that named them: it also ends the episode


@dataclass
class StragglerDetector:
    settings: StragglerSettings = field(default_factory=StragglerSettings)
    kind: str = "straggler"

    def __post_init__(self) -> None:
        self._reset(np.zeros(0, np.int64))

    def _reset(self, ranks: np.ndarray) -> None:
        """Four signals (compute time, arrival, data, stopped), the waits and step numbers
        of their rows, open episodes. `restless_persist_steps` rows hold any window: a
        window holds more than min_logged_steps logged steps only where it holds every
        step."""
        s, n = self.settings, len(ranks)
        self._ranks = ranks.copy()
        self._compute = _Signal.empty(
            "compute_time_s", "{pct:.0f}% slower than the median rank by its compute time",
            True, s, n,
        )  # fmt: skip
        self._arrival = _Signal.empty(
            "wait_time_s",
            "{pct:.0f}% of a step later than the median rank at the step's end and in the "
            "model's collectives",
            False, s, n,
        )  # fmt: skip
        self._stopped = _Signal.empty(
            "stopped_time_s",
            "its process stopped {pct:.0f}% of a step longer than the median rank's (neither "
            "running nor waiting for a CPU: SIGSTOP, a cgroup freezer, a debugger, a paused VM)",
            False, s.for_stops(), n,
        )  # fmt: skip
        self._data = _Signal.empty(
            "data_time_s",
            "waiting for its data {pct:.0f}% of a step longer than the median rank",
            False, s.for_data(), n,
        )  # fmt: skip
        self._signals = (self._compute, self._arrival, self._data, self._stopped)
        self._waits = np.zeros((s.restless_persist_steps, n))
        self._was_in_episode = np.zeros((s.restless_persist_steps, n), bool)
        self._steps = np.zeros(s.restless_persist_steps, np.int64)
        # Per logged step that left the longest window: the share of ranks outside any
        # episode that were in a burst at it (`_burst_share`).
        self._bursts = np.zeros(s.spread_steps)
        self._recorded = 0
        self._pushed = 0
        self._first_step = 0  # the cohort's first logged step
        self._episodes: list[_Episode] = []
        self._in_episode = np.zeros(n, bool)

    def named_ranks(self) -> set[int]:
        """The ranks an open episode names now: the intermittent-straggler detector hands
        such a rank over, so that one slow rank has one open alert."""
        return set(self._ranks[self._in_episode].tolist())

    def observe(self, s: StepView) -> list[Alert]:
        r = s.ranks
        if r is None or len(r) < 3 or not np.isfinite(r.wait_time_s).all():
            return []  # a cohort needs at least three ranks
        if not np.array_equal(self._ranks, r.rank):
            self._reset(r.rank)  # another cohort (a restart at another size): start over
        if not self._push(r, s):
            return []
        sigmas = tuple(signal.sigma() for signal in self._signals)
        burst_share = self._burst_share(sigmas[:2])
        persist_steps = self.settings.window_steps(burst_share)
        rows = self._window(s.step, persist_steps)
        if rows is None:
            return []
        restless = burst_share if persist_steps > self.settings.persist_steps else None
        return self._judge(s, r.tp, rows, sigmas, restless)

    def _burst_share(self, sigmas: tuple[float, float]) -> float:
        """The share of clean rank-steps spent in bursts, over the logged steps that left
        the longest window (`restless_persist_steps` back): recorded only then, without the
        ranks in an episode then or by now, so that a straggler's own steps, before it
        was named too, never make its cohort look restless. 0 until a step has left the
        window."""
        s, ring = self.settings, self.settings.restless_persist_steps
        if self._pushed < ring:
            return 0.0
        # The oldest step of the ring with BURST_STEPS - 1 steps before it still there.
        oldest = (self._pushed - ring + np.arange(BURST_STEPS)) % ring
        clean = ~(self._in_episode | self._was_in_episode[oldest].any(axis=0))
        if not clean.any():
            return self._restless_share()
        in_burst = np.zeros(int(clean.sum()), bool)
        for signal, sigma in zip((self._compute, self._arrival), sigmas, strict=True):
            in_burst |= in_bursts(signal.excess[oldest][:, clean], s.bar(sigma))[-1]
        self._bursts[self._recorded % s.spread_steps] = in_burst.mean()
        self._recorded += 1
        return self._restless_share()

    def _restless_share(self) -> float:
        held = self._bursts[: min(self._recorded, self.settings.spread_steps)]
        return float(held.mean()) if len(held) else 0.0

    def _push(self, r: RankView, s: StepView) -> bool:
        """This step's excesses and costs into the rings; False if it has none.

        Four signals, each judged against its own spread: a rank's compute time over the
        median rank's (log ratio); how much later than the median rank it arrived at the
        step's synchronisation points (`sync_time_s`), as a fraction of the step (close to
        a log ratio; the last to arrive waits least), which is what the job waited for it;
        and, where reported, how much longer it waited for its data, and how much longer
        it was stopped, each as a fraction of the step.
        Each misses what the other sees: on a machine with fewer cores than ranks the
        scheduler decides who arrives last; on an idle one a rank's CPU time also counts
        its polling in the collectives, so the ranks that wait longest look slowest."""
        compute = r.compute_time_s
        timed = bool(np.all(compute > 0))  # NaN (not reported) fails too
        if not timed and not s.step_time_s > 0:
            return False
        if self._pushed == 0:
            self._first_step = s.step
        row = self._pushed % self.settings.restless_persist_steps
        spread_row = self._pushed % self.settings.spread_steps
        zeros = np.zeros(len(compute))
        if timed:
            x = excess(compute)
            # Its time beyond the median rank's: c - c / exp(x), without a second median.
            self._compute.put(row, spread_row, x, np.maximum(0.0, -compute * np.expm1(-x)))
        else:
            self._compute.put(row, spread_row, None, zeros)
        if s.step_time_s > 0:
            collectives_s = (r.all_gather_time_s, r.reduce_scatter_time_s, r.all_reduce_time_s)
            x = arrival_excess(sync_time_s(r.wait_time_s, collectives_s), s.step_time_s)
            # Seconds the job waited for it: the excess is a fraction of the step.
            self._arrival.put(row, spread_row, x, np.maximum(0.0, x * s.step_time_s))
        else:
            self._arrival.put(row, spread_row, None, zeros)
        # On an accelerator the host's data time also holds its waits for the device.
        data_s = r.data_time_s if host_is_device(s.run.device_type) else None
        for signal, own_s in ((self._data, data_s), (self._stopped, r.stopped_time_s)):
            if own_s is not None and s.step_time_s > 0 and np.isfinite(own_s).all():
                x = share_excess(own_s, s.step_time_s)
                signal.put(row, spread_row, x, np.maximum(0.0, x * s.step_time_s))
            else:
                signal.put(row, spread_row, None, zeros)
        self._steps[row], self._waits[row] = s.step, r.wait_time_s
        self._was_in_episode[row] = self._in_episode
        self._pushed += 1
        return True

    def _window(self, step: int, persist_steps: int) -> np.ndarray | None:
        """Ring rows of the window judged at `step`, oldest first: the logged steps among
        the last `persist_steps` steps, at least `min_logged_steps` of them. None until
        the cohort was seen for that long: persistence counts training steps, whatever
        the logging interval (a window of 25 logged steps is 100 steps at log_every=4)."""
        s, ring = self.settings, self.settings.restless_persist_steps
        held = min(self._pushed, ring)
        if held < s.min_logged_steps or step - self._first_step + 1 < persist_steps:
            return None
        rows = (self._pushed - held + np.arange(held)) % ring
        recent = int((self._steps[rows] > step - persist_steps).sum())  # a suffix: steps rise
        return rows[held - max(recent, s.min_logged_steps) :]

    def _judge(
        self,
        s: StepView,
        tp: int,
        rows: np.ndarray,
        sigmas: tuple[float, ...],
        restless: float | None,
    ) -> list[Alert]:
        """At most one row per step (the alerts table's key): a new episode first; an
        episode that ended waits for a step without one.

        Judged, per signal: the ranks above its bar at this step (a rank turns slow at a
        step where it is slow) and those in an episode: O(ranks) for the rest, not
        O(ranks x window). Slow by its compute time, a rank must also have kept others
        waiting; late at the synchronisation point, it did.
        """
        scored = {}
        for signal, sigma in zip(self._signals, sigmas, strict=True):
            scores = self._scores(signal, rows, sigma)
            scored[id(signal)] = scores
            new = np.flatnonzero(scores.slow & ~self._in_episode[scores.columns])
            if signal is self._compute:
                waits = self._waits[rows]
                new = new[kept_waiting(waits, scores.columns[new], self._ranks, tp, self.settings)]
            if len(new):
                return [self._open(s, signal, rows, new, scores, restless)]
        need = self.settings.steps_needed(len(rows))
        for episode in self._episodes:
            scores = scored[id(episode.signal)]
            members = np.searchsorted(scores.columns, episode.members)
            if (scores.below[members] >= need).all():
                return [self._close(s, episode, scores, members[0], len(rows))]
        return []

    def _scores(self, signal: _Signal, rows: np.ndarray, sigma: float) -> RankScores:
        window = signal.excess[rows]
        with np.errstate(invalid="ignore"):
            above_now = np.flatnonzero(window[-1] >= signal.bar(sigma))
        columns = np.union1d(above_now, np.flatnonzero(self._in_episode))
        return rank_scores(window, sigma, signal.settings, columns)

    def _open(
        self,
        s: StepView,
        signal: _Signal,
        rows: np.ndarray,
        new: np.ndarray,
        scores: RankScores,
        restless: float | None,
    ) -> Alert:
        """A new episode of the ranks at positions `new` of the scores' columns
        (`restless`: the cohort's burst share, where it lengthened the window)."""
        new = new[np.argsort(-scores.median(new), kind="stable")]
        worst, members = new[0], scores.columns[new]
        ratio = math.exp(scores.median(new[:1])[0])
        cost_s = fast_median(signal.cost_s[rows, members[0]])
        start = self._onset(signal, rows, members[0], scores.bar)
        ranks = self._ranks[members].tolist()
        others = f" (also {name_ranks(s.run, ranks[1:])})" if len(ranks) > 1 else ""
        shared = (
            ""
            if restless is None
            else f" (a restless cohort: clean ranks spent {100 * restless:.1f}% of their "
            "steps in short bursts over the bar, as on a shared machine, so the window is "
            f"{self.settings.restless_persist_steps} steps)"
        )
        alert = Alert.at(
            s,
            kind=self.kind,
            severity="warning",
            message=(
                f"{name_rank(s.run, ranks[0])} is a straggler{others} since step {start}: "
                + signal.slower.format(pct=round(signal.percent(math.log(ratio))))
                + f" (this run's bar: {signal.percent(scores.bar):.0f}%, from its "
                f"rank-to-rank spread) in {scores.above[worst]} of the last {len(rows)} "
                f"logged steps{shared}; the job loses about {cost_s * 1e3:.0f} ms per step waiting "
                "for it. Data: " + data_query(s.run_id, "ranks", signal.column, start, s.step)
            ),
            value=ratio,
            baseline=math.exp(scores.bar),
            rank=ranks[0],
            start_step=start,
        )
        self._episodes.append(_Episode(alert, members, signal))
        self._in_episode[members] = True
        return alert

    def _onset(self, signal: _Signal, rows: np.ndarray, column: int, bar: float) -> int:
        """The episode's first step: the first step of the window to clear the bar after
        the last two in a row that did not (a lone noisy step before it does not count)."""
        with np.errstate(invalid="ignore"):
            above = signal.excess[rows, column] >= bar
        calm = np.flatnonzero(~above[:-1] & ~above[1:])
        first = calm[-1] + 2 if len(calm) else 0
        return int(self._steps[rows][first:][above[first:]][0])

    def _close(
        self, s: StepView, episode: _Episode, scores: RankScores, worst: int, logged: int
    ) -> Alert:
        self._episodes.remove(episode)
        self._in_episode[episode.members] = False
        rank = name_rank(s.run, episode.alert.rank)
        now = scores.median([worst])[0]
        return episode.alert.resolved_at(
            s.step,
            s.time_unix_s,
            f"{rank} is no longer a straggler: "
            # A rank now under the median rank is 0% slower, not "-1% later" (nor "-0%").
            + episode.signal.slower.format(pct=max(0, round(episode.signal.percent(now))))
            + f" over the last {logged} logged steps.",
        )
