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
from typing import ClassVar

from .alerts import Alert
from .detectors import RollingWindow, StepView


@dataclass(frozen=True)
class ThroughputSettings:
    """Thresholds of the throughput-drop detector (section `throughput`)."""

    # Logged steps of the recent level; every one of them must be low, so a drop that
    # lasts less than this (a checkpoint save, a garbage collection) raises nothing.
    recent_steps: int = 20
    # Logged steps before the recent ones whose median is the run's usual throughput.
    baseline_steps: int = 200
    # Fraction (0-1) below the baseline that counts as a drop; the detector re-arms once
    # throughput is back within half of it. 20%: well above the few percent that step
    # times of a healthy run wander by.
    min_drop: float = 0.2

    def __post_init__(self) -> None:
        for name in ("recent_steps", "baseline_steps"):
            if getattr(self, name) < 3:
                raise ValueError(f"throughput.{name} must be >= 3, got {getattr(self, name)}")
        if not 0 < self.min_drop < 1:
            raise ValueError(f"throughput.min_drop must be in (0, 1), got {self.min_drop}")


@dataclass
class ThroughputDropDetector:
    """Tokens/s below the run's own baseline for a whole recent window (module docstring)."""

    settings: ThroughputSettings = field(default_factory=ThroughputSettings)
    kind: ClassVar[str] = "throughput_drop"
    _recent: deque = field(default_factory=deque, repr=False)
    _baseline: RollingWindow = field(init=False, repr=False)
    _dropped: bool = False

    def __post_init__(self) -> None:
        self._baseline = RollingWindow(self.settings.baseline_steps)

    def observe(self, s: StepView) -> list[Alert]:
        cfg = self.settings
        if s.tokens_per_s is None or not (math.isfinite(s.tokens_per_s) and s.tokens_per_s > 0):
            return []
        self._recent.append(s.tokens_per_s)
        if len(self._recent) > cfg.recent_steps:
            self._baseline.push(self._recent.popleft())
        if len(self._recent) < cfg.recent_steps or len(self._baseline) < cfg.recent_steps:
            return []
        baseline = self._baseline.median()
        worst_recent = max(self._recent)  # the whole window must be low
        if not self._dropped and worst_recent < (1 - cfg.min_drop) * baseline:
            self._dropped = True
            now = sorted(self._recent)[len(self._recent) // 2]
            return [
                Alert.at(
                    s,
                    kind=self.kind,
                    severity="warning",
                    message=(
                        f"throughput fell to {now:,.0f} tokens/s over the last "
                        f"{cfg.recent_steps} steps, {100 * (1 - now / baseline):.0f}% below "
                        f"the run's {baseline:,.0f} tokens/s before; MFU fell with it"
                    ),
                    value=now,
                    baseline=baseline,
                )
            ]
        if self._dropped and min(self._recent) > (1 - cfg.min_drop / 2) * baseline:
            self._dropped = False
        return []
