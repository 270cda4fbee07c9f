"""Streaming detectors of non-finite values and loss spikes; helpers every detector uses.

Each detector sees one logged step at a time, in step order, through `observe(step)`, and
returns the alerts that step raises. The same objects run live in the collector and over a
stored run, which is what makes a replay reproduce the live alerts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .alerts import Alert
from .attribution import MAD_TO_SIGMA, LayerHistory, RankLossHistory
from .rolling import RollingWindow, median_of_sorted
from .views import LayerView, RankView, StepView

__all__ = ["LayerView", "LossSpikeDetector", "NonFiniteDetector", "RankView", "StepView"]


def data_query(run_id: str, table: str, metric: str | None, start: int, end: int) -> str:
    """Where the evidence behind an alert can be read: a path of the collector's query API
    (collector/query.py), over steps `start`..`end`."""
    what = f"metric={metric}&" if metric else ""
    return f"/api/v1/runs/{run_id}/{table}?{what}start={max(0, start)}&end={end}"


def name_ranks(ranks: list[int], limit: int = 8) -> str:
    """'rank 3', 'ranks 3, 7', 'ranks 1, 2, ... and 40 more'."""
    shown = ", ".join(map(str, ranks[:limit]))
    more = f" and {len(ranks) - limit} more" if len(ranks) > limit else ""
    return f"rank{'s' if len(ranks) > 1 else ''} {shown}{more}"


@dataclass
class NonFiniteDetector:
    """A NaN or infinite value: training has already gone wrong. Names where it started.

    Fires on a non-finite loss or global gradient norm; on the hooks' non-finite counters,
    of the logged step (steps.nonfinite_count, layers.nonfinite_count and
    act_nonfinite_count) and of every step since the previous logged one
    (steps.nonfinite_steps, layers.act_nonfinite_steps); on a reported non-finite layer
    statistic (act_rms, grad_norm, act_max_abs, which is a max over those steps too, and
    param_norm); and on a rank's non-finite local loss or local gradient norm. The culprit
    layer is the lowest layer index (forward order) whose *activations* went non-finite,
    else the lowest whose gradients did, else whose parameters did: a NaN born in layer
    k's forward reaches every later layer's output, and every gradient, within the same
    step. The culprit rank is the rank whose
    local loss went non-finite while others' did not (with tensor parallelism its tp peers
    share its loss and are listed too); when every rank is hit, nobody is named.
    One alert per episode: quiet until a step is finite again.
    """

    kind: str = "nonfinite"
    _in_episode: bool = False

    def observe(self, s: StepView) -> list[Alert]:
        bad = [
            name
            for name, v in (("loss", s.loss), ("grad_norm", s.grad_norm))
            if v is not None and not math.isfinite(v)  # None: not reported
        ]
        if s.nonfinite_count > 0:  # NaN (not reported) compares False
            bad.append(f"{s.nonfinite_count:.0f} values counted by the hooks")
        if s.nonfinite_steps > 0:  # unlogged steps too: a NaN the loop skipped over
            bad.append(
                f"{s.nonfinite_steps:.0f} step(s) since the previous logged one held a NaN/inf "
                "loss or output"
            )
        layer, layer_what, column = _first_nonfinite_layer(s.layers)
        rank_bad = np.empty(0, dtype=np.int64)
        if s.ranks is not None and len(s.ranks):
            hit = ~np.isfinite(s.ranks.loss) | s.ranks.grad_norm_local_nonfinite
            rank_bad = s.ranks.rank[hit]
            if len(rank_bad):
                bad.append(f"local loss or gradient of {name_ranks(rank_bad.tolist())}")
        if not bad and layer is None:
            self._in_episode = False
            return []
        if self._in_episode:
            return []
        self._in_episode = True
        rank = None
        if len(rank_bad) and len(rank_bad) < len(s.ranks):
            rank = int(rank_bad[0])
            who = f"; it started on {name_ranks(rank_bad.tolist())} (the others stayed finite)"
        elif len(rank_bad):
            who = "; every rank is hit, so no single rank is named"
        else:
            who = ""
        where = (
            ""
            if layer is None
            else (f"; first non-finite layer in forward order: {layer} ({layer_what})")
        )
        what = "; ".join(bad) or "in layer statistics"
        return [
            Alert.at(
                s,
                kind=self.kind,
                severity="critical",
                message=(
                    f"non-finite values at step {s.step}: {what}{where}{who}. Data: "
                    + data_query(s.run_id, "layers", column, s.step, s.step)
                ),
                value=s.loss if "loss" in bad else s.grad_norm if "grad_norm" in bad else None,
                rank=rank,
                layer=layer,
            )
        ]


def _first_nonfinite_layer(layers: LayerView | None) -> tuple[int | None, str, str]:
    """(lowest layer whose activations, else gradients, else parameters went non-finite,
    which of them, the column that shows it); (None, "", default column) when none did."""
    default = (None, "", "act_nonfinite_count")
    if layers is None or not len(layers.layer):
        return default
    # act_rms and grad_norm are required columns: NaN there is a value, not a gap. In the
    # optional act_max_abs and param_norm NaN may mean "not reported": their marks say
    # which values were reported (an infinity is never a gap). NaN counts compare False.
    with np.errstate(invalid="ignore"):
        signals = (
            ("activations", "act_nonfinite_count", layers.act_nonfinite_count > 0),
            ("activations", "act_nonfinite_steps", layers.act_nonfinite_steps > 0),
            ("activations", "act_rms", ~np.isfinite(layers.act_rms)),
            (
                "activations",
                "act_max_abs",
                layers.act_max_abs_nonfinite | np.isinf(layers.act_max_abs),
            ),
            ("gradients", "nonfinite_count", layers.nonfinite_count > 0),
            ("gradients", "grad_norm", ~np.isfinite(layers.grad_norm)),
            (
                "parameters",
                "param_norm",
                layers.param_norm_nonfinite | np.isinf(layers.param_norm),
            ),
        )
    for what in ("activations", "gradients", "parameters"):
        firsts = [
            (int(where[0]), column)
            for kind, column, hit in signals
            if kind == what and len(where := np.flatnonzero(hit))
        ]
        if firsts:  # layers are in ascending order: the lowest index is the first layer
            i, column = min(firsts, key=lambda first: first[0])
            return int(layers.layer[i]), what, column
    return default


@dataclass
class LossSpikeDetector:
    """A loss far above its recent robust baseline.

    Baseline (the level): median of log(loss) over the last `level_window` finite logged
    steps. A median over the whole `window` lags a falling loss by half the window: with
    log_every=10 that is 250 steps, and at step 410 of a simulated run it stood at 7.80
    while the loss was 6.6, so a 1.39x spike looked like 1.18x and was missed. A short
    median follows the trend within a few logged steps and still ignores a one-step
    outlier. (Projecting the window's robust trend forward instead overshoots where a
    fast fall flattens out, and raised false alarms there.)
    Spread: the step-to-step noise, from the median absolute deviation (MAD) of the last
    `window` differences of log(loss), scaled by 1.4826 / sqrt(2) so that it estimates the
    standard deviation of Gaussian noise on each value (Rousseeuw & Croux, 1993);
    differences ignore the trend, so a loss falling fast early in training does not
    inflate the spread and hide a spike (the MAD of the values themselves would). Working
    in log space makes the test relative, so it holds as the loss falls by orders of
    magnitude. A step alarms when its log-loss exceeds the level by `z_threshold` spreads
    *and* the loss is at least `min_rise_ratio` above the level: the second guard keeps a
    near-zero MAD on a flat curve from turning noise into alerts. Needs `min_history`
    finite steps. One alert per episode: after an alarm the detector is quiet for
    `cooldown_steps`.

    After a spike the detector follows the episode against the baseline frozen at the
    spike: a loss back under baseline x (1 + min_rise_ratio) has recovered; one still above
    it `diverge_steps` later is diverging, which raises a critical `loss_diverging` alert.
    """

    window: int = 50
    level_window: int = 5
    min_history: int = 20
    z_threshold: float = 8.0
    min_rise_ratio: float = 0.2
    cooldown_steps: int = 50
    diverge_steps: int = 20
    kind: str = "loss_spike"
    layers: LayerHistory = field(default_factory=LayerHistory)
    ranks: RankLossHistory = field(default_factory=RankLossHistory)
    _level: RollingWindow = field(init=False, repr=False)  # last level_window log-losses
    _diffs: RollingWindow = field(init=False, repr=False)
    _history: int = 0  # finite losses seen
    _last_x: float | None = None
    _quiet_until: int = -1
    _episode: tuple[int, float] | None = None  # (spike step, baseline loss) while unresolved

    def __post_init__(self) -> None:
        if self.window < 3 or not 3 <= self.min_history <= self.window:
            raise ValueError("LossSpikeDetector: need window >= min_history >= 3")
        if not 1 <= self.level_window <= self.min_history:
            raise ValueError("LossSpikeDetector: need 1 <= level_window <= min_history")
        if self.z_threshold <= 0 or self.min_rise_ratio < 0:
            raise ValueError("LossSpikeDetector: z_threshold must be > 0, min_rise_ratio >= 0")
        self._level = RollingWindow(self.level_window)
        self._diffs = RollingWindow(self.window)

    def observe(self, s: StepView) -> list[Alert]:
        self.layers.push(s.step, s.layers)
        if s.loss is None or not (math.isfinite(s.loss) and s.loss > 0):
            self.ranks.push(s.ranks)
            return []  # non-finite losses are the NonFiniteDetector's
        x = math.log(s.loss)
        alerts = self._follow_episode(s)
        if self._history >= self.min_history and s.step > self._quiet_until:
            level = self._level.median()
            typical = self._diffs.median()
            mad = median_of_sorted(sorted(abs(d - typical) for d in self._diffs.values()))
            spread = MAD_TO_SIGMA * mad / math.sqrt(2) + 1e-12
            z = (x - level) / spread
            if z > self.z_threshold and x - level > math.log1p(self.min_rise_ratio):
                alerts.append(self._spike(s, math.exp(level), z))
        self._level.push(x)
        self._history += 1
        if self._last_x is not None:
            self._diffs.push(x - self._last_x)
        self._last_x = x
        self.ranks.push(s.ranks)
        return alerts

    def _spike(self, s: StepView, baseline: float, z: float) -> Alert:
        self._quiet_until = s.step + self.cooldown_steps
        self._episode = (s.step, baseline)
        size = f"({z:.1f} robust std devs)" if z < 1e3 else "(a flat baseline)"
        layer, stat, layer_part = self._layer_evidence(s)
        rank, rank_part = self._rank_evidence(s)
        parts = [
            f"loss {s.loss:.4g} at step {s.step} is {s.loss / baseline:.2f}x its recent "
            f"median {baseline:.4g} {size}",
            *filter(None, (layer_part, rank_part)),
        ]
        start = s.step - self.window
        queries = [data_query(s.run_id, "steps", None, start, s.step)]
        if stat is not None:
            queries.append(data_query(s.run_id, "layers", stat, start, s.step))
        if s.ranks is not None:
            queries.append(data_query(s.run_id, "ranks", "loss", s.step, s.step))
        return Alert.at(
            s,
            kind=self.kind,
            severity="warning",
            message="; ".join(parts) + ". Data: " + ", ".join(queries),
            value=s.loss,
            baseline=baseline,
            rank=rank,
            layer=layer,
        )

    def _layer_evidence(self, s: StepView) -> tuple[int | None, str | None, str]:
        """(layer that led the spike or None, its statistic, a sentence of evidence)."""
        verdict = self.layers.deviations()
        look = self.layers.lookback
        lead = verdict.leader
        if lead is not None:
            others = [d.describe() for d in verdict.first[1:3]]
            return (
                lead.layer,
                lead.stat,
                (
                    f"first to move: {lead.describe()}"
                    + (f"; with it {'; '.join(others)}" if others else "")
                    + f" ({verdict.n_deviated} layer statistics deviated in the last {look} "
                    "logged steps)"
                ),
            )
        if verdict.first:
            top = verdict.first[0]
            return (
                None,
                top.stat,
                (
                    f"{verdict.layers_together} of {verdict.n_layers} layers moved together at "
                    f"step {top.step} (largest: {top.describe()}): no single layer led, as with a "
                    "bad batch or a learning-rate jump"
                ),
            )
        if s.layers is None:
            return None, None, ""
        return (
            None,
            None,
            (f"no layer statistic deviated from its baseline in the last {look} logged steps"),
        )

    def _rank_evidence(self, s: StepView) -> tuple[int | None, str]:
        """(rank whose local loss made the spike or None, a sentence of evidence)."""
        named, d, why = self.ranks.culprits(s.ranks)
        if not len(named):
            return None, why
        ids = s.ranks.rank[named].tolist()
        each = ", ".join(
            f"rank {r} {math.exp(x):.2f}x" for r, x in zip(ids[:4], d[:4], strict=True)
        )
        more = f" and {len(ids) - 4} more" if len(ids) > 4 else ""
        return ids[0], (
            f"local loss above its data-parallel peers' median: {each}{more} (that rank's "
            "data or arithmetic produced the spike)"
        )

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
            Alert.at(
                s,
                kind="loss_diverging",
                severity="critical",
                message=(
                    f"loss has not recovered from the spike at step {spike_step}: "
                    f"{s.loss:.4g} at step {s.step} against {baseline:.4g} before it; "
                    "roll back to a checkpoint before the spike"
                ),
                value=s.loss,
                baseline=baseline,
            )
        ]
