"""Throughput drop: tokens/s (and so MFU) well below the run's own recent level.

Recent level: median tokens/s of the last `recent_steps` logged steps. Baseline: median of
the `baseline_steps` before those. A drop of at least `min_drop` (default 20%) for the
whole recent window alerts once; the detector re-arms when throughput is back within half
that. Medians make one slow step (a checkpoint save, a garbage collection) harmless.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from .alerts import Alert
from .detectors import RollingWindow, StepView


@dataclass
class ThroughputDropDetector:
    recent_steps: int = 20
    baseline_steps: int = 200
    min_drop: float = 0.2
    kind: str = "throughput_drop"
    _recent: deque = field(default_factory=deque, repr=False)
    _baseline: RollingWindow = field(init=False, repr=False)
    _dropped: bool = False

    def __post_init__(self) -> None:
        if not 0 < self.min_drop < 1 or self.recent_steps < 3 or self.baseline_steps < 3:
            raise ValueError("ThroughputDropDetector: min_drop in (0, 1), windows >= 3 steps")
        self._baseline = RollingWindow(self.baseline_steps)

    def observe(self, s: StepView) -> list[Alert]:
        if s.tokens_per_s is None or not (math.isfinite(s.tokens_per_s) and s.tokens_per_s > 0):
            return []
        self._recent.append(s.tokens_per_s)
        if len(self._recent) > self.recent_steps:
            self._baseline.push(self._recent.popleft())
        if len(self._recent) < self.recent_steps or len(self._baseline) < self.recent_steps:
            return []
        baseline = self._baseline.median()
        worst_recent = max(self._recent)  # the whole window must be low
        if not self._dropped and worst_recent < (1 - self.min_drop) * baseline:
            self._dropped = True
            now = sorted(self._recent)[len(self._recent) // 2]
            return [
                Alert.at(
                    s,
                    kind=self.kind,
                    severity="warning",
                    message=(
                        f"throughput fell to {now:,.0f} tokens/s over the last "
                        f"{self.recent_steps} steps, {100 * (1 - now / baseline):.0f}% below "
                        f"the run's {baseline:,.0f} tokens/s before; MFU fell with it"
                    ),
                    value=now,
                    baseline=baseline,
                )
            ]
        if self._dropped and min(self._recent) > (1 - self.min_drop / 2) * baseline:
            self._dropped = False
        return []
