"""Throughput drop: tokens/s (and so MFU) well below the run's own recent level.

Recent level: median tokens/s of the last `recent_steps` logged steps. Baseline: median of
the `baseline_steps` before those. A drop of at least `min_drop` (default 20%) for the
whole recent window, lasting `min_duration_s` of wall time, alerts once; the detector
re-arms when throughput is back within half that. Medians make one slow step (a
checkpoint save, a garbage collection) harmless; the duration, a swing of a busy host's
load (other processes taking the job's CPUs for a few seconds).
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
    # Wall time (from the steps' time_unix_s) the drop must have lasted, from the first
    # step of the first low window. On clean real 4-rank CPU runs on a machine loaded to 4x
    # its cores, the load's swings cut throughput by 40-60% for 20-33 steps, 12-16 s (five
    # times in 2,000 steps; bench/detect.py); a fault (a straggler, a throttled device, a
    # slow link) lasts minutes. A drop is named a minute after it began, at the latest
    # `recent_steps` after, when steps are longer than 3 s.
    min_duration_s: float = 60.0

    def __post_init__(self) -> None:
        for name in ("recent_steps", "baseline_steps"):
            if getattr(self, name) < 3:
                raise ValueError(f"throughput.{name} must be >= 3, got {getattr(self, name)}")
        if not 0 < self.min_drop < 1:
            raise ValueError(f"throughput.min_drop must be in (0, 1), got {self.min_drop}")
        if not self.min_duration_s >= 0:
            raise ValueError(f"throughput.min_duration_s must be >= 0, got {self.min_duration_s}")


@dataclass
class ThroughputDropDetector:
    """Tokens/s below the run's own baseline for a whole recent window (module docstring)."""

    settings: ThroughputSettings = field(default_factory=ThroughputSettings)
    kind: ClassVar[str] = "throughput_drop"
    _recent: deque = field(default_factory=deque, repr=False)
    _times: deque = field(default_factory=deque, repr=False)  # time_unix_s of _recent's steps
    _baseline: RollingWindow = field(init=False, repr=False)
    _low_since_s: float = math.nan  # first step of the first low window of this stretch
    _dropped: bool = False

    def __post_init__(self) -> None:
        self._baseline = RollingWindow(self.settings.baseline_steps)

    def observe(self, s: StepView) -> list[Alert]:
        cfg = self.settings
        if s.tokens_per_s is None or not (math.isfinite(s.tokens_per_s) and s.tokens_per_s > 0):
            return []
        self._recent.append(s.tokens_per_s)
        self._times.append(s.time_unix_s)
        if len(self._recent) > cfg.recent_steps:
            old = self._recent.popleft()
            self._times.popleft()
            if math.isnan(self._low_since_s) and not self._dropped:
                self._baseline.push(old)  # frozen while low, or a long drop becomes the norm
        if len(self._recent) < cfg.recent_steps or len(self._baseline) < cfg.recent_steps:
            return []
        baseline = self._baseline.median()
        low = max(self._recent) < (1 - cfg.min_drop) * baseline  # the whole window is low
        if not low:
            self._low_since_s = math.nan
        elif math.isnan(self._low_since_s):
            self._low_since_s = self._times[0]
        if not self._dropped and low:
            lasted_s = s.time_unix_s - self._low_since_s
            if not lasted_s >= cfg.min_duration_s:  # (NaN: no wall time to judge it by)
                return []
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
                        f"the run's {baseline:,.0f} tokens/s before, for {lasted_s:.0f} s; "
                        "MFU fell with it"
                    ),
                    value=now,
                    baseline=baseline,
                )
            ]
        if self._dropped and min(self._recent) > (1 - cfg.min_drop / 2) * baseline:
            self._dropped = False
        return []
