"""Streaming detectors: explicit state, O(window) work per step, no I/O.

Each detector sees one logged step at a time, in step order, through `observe(step)`, and
returns the alerts that step raises. The same objects run live in the collector and over a
stored run, which is what makes a replay reproduce the live alerts.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass, field

from .alerts import Alert


@dataclass(frozen=True)
class StepView:
    """The slice of one logged step that detectors read."""

    run_id: str
    step: int
    time_unix_s: float
    loss: float
    grad_norm: float
    # Per-layer gradient norms in layer order, when the step carried them.
    layer_grad_norms: tuple[float, ...] = ()
    tokens_per_s: float = math.nan
    step_time_s: float = math.nan
    # Per-rank values in rank order, when the step carried them (None where not reported).
    ranks: RankView | None = None


@dataclass(frozen=True)
class RankView:
    compute_time_s: tuple[float | None, ...]
    wait_time_s: tuple[float | None, ...]
    loss: tuple[float, ...]
    canary_fingerprint: tuple[int | None, ...]


class NonFiniteDetector:
    """A NaN or infinite loss or gradient norm: training has already gone wrong."""

    kind = "nonfinite"

    def observe(self, s: StepView) -> list[Alert]:
        bad = [
            name
            for name, v in (("loss", s.loss), ("grad_norm", s.grad_norm))
            if v is not None and not math.isfinite(v)  # None: not reported
        ]
        if not bad:
            return []
        layer = next((i for i, v in enumerate(s.layer_grad_norms) if not math.isfinite(v)), None)
        where = f"; first non-finite gradient in layer {layer}" if layer is not None else ""
        return [
            Alert(
                run_id=s.run_id,
                step=s.step,
                kind=self.kind,
                severity="critical",
                message=f"non-finite {' and '.join(bad)} at step {s.step}{where}",
                time_unix_s=s.time_unix_s,
                value=s.loss if "loss" in bad else s.grad_norm,
                layer=layer,
            )
        ]


@dataclass
class LossSpikeDetector:
    """A loss far above its recent robust baseline.

    Baseline: median of log(loss) over the last `window` finite steps; spread: the median
    absolute deviation (MAD), scaled by 1.4826 so that it estimates a standard deviation
    for Gaussian noise (Rousseeuw & Croux, 1993). Working in log space makes the test
    relative, so it holds as the loss falls by orders of magnitude. A step alarms when its
    log-loss exceeds the median by `z_threshold` spreads *and* the loss is at least
    `min_rise_ratio` above the median loss: the second guard keeps a near-zero MAD on a
    flat curve from turning noise into alerts. One alert per episode: after an alarm the
    detector is quiet for `cooldown_steps`.

    After a spike the detector follows the episode against the baseline frozen at the
    spike: a loss back under baseline x (1 + min_rise_ratio) has recovered; one still above
    it `diverge_steps` later is diverging, which raises a critical `loss_diverging` alert.
    """

    window: int = 50
    min_history: int = 20
    z_threshold: float = 8.0
    min_rise_ratio: float = 0.2
    cooldown_steps: int = 50
    diverge_steps: int = 20
    kind: str = "loss_spike"
    _window: RollingWindow = field(init=False, repr=False)
    _quiet_until: int = -1
    _episode: tuple[int, float] | None = None  # (spike step, baseline loss) while unresolved

    def __post_init__(self) -> None:
        if self.window < 3 or not 3 <= self.min_history <= self.window:
            raise ValueError("LossSpikeDetector: need window >= min_history >= 3")
        if self.z_threshold <= 0 or self.min_rise_ratio < 0:
            raise ValueError("LossSpikeDetector: z_threshold must be > 0, min_rise_ratio >= 0")
        self._window = RollingWindow(self.window)

    def observe(self, s: StepView) -> list[Alert]:
        if s.loss is None or not (math.isfinite(s.loss) and s.loss > 0):
            return []  # non-finite losses are the NonFiniteDetector's
        x = math.log(s.loss)
        alerts = self._follow_episode(s)
        if len(self._window) >= self.min_history and s.step > self._quiet_until:
            median = self._window.median()
            mad = _median(sorted(abs(v - median) for v in self._window.values()))
            spread = 1.4826 * mad + 1e-12
            z = (x - median) / spread
            if z > self.z_threshold and x - median > math.log1p(self.min_rise_ratio):
                baseline = math.exp(median)
                alerts.append(
                    Alert(
                        run_id=s.run_id,
                        step=s.step,
                        kind=self.kind,
                        severity="warning",
                        message=(
                            f"loss {s.loss:.4g} at step {s.step} is {s.loss / baseline:.2f}x its "
                            f"recent median {baseline:.4g} "
                            + (f"({z:.1f} robust std devs)" if z < 1e3 else "(a flat baseline)")
                        ),
                        time_unix_s=s.time_unix_s,
                        value=s.loss,
                        baseline=baseline,
                    )
                )
                self._quiet_until = s.step + self.cooldown_steps
                self._episode = (s.step, baseline)
        self._window.push(x)
        return alerts

    def _follow_episode(self, s: StepView) -> list[Alert]:
        if self._episode is None or s.step == self._episode[0]:
            return []
        spike_step, baseline = self._episode
        if s.loss <= baseline * (1 + self.min_rise_ratio):
            self._episode = None  # recovered
            return []
        if s.step - spike_step < self.diverge_steps:
            return []
        self._episode = None
        return [
            Alert(
                run_id=s.run_id,
                step=s.step,
                kind="loss_diverging",
                severity="critical",
                message=(
                    f"loss has not recovered from the spike at step {spike_step}: "
                    f"{s.loss:.4g} at step {s.step} against {baseline:.4g} before it; "
                    "roll back to a checkpoint before the spike"
                ),
                time_unix_s=s.time_unix_s,
                value=s.loss,
                baseline=baseline,
            )
        ]


class RollingWindow:
    """The last `size` values, kept sorted too: O(size) insert, O(1) median."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._recent: deque = deque()
        self._sorted: list = []

    def push(self, x: float) -> None:
        self._recent.append(x)
        bisect.insort(self._sorted, x)
        if len(self._recent) > self.size:
            old = self._recent.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, old)]

    def median(self) -> float:
        return _median(self._sorted)

    def values(self) -> list[float]:
        return self._sorted

    def __len__(self) -> int:
        return len(self._recent)


def _median(sorted_values: list[float]) -> float:
    n = len(sorted_values)
    mid = n // 2
    return sorted_values[mid] if n % 2 else 0.5 * (sorted_values[mid - 1] + sorted_values[mid])
