"""Straggler: a rank whose own compute is persistently slower than its cohort's.

In a synchronous job every rank's step takes as long as the slowest rank's, so wall time
names nobody. Two per-rank signals do:
- compute time (the hooks report the training thread's CPU time on CPU ranks), scored as
  the ratio to the cohort's median at the same step;
- arrival order at the step's synchronisation point: the rank everyone waits for arrives
  last, with the shortest wait.
A rank is named when, over the last `window` logged steps, its median compute ratio is at
least 1 + `min_slowdown` and it arrived last in at least `min_last_fraction` of them. The
default 8% sits under the 10% slowdown that must always be caught and above the 2-6%
rank-to-rank asymmetry measured on 4 CPU ranks sharing 2 cores. Where
compute time is not reported (GPU ranks, for now), arrival order alone decides, with a
stricter `gpu_last_fraction` and a wait that costs the others at least `min_slowdown` of
the step. Requiring a whole window of evidence keeps one-off hiccups and the slow drift
of a cluster from alarming; one alert per episode, re-armed once the rank is back to normal
for a whole window.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

from .alerts import Alert
from .detectors import StepView


@dataclass
class StragglerDetector:
    window: int = 10
    min_slowdown: float = 0.08
    min_last_fraction: float = 0.7
    gpu_last_fraction: float = 0.8
    kind: str = "straggler"
    _history: deque = field(default_factory=deque, repr=False)  # per step: (ratios, last, lost)
    _flagged: set = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if self.window < 3 or self.min_slowdown <= 0:
            raise ValueError("StragglerDetector: window must be >= 3 and min_slowdown > 0")

    def observe(self, s: StepView) -> list[Alert]:
        r = s.ranks
        if r is None or len(r.wait_time_s) < 3 or any(w is None for w in r.wait_time_s):
            return []  # a cohort needs at least three ranks
        self._history.append(_evidence(r, s.step_time_s))
        if len(self._history) > self.window:
            self._history.popleft()
        if len(self._history) < self.window:
            return []
        alerts = []
        for rank in range(len(r.wait_time_s)):
            slow, ratio, lost_s = self._judge(rank)
            if slow and rank not in self._flagged:
                self._flagged.add(rank)
                alerts.append(self._alert(s, rank, ratio, lost_s))
            elif not slow and ratio < 1 + self.min_slowdown / 2:
                self._flagged.discard(rank)
        return alerts

    def _judge(self, rank: int) -> tuple[bool, float, float]:
        ratios = [h[0][rank] for h in self._history if h[0] is not None]
        last = sum(h[1] == rank for h in self._history) / len(self._history)
        lost_s = statistics.median(h[2][rank] for h in self._history)
        if len(ratios) == len(self._history):  # compute time reported: both signals
            ratio = statistics.median(ratios)
            return ratio >= 1 + self.min_slowdown and last >= self.min_last_fraction, ratio, lost_s
        step_s = statistics.median(h[3] for h in self._history)
        ratio = 1 + lost_s / step_s if step_s > 0 else 1.0
        slow = last >= self.gpu_last_fraction and lost_s >= self.min_slowdown * step_s
        return slow, ratio, lost_s

    def _alert(self, s: StepView, rank: int, ratio: float, lost_s: float) -> Alert:
        return Alert(
            run_id=s.run_id,
            step=s.step,
            kind=self.kind,
            severity="warning",
            message=(
                f"rank {rank} is a straggler: {100 * (ratio - 1):.0f}% slower than the median "
                f"rank over the last {self.window} logged steps, and the last to arrive; the "
                f"job loses about {lost_s * 1e3:.0f} ms per step waiting for it"
            ),
            time_unix_s=s.time_unix_s,
            value=ratio,
            baseline=1.0,
            rank=rank,
        )


def _evidence(r, step_time_s: float) -> tuple:
    """(compute ratios or None, rank that arrived last, time each rank costs the job, step s)."""
    waits = r.wait_time_s
    last = min(range(len(waits)), key=waits.__getitem__)
    if all(c is not None and c > 0 for c in r.compute_time_s):
        median = statistics.median(r.compute_time_s)
        ratios = [c / median for c in r.compute_time_s]
        # The job waits for a slow rank's extra compute.
        lost = [max(0.0, c - median) for c in r.compute_time_s]
        return ratios, last, lost, step_time_s
    # Without compute times: the late rank costs what the median rank waited for it.
    others_wait = statistics.median(waits)
    lost = [others_wait if i == last else 0.0 for i in range(len(waits))]
    return None, last, lost, step_time_s
