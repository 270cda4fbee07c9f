"""Sustained divergence: a loss that climbs and stays up, with or without a spike.

The loss is judged against a baseline *frozen* at the last healthy logged step, never
against a recent median, which follows a climb and hides it. The gradient norm, when
reported, is the second signal: its growth since that step lowers the loss rise needed.
The alert names the onset (`start_step`), how far the loss climbed, the gradient norm's
growth and the last checkpoint saved before the onset, to roll back to.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import deque
from dataclasses import dataclass, field

from .alerts import Alert
from .attribution import MAD_TO_SIGMA
from .detectors import data_query
from .lr_schedule import WarmRestarts, WarmUp
from .rolling import RollingWindow, median_of_sorted
from .views import RunEvent, StepView

# Raw losses in the fast level, the median that tells a decaying spike from a climb: a
# level over `level_window` losses still rises for half its window after a spike.
_FAST_WINDOW = 3
# Standard error of the median of n Gaussian values: sqrt(pi / 2) x sigma / sqrt(n)
# (asymptotic efficiency of the median; Kenney & Keeping, 1962).
_MEDIAN_SE = math.sqrt(math.pi / 2)
# The level's wander while healthy is measured over this many logged steps, once it holds
# _WANDER_MIN of them. For white noise, the level's distance from the slower level has
# sqrt(1 - 10/50) = 0.89x the level's standard error (the slower median's samples hold
# the level's, so their errors are correlated): x 1.12 puts it back on the level's scale.
_WANDER_STEPS = 500
_WANDER_MIN = 50
_WANDER_TO_SE = 1.12
# ... less the trend's part in it: on a falling loss the level leads the slower level by
# the trend times the 20 steps between their centres, which is no wander. The trend is the
# slower level's change over this many healthy steps. Without it, after a loss fell 10x in
# its first 150 steps (the reference trainer) the distances of the fall made the level's
# error 0.1-0.27 in log, and a real climb of 25-50% raised nothing for 250 steps
# (bench/real_divergence.py). White noise adds 3% to the distance's variance through it.
_TREND_STEPS = 50
# Healthy steps whose offsets are known before the baseline is raised by their median.
_OFFSET_MIN = 50
# Interquartile range of a normal distribution, in standard deviations.
_IQR_TO_SIGMA = 1 / 1.349


@dataclass(frozen=True)
class DivergenceSettings:
    """Thresholds of the divergence detector (section `divergence`). Windows count logged
    steps. Defaults chosen on bench/loss_curves.py (docs/benchmarks.md)."""

    # Logged steps in the median that gives the loss's current level: long enough that
    # one-step bumps and spikes do not move it, short enough to lag a climb by ~10 steps.
    level_window: int = 10
    # Logged steps in the slower median whose lowest value over `baseline_window` is the
    # baseline: a longer median has less noise, so its minimum is biased low less.
    baseline_level_window: int = 50
    # Logged steps over which the baseline is the lowest slow median (while healthy): a
    # climb slower than this would drag the baseline along with it.
    baseline_window: int = 1000
    # Logged steps (while healthy) over which the baseline's offset is measured: the
    # baseline is the lowest slower median plus the median of that median's distance
    # above its lowest, once `_OFFSET_MIN` such steps are known (0: the lowest alone). On
    # a falling loss the distance is about 0; on a flat loss that wanders, the lowest is
    # the wander's low and a wander up looks like a climb, so the baseline is raised to
    # the typical level.
    baseline_offset_window: int = 500
    # Logged steps of step-to-step differences behind the noise estimate.
    noise_window: int = 100
    # Finite losses seen before judging anything.
    min_history: int = 20
    # Loss rise over the baseline (a ratio - 1) that is a divergence on the loss alone:
    # above the few percent of a data-order shift or a plateau's wander.
    min_rise: float = 0.10
    # Loss rise that suffices when the gradient norm grew by `min_grad_growth` too.
    min_rise_with_grad: float = 0.05
    # Growth of the gradient norm's level since the onset (a ratio) that corroborates...
    # (a data-order shift moved it by up to 10% on bench/loss_curves.py's clean curves)
    min_grad_growth: float = 1.15
    # ... and that stands this many standard errors above the gradient norm's level at
    # the onset (a slower median, over `baseline_level_window`; its noise measured as the
    # loss's), so that a noisy gradient norm needs more growth (per-step noise of 10%:
    # 14%; of 20%: 30%).
    # 1.25 without this test found 14 of the tuning seeds' 40 divergences within 50
    # steps; 1.15 with it 17, at 2 more false alerts in 449,172 steps.
    grad_z: float = 3.0
    # The rise must also exceed this many standard errors of the level, so that a noisy
    # loss needs a larger rise (5% noise per step: about 9%).
    noise_z: float = 5.0
    # A level within this many standard errors of the baseline is healthy: the last such
    # step is the onset, where the baseline freezes.
    healthy_z: float = 2.0
    # Consecutive logged steps that must meet the rule before the alert.
    confirm_steps: int = 3
    # The loss is recovering once its level fell from the episode's peak by this fraction
    # of the climb, or its last 3 losses' median fell below its high of the level's window
    # by 4 standard errors: no alert then (a spike's decay, 3.44 -> 0.88 -> 0.58).
    recover_fraction: float = 0.25
    # The episode resolves when the level is back within this ratio - 1 of the baseline.
    resolve_rise: float = 0.03
    # A learning rate up by this factor, to a peak used before, is a warm restart
    # (lr_schedule.py): the loss may rise; judging pauses for `restart_grace_steps`.
    restart_lr_ratio: float = 1.5
    restart_grace_steps: int = 100
    # A second rule, for slow climbs: a CUSUM (Page 1954) that sums, over every logged
    # step since the onset, the loss's excess over the frozen baseline plus
    # `cusum_allowance` (a ratio - 1: a benign data-order shift's size accrues nothing),
    # in noise standard deviations. Where the gradient norm is reported, its excess over
    # its level at the onset times `cusum_grad_allowance` joins in (Stouffer: the two
    # terms' sum / sqrt(2)), and the alert also needs the gradient norm's level grown by
    # that much and `grad_z` standard errors for `confirm_steps` steps in a row (else a
    # strong loss term carries a flat gradient norm: a +7% level shift, which a test pins
    # as benign). Where it is not reported, the loss's allowance grows by
    # `cusum_allowance_z` standard errors of its level, for want of a second signal. Each
    # term is clipped to +-`cusum_clip` (a spike adds little). A climb is flagged once the
    # sum reaches `cusum_threshold`, with the level `cusum_allowance` up. Summing every
    # step instead of judging a median flags a slow climb sooner: on bench/loss_curves.py's
    # tuning seeds, 19 of 40 divergences within 50 steps of onset instead of 17, at 13
    # false alerts in 449,172 steps instead of 12 (without the gradient norm's gate: 25, at
    # 15, but the +7% shift flagged).
    cusum_allowance: float = 0.05
    cusum_grad_allowance: float = 1.05
    cusum_allowance_z: float = 2.0
    cusum_clip: float = 3.0
    cusum_threshold: float = 10.0
    # A third rule, for a climb still below `cusum_allowance`: a data-order shift is a step
    # that then stays flat (or falls with training), a climb keeps rising. Over the last
    # `ramp_window` logged losses (in log, over the frozen baseline), the best ramp from
    # the baseline (a hinge, starting at any of those steps) must explain them better than
    # the best single step (at any of them) by `ramp_margin` noise variances, and stand
    # `noise_z` standard errors out of zero; while it does, a second CUSUM sums each loss's
    # excess over the baseline plus `ramp_allowance` (clipped like the first), and flags
    # the climb at `cusum_threshold` once the level is up `resolve_rise` (else the alert
    # would resolve at once). Whenever the step explains the window better, that sum
    # starts again from 0, so a +5% step accrues nothing however long it stays (chance
    # openings, summed, flagged a +3% step 9 times in a test). It needs the learning
    # rate reported: a loss that rises with the learning rate (a warm-up or restart
    # missed) is a ramp too. On bench/loss_curves.py's tuning seeds: 22 of 40 divergences
    # within 50 steps of onset instead of 19, at 12 false alerts in 449,172 steps instead
    # of 11 (a margin of 0: 23, at 14; without the learning rate's gate, with the loss
    # alone: 21 instead of 15, but 87 false `loss_diverging` instead of 73, in warm
    # restarts it cannot tell from climbs). Gated by the gradient norm's growth like the
    # first CUSUM, it found none sooner: at onset+50 a slow climb's gradient norm has
    # rarely grown out of its noise.
    ramp_window: int = 60
    ramp_allowance: float = 0.02
    ramp_margin: float = 3.0
    # The ramp must span at least this many logged steps: just after a step, a few raised
    # losses fit a steep short ramp as well as the step, by chance (a +5% step in 1% noise
    # was flagged 4 steps after it, in a test, without this). Over 20 seeds of +3%, +4%
    # and +5% steps in 1% noise, 20 steps let 2 of 60 be flagged, 30 steps 1 (the tuning
    # seeds' figures are the same with either).
    ramp_min_steps: int = 30
    # While the learning rate climbs to new peaks (a warm-up) and for this many logged
    # steps after the last, the loss may rise with it: the rise needs the gradient norm's
    # growth too (lr_schedule.py). On the tuning seeds of bench/loss_curves.py, all 8
    # false alerts on warm-restart curves came during the first warm-up, 41-102 steps in.
    warmup_grace_steps: int = 50

    def __post_init__(self) -> None:
        for name in (
            "level_window",
            "baseline_level_window",
            "baseline_window",
            "noise_window",
            "min_history",
            "confirm_steps",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"divergence.{name} must be >= 1, got {getattr(self, name)}")
        if self.noise_window < 3:
            raise ValueError(f"divergence.noise_window must be >= 3, got {self.noise_window}")
        for name in ("min_rise", "min_rise_with_grad", "resolve_rise", "recover_fraction"):
            if not getattr(self, name) > 0:
                raise ValueError(f"divergence.{name} must be > 0, got {getattr(self, name)}")
        if self.min_rise_with_grad > self.min_rise:
            raise ValueError(
                f"divergence.min_rise_with_grad ({self.min_rise_with_grad}) must be <= "
                f"divergence.min_rise ({self.min_rise})"
            )
        if self.resolve_rise >= self.min_rise_with_grad:
            raise ValueError(
                f"divergence.resolve_rise ({self.resolve_rise}) must be < "
                f"divergence.min_rise_with_grad ({self.min_rise_with_grad})"
            )
        if not self.recover_fraction < 1:
            raise ValueError(
                f"divergence.recover_fraction must be < 1, got {self.recover_fraction}"
            )
        for name in ("min_grad_growth", "restart_lr_ratio"):
            if not getattr(self, name) > 1:
                raise ValueError(f"divergence.{name} must be > 1, got {getattr(self, name)}")
        for name in (
            "noise_z", "healthy_z", "grad_z", "ramp_allowance", "ramp_margin", "cusum_allowance_z"
        ):  # fmt: skip
            if not getattr(self, name) >= 0:
                raise ValueError(f"divergence.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("restart_grace_steps", "warmup_grace_steps", "baseline_offset_window"):
            if getattr(self, name) < 0:
                raise ValueError(f"divergence.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("cusum_allowance", "cusum_threshold", "cusum_clip"):
            if not getattr(self, name) > 0:
                raise ValueError(f"divergence.{name} must be > 0, got {getattr(self, name)}")
        if self.ramp_window < 3:
            raise ValueError(f"divergence.ramp_window must be >= 3, got {self.ramp_window}")
        if not 2 <= self.ramp_min_steps <= self.ramp_window:
            raise ValueError(
                f"divergence.ramp_min_steps must be in [2, divergence.ramp_window "
                f"({self.ramp_window})], got {self.ramp_min_steps}"
            )
        if not self.cusum_grad_allowance >= 1:
            raise ValueError(
                f"divergence.cusum_grad_allowance must be >= 1, got {self.cusum_grad_allowance}"
            )


@dataclass(frozen=True)
class _Onset:
    """The last healthy logged step: where the baseline froze."""

    step: int
    baseline: float  # log-loss
    grad_level: float  # log grad norm level then (slow median); NaN: not reported


class _LowestOf:
    """Lowest of the last `size` values pushed: a monotone deque, O(1) amortised."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._n = 0
        self._low: deque[tuple[int, float]] = deque()  # (index, value), values increasing

    def push(self, x: float) -> None:
        while self._low and self._low[-1][1] >= x:
            self._low.pop()
        self._low.append((self._n, x))
        self._n += 1
        if self._low[0][0] <= self._n - 1 - self.size:
            self._low.popleft()

    def lowest(self) -> float:
        return self._low[0][1]

    def clear(self) -> None:
        self._low.clear()


