"""Who caused a loss spike: the layer whose statistics moved first, the rank whose loss did.

Both keep cheap per-step state (a ring buffer of per-layer log statistics, a rolling
window of one number per step) and do the real work only at a spike step, which is rare.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from functools import partial

import numpy as np

from .rolling import RollingWindow
from .rolling import median as fast_median
from .runinfo import UNKNOWN, RunInfo, name_layer
from .views import LayerView, RankView

# Per-layer statistics watched, in the order of the evidence: the gradient, the change the
# optimizer made, the layer's output (RMS and largest magnitude).
LAYER_STATS = ("grad_norm", "update_rms", "act_rms", "act_max_abs")
MAD_TO_SIGMA = 1.4826  # MAD x this estimates a standard deviation for Gaussian noise


@dataclass(frozen=True)
class LayerDeviation:
    layer: int  # index into the run's layer names
    stat: str
    step: int  # first logged step of the lookback at which it deviated
    value: float
    baseline: float
    z: float  # robust standard deviations from its baseline

    def describe(self, run: RunInfo = UNKNOWN) -> str:
        return (
            f"{name_layer(run, self.layer)} {self.stat} {self.value:.3g} vs baseline "
            f"{self.baseline:.3g} ({self.value / self.baseline:.2g}x) at step {self.step}"
        )


@dataclass(frozen=True)
class LayerVerdict:
    first: list[LayerDeviation]  # the earliest deviations, strongest first
    n_deviated: int  # (layer, statistic) pairs that deviated anywhere in the lookback
    n_layers: int
    lead_factor: float = 1.5
    together_fraction: float = 0.5
    lookback: int = 5

    @property
    def leader(self) -> LayerDeviation | None:
        """The layer that led the spike, if one did.

        None when no layer deviated, or when at least `together_fraction` of the layers
        (two or more) moved at the earliest step: a bad batch or a learning-rate jump moves
        every layer at once, and so does an instability in one layer within a step, which
        one logged step cannot tell apart. Else the strongest, if its change (in log space)
        is at least `lead_factor` times that of every other layer deviating then.
        """
        if not self.first or self.moved_together:
            return None
        top = self.first[0]
        others = [abs(math.log(d.value / d.baseline)) for d in self.first if d.layer != top.layer]
        if not others or abs(math.log(top.value / top.baseline)) >= self.lead_factor * max(others):
            return top
        return None

    @property
    def layers_together(self) -> int:
        """Layers that deviated at the earliest step."""
        return len({d.layer for d in self.first})

    @property
    def moved_together(self) -> bool:
        together = self.layers_together
        return together >= 2 and together >= self.together_fraction * self.n_layers

    def explain(self, run: RunInfo = UNKNOWN) -> tuple[int | None, str | None, str]:
        """(index of the layer that led or None, the statistic to look at or None, a
        sentence of evidence naming layers as the run names them)."""
        lead = self.leader
        if lead is not None:
            others = [d.describe(run) for d in self.first[1:3]]
            return (
                lead.layer,
                lead.stat,
                f"first to move: {lead.describe(run)}"
                + (f"; with it {'; '.join(others)}" if others else "")
                + f" ({self.n_deviated} layer statistics deviated in the last {self.lookback} "
                "logged steps)",
            )
        if self.first:
            top = self.first[0]
            together = self.layers_together
            who = (
                "every layer"
                if together == self.n_layers
                else f"{together} of {self.n_layers} layers"
            )
            # The largest change is quoted without its layer: naming one would blame it.
            return (
                None,
                top.stat,
                f"{who} moved in the same step ({top.step}; largest change: {top.stat} "
                f"{top.value / top.baseline:.2g}x its baseline): no single layer led, as "
                "with a bad batch or a learning-rate jump",
            )
        if not self.n_layers:
            return None, None, ""
        return (
            None,
            None,
            f"no layer statistic deviated from its baseline in the last {self.lookback} "
            "logged steps",
        )


@dataclass(frozen=True)
class LayerAttributionSettings:
    """Which layer a loss spike names (section `layer_attribution`; LayerHistory). Windows
    count logged steps."""

    # Steps of history before the lookback: each statistic's trend and noise. Long enough
    # for a robust spread, short enough to follow gradient norms that fall early on.
    window: int = 50
    # Steps judged, ending at the spike: a layer that blows up a few logged steps before
    # the loss does (an instability growing inside it) deviates inside this lookback.
    lookback: int = 5
    # Steps in the median that is a statistic's level before each lookback step.
    level_window: int = 5
    # Steps of history needed before any layer is named.
    min_history: int = 10
    # A statistic deviated when it is this many noise deviations from its level...
    # (a bad batch moved real layers' gradient norms 3-80x; noise is a few percent)
    z_threshold: float = 6.0
    # ... and at least this factor away from it, either way (a near-zero noise on a flat
    # statistic would otherwise turn noise into deviations).
    min_ratio: float = 1.5
    # A layer led when its change (in log) is at least this many times every other
    # deviating layer's at the earliest step.
    lead_factor: float = 1.5
    # When at least this share of the layers (two or more) moved at the earliest step, no
    # layer led: a bad batch or a learning-rate jump moves every layer at once.
    together_fraction: float = 0.5

    def __post_init__(self) -> None:
        for name in ("window", "lookback", "level_window", "min_history"):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"layer_attribution.{name} must be >= 1, got {getattr(self, name)}"
                )
        if self.min_history > self.window:
            raise ValueError(
                f"layer_attribution.min_history must be <= window ({self.window}), got "
                f"{self.min_history}"
            )
        if self.level_window > self.min_history:
            raise ValueError(
                f"layer_attribution.level_window must be <= min_history ({self.min_history}), "
                f"got {self.level_window}"
            )
        if not self.z_threshold > 0:
            raise ValueError(f"layer_attribution.z_threshold must be > 0, got {self.z_threshold}")
        for name in ("min_ratio", "lead_factor"):
            if not getattr(self, name) >= 1:
                raise ValueError(
                    f"layer_attribution.{name} must be >= 1, got {getattr(self, name)}"
                )
        if not 0 < self.together_fraction <= 1:
            raise ValueError(
                "layer_attribution.together_fraction must be in (0, 1], got "
                f"{self.together_fraction}"
            )


@dataclass
class LayerHistory:
    """The last `window + lookback` logged steps of every layer's log statistics (the
    windows and thresholds: LayerAttributionSettings).

    At a spike, each (layer, statistic) series is judged over the last `lookback` logged
    steps, with the `window` steps before them as its history. Level at a lookback step:
    the median of the `level_window` steps just before it, moved on by the history's
    median step-to-step change over the half window that median lags by (a median over
    the whole window lags a series that trends, as gradient norms do early in training).
    Noise: the MAD of the history's step-to-step differences x 1.4826 / sqrt(2), which a
    trend does not inflate (the MAD of the values did: on a real 4-rank run a bad batch
    moved every layer's gradient norm 3-80x and only one of five layers cleared the bar).
    A statistic deviated at a lookback step if it is more than `z_threshold` noise
    deviations and a factor `min_ratio` away from its level (either way). The culprits
    are those that deviated earliest; LayerVerdict says whether one layer led (`leader`).
    Per step: one (stats x layers) row written, O(layers).
    """

    settings: LayerAttributionSettings = field(default_factory=LayerAttributionSettings)
    _buf: np.ndarray | None = field(default=None, repr=False)  # (capacity, stats, layers)
    _steps: np.ndarray | None = field(default=None, repr=False)
    _layers: np.ndarray | None = field(default=None, repr=False)
    _n: int = 0

    def push(self, step: int, layers: LayerView | None) -> None:
        if layers is None or not len(layers.layer):
            return
        cfg = self.settings
        cap = cfg.window + cfg.lookback
        if self._layers is None or not np.array_equal(self._layers, layers.layer):
            self._buf = np.full((cap, len(LAYER_STATS), len(layers.layer)), math.nan)
            self._steps = np.zeros(cap, dtype=np.int64)
            self._layers = layers.layer.copy()
            self._n = 0
        row = self._n % cap
        with np.errstate(divide="ignore", invalid="ignore"):
            for i, stat in enumerate(LAYER_STATS):
                self._buf[row, i] = np.log(getattr(layers, stat))
        self._buf[row][~np.isfinite(self._buf[row])] = math.nan
        self._steps[row] = step
        self._n += 1

    def deviations(self) -> LayerVerdict:
        """Which layers deviated first in the lookback, and whether one of them led."""
        cfg = self.settings
        verdict = partial(
            LayerVerdict,
            lead_factor=cfg.lead_factor,
            together_fraction=cfg.together_fraction,
            lookback=cfg.lookback,
        )
        if self._buf is None:
            return verdict([], 0, 0)
        cap = len(self._steps)
        k = min(cfg.lookback, self._n)
        n_base = min(self._n - k, cfg.window)
        if n_base < cfg.min_history:
            return verdict([], 0, 0)
        order = [(self._n - n_base - k + i) % cap for i in range(n_base + k)]
        base, recent = self._buf[order[:n_base]], self._buf[order[n_base:]]
        series = self._buf[order]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN: a stat not reported
            diffs = np.diff(base, axis=0)
            typical = np.nanmedian(diffs, axis=0)  # the trend, per logged step
            mad = np.nanmedian(np.abs(diffs - typical), axis=0)
            # Each lookback step against the median of the `level_window` steps just before
            # it, moved on by the trend over the half window that median lags by.
            lag = (cfg.level_window + 1) / 2
            level = np.stack(
                [
                    np.nanmedian(series[i - cfg.level_window : i], axis=0) + lag * typical
                    for i in range(n_base, n_base + k)
                ]
            )
        spread = MAD_TO_SIGMA * mad / math.sqrt(2) + 1e-9
        dev = recent - level
        z = dev / spread
        with np.errstate(invalid="ignore"):
            hit = (np.abs(z) > cfg.z_threshold) & (np.abs(dev) > math.log(cfg.min_ratio))
        if not hit.any():
            return verdict([], 0, len(self._layers))
        any_hit = hit.any(axis=0)
        first = np.where(any_hit, hit.argmax(axis=0), k)
        earliest = int(first.min())
        stats, layers = np.nonzero(first == earliest)
        strength = np.abs(dev[earliest, stats, layers])
        steps = self._steps[order[n_base:]]
        found = [
            LayerDeviation(
                layer=int(self._layers[layers[i]]),
                stat=LAYER_STATS[stats[i]],
                step=int(steps[earliest]),
                value=math.exp(recent[earliest, stats[i], layers[i]]),
                baseline=math.exp(level[earliest, stats[i], layers[i]]),
                z=float(z[earliest, stats[i], layers[i]]),
            )
            for i in np.argsort(-strength, kind="stable")
        ]
        return verdict(found, int(any_hit.sum()), len(self._layers))


@dataclass
class RankLossHistory:
    """Local losses against data-parallel peers: which rank's loss made the spike.

    Each step, every rank's deviation d = log(local loss / its peers' median) (views.py)
    and the step's typical |d| over ranks, kept for the last `window` steps. At a spike, a
    rank is named when its d exceeds `z_threshold` typical spreads and log(1 +
    `min_rise_ratio`): its own data (a bad batch) or arithmetic (a faulty device) raised
    the loss; peers hold the same model shard, so the model alone cannot explain it.
    Per step: one peer median per group, O(ranks), vectorised.
    """

    window: int = 50
    min_history: int = 10
    z_threshold: float = 6.0
    min_rise_ratio: float = 0.2
    _spread: RollingWindow = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._spread = RollingWindow(self.window)

    def culprits(self, ranks: RankView | None) -> tuple[np.ndarray, np.ndarray, str]:
        """(positions of the named ranks, their d, a sentence of evidence) at this step."""
        none = np.empty(0, dtype=np.int64)
        if ranks is None or not len(ranks):
            return none, none, ""
        d, counts = ranks.peer_deviation("loss")
        if not (counts >= 2).any():
            return none, none, "no data-parallel peers to compare local losses with"
        bar = math.log1p(self.min_rise_ratio)
        if len(self._spread) >= self.min_history:
            bar = max(bar, self.z_threshold * MAD_TO_SIGMA * self._spread.median())
        with np.errstate(invalid="ignore"):
            named = np.flatnonzero((d > bar) & (counts >= 2))
        if not len(named):
            worst = np.nanmax(d) if np.isfinite(d).any() else math.nan
            return (
                none,
                none,
                (
                    f"no rank's local loss stands out from its data-parallel peers (largest: "
                    f"{math.exp(worst):.2f}x): the spike is shared, not one rank's data or device"
                ),
            )
        named = named[np.argsort(-d[named], kind="stable")]
        return named, d[named], ""

    def push(self, ranks: RankView | None) -> None:
        if ranks is None or not len(ranks):
            return
        d, counts = ranks.peer_deviation("loss")
        spread = np.abs(d[counts >= 2])
        spread = spread[np.isfinite(spread)]
        if len(spread):
            self._spread.push(fast_median(spread))
