"""Straggler: a rank whose own compute is persistently slower than its cohort's.

In a synchronous job every rank's step takes as long as the slowest rank's, so wall time
names nobody. Two per-rank signals do:
- compute time (the hooks report the training thread's CPU time on CPU ranks and CUDA
  event time on GPU ranks), scored as
  the ratio to the cohort's median at the same step;
- arrival order at the step's synchronisation point: the rank everyone waits for arrives
  last, with the shortest wait.
A rank is named when, over the last `window` logged steps, its median compute ratio is at
least 1 + `min_slowdown` and it arrived last in at least `min_last_fraction` of them. The
default 8% sits under the 10% slowdown that must always be caught and above the 2-6%
rank-to-rank asymmetry measured on 4 CPU ranks sharing 2 cores. Where
compute time is not reported (a producer without it), arrival order alone decides, with a
stricter `gpu_last_fraction` and a wait that costs the others at least `min_slowdown` of
the step. Requiring a whole window of evidence keeps one-off hiccups and the slow drift
of a cluster from alarming; one alert per episode, re-armed once the rank is back to normal
for a whole window.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .alerts import Alert
from .detectors import data_query, name_ranks
from .rolling import median as fast_median
from .views import RankView, StepView


@dataclass
class StragglerDetector:
    window: int = 10
    min_slowdown: float = 0.08
    min_last_fraction: float = 0.7
    gpu_last_fraction: float = 0.8
    kind: str = "straggler"
    _ranks: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64), repr=False)

    def __post_init__(self) -> None:
        if self.window < 3 or self.min_slowdown <= 0:
            raise ValueError("StragglerDetector: window must be >= 3 and min_slowdown > 0")
        self._reset(np.zeros(0, np.int64))

    def _reset(self, ranks: np.ndarray) -> None:
        """History rings, one row per logged step: compute ratios (NaN rows where compute
        time was not reported), the rank that arrived last, the time each rank cost."""
        n, w = len(ranks), self.window
        self._ranks = ranks.copy()
        self._ratios = np.full((w, n), np.nan)
        self._has_ratios = np.zeros(w, bool)
        self._last = np.zeros(w, np.int64)
        self._lost = np.zeros((w, n))
        self._step_s = np.zeros(w)
        self._pushed = 0
        self._flagged = np.zeros(n, bool)

    def observe(self, s: StepView) -> list[Alert]:
        r = s.ranks
        if r is None or len(r) < 3 or not np.isfinite(r.wait_time_s).all():
            return []  # a cohort needs at least three ranks
        if not np.array_equal(self._ranks, r.rank):
            self._reset(r.rank)
        self._push(r, s.step_time_s)
        if self._pushed < self.window:
            return []
        cand, slow, ratio, lost_s = self._judge()
        was = self._flagged[cand]
        self._flagged[cand] = slow | (was & (ratio >= 1 + self.min_slowdown / 2))
        new = np.flatnonzero(slow & ~was)
        if not len(new):
            return []
        new = new[np.argsort(-ratio[new], kind="stable")]
        ranks = r.rank[cand[new]].tolist()
        return [self._alert(s, ranks, float(ratio[new[0]]), float(lost_s[new[0]]))]

    def _push(self, r: RankView, step_time_s: float) -> None:
        """This step's evidence into the rings."""
        row = self._pushed % self.window
        waits, compute = r.wait_time_s, r.compute_time_s
        last = int(np.argmin(waits))
        self._last[row] = last
        self._step_s[row] = step_time_s
        if np.all(compute > 0):  # NaN (not reported) fails too
            median = fast_median(compute)
            self._ratios[row] = compute / median
            self._has_ratios[row] = True
            # The job waits for a slow rank's extra compute.
            self._lost[row] = np.maximum(0.0, compute - median)
        else:
            self._has_ratios[row] = False
            # Without compute times: the late rank costs what the median rank waited for it.
            self._lost[row] = 0.0
            self._lost[row, last] = fast_median(waits)
        self._pushed += 1

    def _judge(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(candidates, and for each: slow, slowdown ratio, seconds lost per step).

        One rank arrives last per step, so at most one arrived last in more than half the
        window: only it (and ranks already flagged, to re-arm them) need the medians over
        the window. O(ranks) per step for the arrival counts, O(window) for the rest.
        """
        n = len(self._ranks)
        last = np.bincount(self._last, minlength=n) / self.window
        bar = min(self.min_last_fraction, self.gpu_last_fraction)
        cand = np.flatnonzero((last >= bar) | self._flagged)
        lost_s = fast_median(self._lost[:, cand], axis=0)
        if self._has_ratios.all():  # compute time reported: both signals
            ratio = fast_median(self._ratios[:, cand], axis=0)
            slow = (ratio >= 1 + self.min_slowdown) & (last[cand] >= self.min_last_fraction)
            return cand, slow, ratio, lost_s
        step_s = fast_median(self._step_s)
        ratio = 1 + lost_s / step_s if step_s > 0 else np.ones(len(cand))
        slow = (last[cand] >= self.gpu_last_fraction) & (lost_s >= self.min_slowdown * step_s)
        return cand, slow, ratio, lost_s

    def _alert(self, s: StepView, ranks: list[int], ratio: float, lost_s: float) -> Alert:
        rank = ranks[0]
        others = f" (also {name_ranks(ranks[1:])})" if len(ranks) > 1 else ""
        return Alert.at(
            s,
            kind=self.kind,
            severity="warning",
            message=(
                f"rank {rank} is a straggler{others}: {100 * (ratio - 1):.0f}% slower than the "
                f"median rank over the last {self.window} logged steps, and the last to "
                f"arrive; the job loses about {lost_s * 1e3:.0f} ms per step waiting for it. "
                "Data: "
                + data_query(s.run_id, "ranks", "compute_time_s", s.step - self.window, s.step)
            ),
            value=ratio,
            baseline=1.0,
            rank=rank,
        )