@dataclass
class DivergenceDetector:
    """`loss_diverging` (critical): the loss climbed and is not coming back down.

    Per logged step, in log space: the level `m` (median of the last `level_window`
    losses) against the baseline `B`, the lowest slower median (`baseline_level_window`)
    of the last `baseline_window` steps, raised by that median's typical distance above
    its lowest while healthy (`baseline_offset_window`). While `m` stays within `healthy_z` standard
    errors of `B` the step is healthy; once it leaves, `B` is frozen, so a slow climb
    cannot drag it along. The onset (`start_step`) is the logged step before the climb's
    first loss: the first of the level's window more than 3 noise standard deviations
    above `B` (the level lags a jump by half its window). The alert needs, for `confirm_steps`
    steps in a row: a rise m - B of at least `min_rise` (or `min_rise_with_grad` when the
    gradient norm's level grew by `min_grad_growth` since the onset) and `noise_z`
    standard errors; and a loss that is not recovering (its level not down from the
    episode's peak by `recover_fraction` of the climb, nor its last 3 losses' median
    clearly below its recent high). Or, sooner on a slow climb: a CUSUM of every loss's
    excess over `B` plus `cusum_allowance` (joined by the gradient norm's growth where
    reported) reaches `cusum_threshold`; or, for a climb still below that allowance, a
    second CUSUM (2% allowance) that sums only while a ramp from `B` explains the last
    `ramp_window` losses better than any single step up (a data-order shift) does
    (see the settings). A level that jumped at the onset and rises no further is a shift,
    not a climb: it needs `min_rise`, and after `baseline_level_window` steps `B` is built
    afresh from it. It resolves once `m` is back within `resolve_rise` of `B`.
    Warm restarts of the learning rate pause it; while it
    warms up to new peaks a rise needs the gradient norm's growth too (lr_schedule.py).
    The noise is the robust spread of step-to-step differences, as in the spike detector;
    the level's standard error is the larger of what that noise gives and the level's own
    wander around the slower level while healthy (a drift on top of the noise).
    Per step: a few O(window) inserts into sorted windows.
    """

    settings: DivergenceSettings = field(default_factory=DivergenceSettings)
    kind: str = "loss_diverging"
    _level: RollingWindow = field(init=False, repr=False)
    _slow_level: RollingWindow = field(init=False, repr=False)
    _grad_level: RollingWindow = field(init=False, repr=False)
    _slow_grad: RollingWindow = field(init=False, repr=False)
    _grad_diffs: RollingWindow = field(init=False, repr=False)
    _last_g: float = math.nan
    _g_now: float = math.nan  # this step's log gradient norm; NaN: not reported
    _diffs: RollingWindow = field(init=False, repr=False)
    _lows: _LowestOf = field(init=False, repr=False)
    _offsets: RollingWindow = field(init=False, repr=False)  # healthy slower level - lowest
    _wander: RollingWindow = field(init=False, repr=False)  # level - slower level - trend
    _restarts: WarmRestarts = field(init=False, repr=False)
    _warmup: WarmUp = field(init=False, repr=False)
    _warming: bool = False  # the learning rate is warming up: a loss rise is expected
    _last_x: float = math.nan
    _seen: int = 0  # finite losses
    _grace_left: int = 0  # logged steps still paused after a warm restart
    _onset: _Onset | None = None  # last healthy step
    _start: int | None = None  # onset of the climb, once the level left the healthy band
    _recent: deque[tuple[int, float]] = field(init=False, repr=False)  # (step, log-loss)
    _fast: deque[float] = field(init=False, repr=False)  # fast levels, last level_window
    _peak: float = -math.inf  # highest level since the onset
    _jump: float = math.inf  # log-loss level the episode jumped to at its start
    _shifted_for: int = 0  # consecutive logged steps the level stayed where it jumped
    _streak: int = 0  # consecutive steps meeting the rule
    _cusum: float = 0.0  # evidence of a climb since the onset, in noise deviations
    _grown_streak: int = 0  # consecutive steps the gradient norm's level stood grown
    _ramp_cusum: float = 0.0  # evidence of a still-rising climb since the onset
    _window: deque[float] = field(init=False, repr=False)  # last ramp_window log-losses
    _lr_reported: bool = False  # this step's learning rate is known
    _alert: Alert | None = None  # the open episode
    _checkpoints: list[int] = field(default_factory=list)  # steps of checkpoint events, sorted

    def __post_init__(self) -> None:
        cfg = self.settings
        self._level = RollingWindow(cfg.level_window)
        self._slow_level = RollingWindow(cfg.baseline_level_window)
        self._grad_level = RollingWindow(cfg.level_window)
        self._slow_grad = RollingWindow(cfg.baseline_level_window)
        self._grad_diffs = RollingWindow(cfg.noise_window)
        self._diffs = RollingWindow(cfg.noise_window)
        self._lows = _LowestOf(cfg.baseline_window)
        self._offsets = RollingWindow(max(cfg.baseline_offset_window, 1))
        self._wander = RollingWindow(_WANDER_STEPS)
        self._slows: deque[float] = deque(maxlen=_TREND_STEPS + 1)  # healthy slower levels
        self._restarts = WarmRestarts(cfg.restart_lr_ratio)
        self._warmup = WarmUp(cfg.warmup_grace_steps)
        self._recent = deque(maxlen=cfg.level_window + 1)
        self._fast = deque(maxlen=cfg.level_window)
        self._window = deque(maxlen=cfg.ramp_window)

    def observe_events(self, events: list[RunEvent]) -> None:
        """Checkpoints saved by the run: rollback advice names the last before an onset."""
        for e in events:
            if e.kind == "checkpoint":
                i = bisect.bisect_left(self._checkpoints, e.step)
                if i == len(self._checkpoints) or self._checkpoints[i] != e.step:
                    self._checkpoints.insert(i, e.step)

    def observe(self, s: StepView) -> list[Alert]:
        if self._restarts.is_restart(s.lr):
            self._restart()
        warming, self._warming = self._warming, self._warmup.is_warming(s.lr)
        if warming and not self._warming and self._alert is None:
            self._rebase()  # the loss rose with the warm-up: judge from its new level
        if s.loss is None or not (math.isfinite(s.loss) and s.loss > 0):
            return []  # non-finite losses are the NonFiniteDetector's
        self._push(s)
        if self._grace_left > 0:  # the baseline is built afresh after it
            self._grace_left -= 1
            return []
        if self._onset is None or self._seen < self.settings.min_history:
            self._healthy(s.step, self._lowest_slow())
            return []
        return self._judge(s)

    def _push(self, s: StepView) -> None:
        x = math.log(s.loss)
        self._level.push(x)
        self._slow_level.push(x)
        if math.isfinite(self._last_x):
            self._diffs.push(x - self._last_x)
        self._last_x = x
        self._window.append(x)
        self._lr_reported = s.lr is not None and math.isfinite(s.lr)
        self._recent.append((s.step, x))
        last = sorted(x for _, x in list(self._recent)[-_FAST_WINDOW:])
        self._fast.append(median_of_sorted(last))
        g = s.grad_norm
        self._g_now = math.nan
        if g is not None and math.isfinite(g) and g > 0:
            y = self._g_now = math.log(g)
            self._grad_level.push(y)
            self._slow_grad.push(y)
            if math.isfinite(self._last_g):
                self._grad_diffs.push(y - self._last_g)
            self._last_g = y
        self._seen += 1

    def _restart(self) -> None:
        """A warm restart: pause, and build the baseline afresh from what follows."""
        self._grace_left = self.settings.restart_grace_steps
        self._rebase()

    def _rebase(self) -> None:
        """Build the baseline afresh from the steps that follow."""
        self._lows.clear()
        self._offsets.clear()
        self._onset = None
        self._streak = 0
        self._cusum = 0.0
        self._ramp_cusum = 0.0
        self._grown_streak = 0

    def _healthy(self, step: int, baseline: float) -> None:
        grad = self._slow_grad.median() if len(self._slow_grad) else math.nan
        self._onset = _Onset(step, baseline, grad)
        self._start = None
        self._jump = math.inf
        self._shifted_for = 0
        self._peak = -math.inf
        self._streak = 0
        self._cusum = 0.0
        self._ramp_cusum = 0.0
        self._grown_streak = 0

    def _noise(self, diffs_window: RollingWindow | None = None) -> float:
        """Standard deviation of one log-loss's (or log grad norm's) noise, from
        step-to-step differences."""
        window = self._diffs if diffs_window is None else diffs_window
        if len(window) < 3:
            return 0.0
        diffs = window.values()
        typical = median_of_sorted(diffs)
        mad = median_of_sorted(sorted(abs(d - typical) for d in diffs))
        return MAD_TO_SIGMA * mad / math.sqrt(2)  # a difference holds two values' noise

    def _lowest_slow(self) -> float:
        """The baseline while healthy: the lowest slower level of the last
        `baseline_window` steps, raised by its typical offset (`baseline_offset_window`).
        Until the slower median holds its whole window it is that
        median alone: the median of a run's first few noisy losses is no floor (at 15%
        noise, those of the first 20 steps of a flat loss sat 19% under its level, and a
        baseline kept there raised `loss_diverging` 26 times in 3,000 clean steps)."""
        slow = self._slow_level.median()
        if len(self._slow_level) < self.settings.baseline_level_window:
            return slow
        self._lows.push(slow)
        lowest = self._lows.lowest()
        if self.settings.baseline_offset_window == 0:
            return lowest
        self._offsets.push(slow - lowest)
        if len(self._offsets) < _OFFSET_MIN:
            return lowest
        return lowest + self._offsets.median()

    def _push_wander(self, level: float) -> None:
        """A healthy step's wander: the level's distance from the slower level, less what
        the trend puts between them (once _TREND_STEPS healthy steps show the trend)."""
        slow = self._slow_level.median()
        self._slows.append(slow)
        if len(self._slows) <= _TREND_STEPS:
            return
        trend = (self._slows[-1] - self._slows[0]) / _TREND_STEPS  # per logged step
        lead_steps = (self.settings.baseline_level_window - self.settings.level_window) / 2
        self._wander.push(level - slow - lead_steps * trend)

    def _wander_se(self) -> float:
        """The level's standard error from its own wander while healthy: the robust spread
        (interquartile range) of its distance from the slower level; 0 until
        _WANDER_MIN healthy steps are known. O(1): the window is kept sorted."""
        n = len(self._wander)
        if n < _WANDER_MIN:
            return 0.0
        v = self._wander.values()
        return _WANDER_TO_SE * _IQR_TO_SIGMA * (v[(3 * n) // 4] - v[n // 4])

    def _jumped_to(self) -> float:
        """The median log-loss since the climb's start, when the level first leaves the
        healthy band: where a shift jumped to (the level lags it by half its window), or
        the first few steps of a climb."""
        after = sorted(x for step, x in self._recent if step > self._start)
        return median_of_sorted(after) if after else math.inf

    def _climb_start(self, baseline: float, sigma: float) -> int:
        """The logged step before the first loss of the level's window that stands more
        than 3 noise deviations above the baseline; the last healthy step if none does."""
        for (before, _), (_, x) in itertools.pairwise(self._recent):
            if x > baseline + 3 * sigma:
                return min(before, self._onset.step)
        return self._onset.step

    def _judge(self, s: StepView) -> list[Alert]:
        cfg = self.settings
        level = self._level.median()
        sigma = self._noise()
        # White noise sets the level's error; a slow drift on top (an SFT run's heavy-tailed
        # noise, a data order's wander) moves the level more, and then its wander does.
        se = max(_MEDIAN_SE * sigma / math.sqrt(len(self._level)), self._wander_se())
        frozen = self._onset is not None and level - self._onset.baseline > cfg.healthy_z * se
        if not frozen:
            self._push_wander(level)
            baseline = self._lowest_slow()
        else:
            baseline = self._onset.baseline
        rise = level - baseline
        alerts = []
        healthy = cfg.healthy_z * se
        if self._alert is not None and rise <= max(math.log1p(cfg.resolve_rise), healthy):
            alerts.append(self._resolve(s, level, baseline))
        if rise <= healthy:
            self._healthy(s.step, baseline)
            return alerts
        self._peak = max(self._peak, level)
        if self._start is None:
            self._start = self._climb_start(baseline, sigma)
        if self._recent[0][0] <= self._start:  # every loss since the start still in view
            self._jump = self._jumped_to()
        if self._alert is not None:
            return alerts
        onset = self._onset
        growth = self._grad_growth(onset)
        corroborated = growth is not None and growth >= max(
            math.log(cfg.min_grad_growth), cfg.grad_z * self._grad_growth_se()
        )
        # A level that jumped at the start (by `noise_z` standard errors: a slow climb's
        # first losses do not) and has not risen above where it jumped is a shift (a data
        # mixture's switch, with its gradient norm's jump), not a climb: only a rise of
        # `min_rise` is a divergence then, whatever the gradient norm, and the CUSUM sums
        # nothing. A shift that stays `baseline_level_window` steps is the new level: the
        # baseline is built afresh from it (else any later excursion would count the
        # shift as a climb).
        jumped = self._jump - baseline >= cfg.noise_z * se
        shifted = jumped and level <= self._jump + healthy
        self._shifted_for = self._shifted_for + 1 if shifted else 0
        if self._shifted_for >= cfg.baseline_level_window:
            self._rebase()
            return alerts
        need = max(
            math.log1p(cfg.min_rise_with_grad if corroborated and not shifted else cfg.min_rise),
            cfg.noise_z * se,
        )
        recovering = level < self._peak - max(cfg.recover_fraction * rise, healthy)
        # ... or the last few losses fell clearly below their recent high: the level,
        # a median, still climbs for half its window while a spike decays.
        fast_se = _MEDIAN_SE * sigma / math.sqrt(_FAST_WINDOW)
        recovering |= self._fast[-1] < max(self._fast) - 4 * fast_se
        # A warm-up explains a rising loss, not a growing gradient norm.
        explained = self._warming and not corroborated
        self._streak = self._streak + 1 if rise >= need and not (recovering or explained) else 0
        cusum = self._climbing(baseline, sigma, rise, se)
        ramp = self._ramping(baseline, sigma)  # both sums move every step
        ramp &= rise > math.log1p(cfg.resolve_rise)  # else it would resolve at once
        if shifted:
            self._cusum, cusum = 0.0, False
        climbing = (cusum or ramp) and not (recovering or explained)
        if self._streak >= cfg.confirm_steps or climbing:
            self._alert = self._diverging(s, onset, level, growth)
            alerts.append(self._alert)
        return alerts

    def _climbing(self, baseline: float, sigma: float, rise: float, se: float) -> bool:
        """The CUSUM rule: adds this step's excess (the loss's, joined by the gradient
        norm's where reported) to the evidence since the onset; True once it suffices.
        O(1) a step, apart from the gradient norm's noise (as `_noise`)."""
        cfg = self.settings
        if sigma <= 0:
            return False
        allowance = math.log1p(cfg.cusum_allowance)
        loss = (self._last_x - baseline - allowance) / sigma
        if self._joins_grad():
            grad = self._g_now - self._onset.grad_level - math.log(cfg.cusum_grad_allowance)
            term = (
                self._clip(loss) + self._clip(grad / self._noise(self._grad_diffs))
            ) / math.sqrt(2)
            # The gradient norm's level must stand grown too, for `confirm_steps` in a row:
            # a strong loss term must not carry a flat gradient norm (a level shift).
            self._grown_streak = self._grown_streak + 1 if self._grad_grown() else 0
            grown = self._grown_streak >= cfg.confirm_steps
        else:
            term = self._clip(loss - cfg.cusum_allowance_z * se / sigma)
            grown = True
        self._cusum = max(0.0, self._cusum + term)
        return self._cusum >= cfg.cusum_threshold and rise >= allowance and grown

    def _ramping(self, baseline: float, sigma: float) -> bool:
        """The ramp rule: adds this step's excess over the baseline plus `ramp_allowance` to
        its CUSUM while a ramp explains the window better than a single step does
        (`_ramp_lead`), and starts it again from 0 when not; True once the sum reaches
        `cusum_threshold`. Only where the learning rate is reported. O(ramp_window)."""
        cfg = self.settings
        if sigma <= 0 or not self._lr_reported or len(self._window) < cfg.ramp_window:
            return False
        term = self._clip((self._last_x - baseline - math.log1p(cfg.ramp_allowance)) / sigma)
        if self._ramp_lead(baseline, sigma) < cfg.ramp_margin:
            self._ramp_cusum = 0.0  # a step explains the window: start again
            return False
        self._ramp_cusum = max(0.0, self._ramp_cusum + term)
        return self._ramp_cusum >= cfg.cusum_threshold

    def _ramp_lead(self, baseline: float, sigma: float) -> float:
        """How much better (in noise variances) the best rising ramp from the baseline
        explains the window's excesses e_i over it than the best single step up does;
        -inf unless that ramp stands `noise_z` standard errors out of zero. A ramp from
        step k (spanning `ramp_min_steps` at least), e_i = b (i - k) for i >= k, removes
        (sum e_i (i - k))^2 / sum (i - k)^2 of the squared excess; a step at k, e_i = c for
        i >= k, (sum e_i)^2 / (n - k). Both for every k at once, from suffix sums of e_i
        and i e_i."""
        ramp = step = 0.0
        s0 = s1 = 0.0  # sum of e_i and of i e_i over i >= k
        n = len(self._window)
        for k in range(n - 1, -1, -1):
            e = self._window[k] - baseline
            s0 += e
            s1 += k * e
            m = n - k
            if s0 > 0:
                step = max(step, s0 * s0 / m)
            lever = s1 - k * s0  # sum e_i (i - k)
            if lever > 0 and m >= self.settings.ramp_min_steps:
                ramp = max(ramp, lever * lever / ((m - 1) * m * (2 * m - 1) / 6))
        if ramp < (self.settings.noise_z * sigma) ** 2:
            return -math.inf
        return (ramp - step) / (sigma * sigma)

    def _joins_grad(self) -> bool:
        """Whether this step's gradient norm, its level at the onset and its noise are known."""
        return (
            math.isfinite(self._g_now)
            and self._onset is not None
            and math.isfinite(self._onset.grad_level)
            and self._noise(self._grad_diffs) > 0
        )

    def _grad_grown(self) -> bool:
        """The gradient norm's level grew since the onset by `cusum_grad_allowance` and
        `grad_z` standard errors."""
        cfg = self.settings
        growth = self._grad_growth(self._onset)
        need = max(math.log(cfg.cusum_grad_allowance), cfg.grad_z * self._grad_growth_se())
        return growth is not None and growth >= need

    def _clip(self, z: float) -> float:
        return min(max(z, -self.settings.cusum_clip), self.settings.cusum_clip)

    def _grad_growth(self, onset: _Onset) -> float | None:
        """log(grad-norm level now / at the onset); None when not reported."""
        if not (len(self._grad_level) and math.isfinite(onset.grad_level)):
            return None
        return self._grad_level.median() - onset.grad_level

    def _grad_growth_se(self) -> float:
        """Standard error of the growth: the level's median against the onset's slower one."""
        sigma = self._noise(self._grad_diffs)
        n_fast, n_slow = len(self._grad_level), max(len(self._slow_grad), 1)
        return _MEDIAN_SE * sigma * math.sqrt(1 / max(n_fast, 1) + 1 / n_slow)

    def _diverging(self, s: StepView, onset: _Onset, level: float, growth: float | None) -> Alert:
        base = math.exp(onset.baseline)
        grad = (
            "gradient norm not reported"
            if growth is None
            else f"gradient norm {math.exp(growth):.2g}x its level at the onset"
        )
        start = self._start
        message = (
            f"loss diverging since step {start}: its level (median of the last "
            f"{len(self._level)} logged losses) rose to {math.exp(level):.4g} at step {s.step}, "
            f"{math.exp(level - onset.baseline):.2f}x its baseline {base:.4g} (frozen at step "
            f"{onset.step}, the last at which the level, a median that lags the losses, was "
            f"healthy), and is not coming back down; {grad}. "
            f"{self._rollback(start)} Data: "
            + data_query(s.run_id, "steps", None, start - self.settings.level_window, s.step)
        )
        return Alert.at(
            s,
            kind=self.kind,
            severity="critical",
            message=message,
            value=math.exp(level),
            baseline=base,
            start_step=start,
        )

    def _rollback(self, onset_step: int) -> str:
        """Advice: the last checkpoint saved before the onset. A checkpoint at step k holds
        the update made at step k, which the loss of the next step shows: the one saved at
        the onset (the last healthy loss) may hold the first bad update already."""
        i = bisect.bisect_left(self._checkpoints, onset_step)
        if i == 0:
            return (
                f"No checkpoint event before step {onset_step} was reported: roll back to a "
                f"checkpoint saved before step {onset_step}."
            )
        return (
            f"Roll back to the checkpoint saved at step {self._checkpoints[i - 1]}, the last "
            f"before the onset."
        )

    def _resolve(self, s: StepView, level: float, baseline: float) -> Alert:
        alert, self._alert = self._alert, None
        assert alert is not None
        return alert.resolved_at(
            s.step,
            s.time_unix_s,
            f"loss back to {math.exp(level):.4g} at step {s.step}, within "
            f"{math.expm1(max(level - baseline, 0)):.0%} of its baseline {math.exp(baseline):.4g}: "
            f"the divergence that began after step {alert.start_step} has ended",
        )
