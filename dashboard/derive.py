"""Quantities the dashboard derives from the collector's series: pure functions, no I/O.

The collector serves measurements. What is computed from them here is shown as derived,
and each function says what it counts and what it assumes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import pandas as pd

from trainvitals.analyzer.replica import outvoted
from trainvitals.analyzer.straggler import (
    RankScores,
    StragglerSettings,
    arrival_excess,
    excess,
    in_bursts,
    kept_waiting,
    rank_scores,
    share_excess,
    sigma_of,
    step_spread,
    sync_time_s,
)
from trainvitals.dashboard.client import RunSummary

J_PER_KWH = 3.6e6
BYTES_PER_GB = 1e9
# A layer's value this many times its median over the window marks where a spike starts:
# one decade, one step of the heatmaps' log colour scale.
JUMP_RATIO = 10.0


def tokens_per_joule(tokens_per_s: pd.Series, power_w: pd.Series) -> pd.Series:
    """Energy efficiency: (tokens/s) / W = tokens/J, since a watt is a joule per second."""
    return tokens_per_s / power_w.where(power_w > 0)


def continued_energy_j(energy_j: pd.Series, earlier_j: pd.Series | None = None) -> pd.Series:
    """The job's energy (J) since the run started, continued across restarts.

    Hooks that count `energy_j` from 0 again when a run resumes leave the series falling
    at each restart. A reading below the previous one is taken as such a restart: the
    total goes on from the previous reading (the energy between that reading and the
    restart is not counted). A bucket mean that mixes readings from before and after a
    restart can fall once more at the next bucket: a fall right after a fall is taken as
    the same restart, which leaves the total short by about a bucket's energy.
    `earlier_j` are the readings before these, in step order (bucket means of the run
    before a window will do), so that restarts before a window count too. Null readings
    stay null.
    """
    earlier = pd.Series(dtype="float64") if earlier_j is None else earlier_j
    joined = pd.concat([earlier, energy_j], ignore_index=True)
    readings = joined.dropna()
    previous = readings.shift()
    fell = readings < previous
    restarted = fell & ~fell.shift(fill_value=False)
    offset_j = previous.where(restarted, 0.0).cumsum()
    total_j = (readings + offset_j).reindex(joined.index)
    return total_j.iloc[len(earlier) :].set_axis(energy_j.index)


@dataclass(frozen=True)
class EnergySoFar:
    """The run's energy figures; NaN where it has too few energy readings."""

    used_j: float  # since the run started, at its latest reading
    tokens_per_j: float  # tokens / energy between the first and the latest reading


def energy_so_far(steps: pd.DataFrame, latest_energy_j: float) -> EnergySoFar:
    """Energy used so far, and tokens per joule with tokens and energy over the same span.

    `steps` holds the whole run (step, tokens, energy_j), bucket means in step order, and
    `latest_energy_j` the latest step's raw reading. Tokens per joule = tokens trained
    between the first and the last energy reading / energy used between them: energy
    counted since a restart over tokens counted since step 0 would mix two spans. Tokens
    per logged step stand for the steps between logged steps.
    """
    total_j = continued_energy_j(steps["energy_j"])
    read = steps.assign(total_j=total_j).dropna(subset=["total_j"])
    if read.empty:
        return EnergySoFar(math.nan, math.nan)
    first, last = read.iloc[0], read.iloc[-1]
    used_j = last.total_j
    if not math.isnan(latest_energy_j):
        # The raw reading, where the last bucket holds a mean, plus the energy that
        # restarts took off the counter.
        used_j = latest_energy_j + (last.total_j - last.energy_j)
    span_j = last.total_j - first.total_j
    tokens = read["tokens"].mean() * (last.step - first.step)
    return EnergySoFar(used_j, tokens / span_j if span_j > 0 else math.nan)


@dataclass(frozen=True)
class Progress:
    """Where the run stands. NaN where the run did not send what a figure needs.

    Goodput is not here: the dashboard shows the analyzer's (analyzer/goodput.py, served
    by the collector), the figure `trainvitals replay` prints, so a run has one goodput.
    """

    tokens_done: float  # estimated: (last step + 1) x mean tokens per logged step
    wall_s: float  # from the run's start to its latest logged step
    eta_s: float  # to the token target; 0 once reached


def progress(run: RunSummary, first_step: int, mean_tokens: float) -> Progress:
    """Tokens so far and time to the token target, from whole-run figures.

    The time to the token target assumes the run keeps its pace so far, lost time
    included: tokens done in this wall time / wall time. Tokens per logged step stand for
    the steps between logged steps.
    """
    tokens_done = (run.last_step + 1) * mean_tokens
    start = run.started_unix_s
    wall_s = run.last_time_unix_s - start if start and run.last_time_unix_s else math.nan
    if not wall_s > 0:
        return Progress(tokens_done, math.nan, math.nan)
    steps_seen = run.last_step - first_step + 1
    eta_s = math.nan
    if run.token_target:
        tokens_per_wall_s = steps_seen * mean_tokens / wall_s
        eta_s = max(0.0, run.token_target - tokens_done) / tokens_per_wall_s
    return Progress(tokens_done, wall_s, eta_s)


COMPUTE, ARRIVAL, DATA, STOPPED = "compute time", "arrival", "data wait", "stopped time"
BOTH = f"{COMPUTE} and {ARRIVAL}"


def rank_costs(
    means: pd.DataFrame,
    bucket_steps: int,
    waits: pd.DataFrame | None = None,
    step_times: pd.DataFrame | None = None,
    tp: int = 1,
    settings: StragglerSettings | None = None,
    stopped: pd.DataFrame | None = None,
    collectives: tuple[pd.DataFrame, ...] = (),
    data: pd.DataFrame | None = None,
) -> pd.DataFrame:
    """Per rank, slowest first as the straggler detector judges them: `straggler` (the
    detector's judgement over the window), `named_by` (the signals that named it, COMPUTE,
    ARRIVAL, DATA, STOPPED joined by "and", empty for the others), `slower` (median excess
    of its time over the median rank's, a fraction), `late` (median lateness at the step's
    synchronisation points, a fraction of the step), `data` and `stopped` (median time
    waiting for data, and stopped, beyond the median rank's, fractions of the step),
    `behind_s` (seconds behind the median rank, summed) and `mean_s`.

    `means`, `waits`, `step_times`, `data` and `stopped` are step x rank grids (step, rank,
    value) of bucket means of a per-rank time, its wait at the step's end, its step time,
    its wait for data and the time its process was stopped (CPU ranks); `collectives` the
    same of each kind of
    collective's time, which with the waits tell when it arrived (`sync_time_s`). Each
    bucket is a step to the detector's own functions (analyzer.straggler): per signal the bar is
    the window's rank-to-rank spread and a straggler clears it in most buckets; slow by
    its time, a rank must also have arrived last (least wait) often enough (`tp`: the
    run's tensor-parallel degree, for its data-parallel peers). Without waits only the
    time is judged, unconfirmed. Others are ordered by their larger excess over its bar.
    A synchronous step ends when its slowest rank does, so a rank's time beyond the median
    rank's is time the whole job waits for it: what that rank costs the job were it the
    only slow one. Each bucket mean stands for the steps `steps_covered` gives it, so the
    sum is the same whatever the bucket width and the logging interval.
    """
    settings = settings or StragglerSettings()
    grid = means.pivot_table(index="step", columns="rank", values="value", aggfunc="mean")
    gaps = steps_covered(means["step"], bucket_steps)
    # The detector's window in buckets: persist_steps steps (restless_persist_steps in a
    # restless cohort), min_logged_steps at least.
    step_gap = gaps.median() if len(gaps) else bucket_steps

    wait_s, step_s, data_s, stops = (_on_grid(f, grid) for f in (waits, step_times, data, stopped))
    # Per bucket, the step the arrival and stopped excesses are fractions of.
    with np.errstate(all="ignore"):  # a bucket without step times: NaN, no excess
        step_median_s = np.nan if step_s is None else np.nanmedian(step_s, axis=1)
    sync_s = None
    if wait_s is not None:
        timed = (_on_grid(f, grid) for f in collectives)
        sync_s = sync_time_s(wait_s, tuple(t for t in timed if t is not None))

    def judged_over(steps: int) -> _Judged:
        k = max(settings.min_logged_steps, math.ceil(steps / step_gap))
        judged = _judge(grid, wait_s, sync_s, step_median_s, k, tp, settings)
        if step_s is None:
            return judged
        if data_s is not None:
            judged = _judge_share(judged, "data", data_s, step_median_s, k, settings.for_data())
        if stops is not None:
            judged = _judge_share(judged, "stop", stops, step_median_s, k, settings.for_stops())
        return judged

    judged = judged_over(settings.persist_steps)
    window_steps = settings.window_steps(judged.burst_share)
    if window_steps > settings.persist_steps:
        judged = judged_over(window_steps)
    median = means.groupby("step")["value"].transform("median")
    covered = means["step"].map(gaps)
    behind = (means["value"] - median).clip(lower=0) * covered
    totals = (
        means.assign(behind_s=behind)
        .groupby("rank")
        .agg(behind_s=("behind_s", "sum"), mean_s=("value", "mean"))
        .reindex(grid.columns)
    )
    signals = (
        (judged.by_time, COMPUTE), (judged.by_arrival, ARRIVAL), (judged.by_data, DATA),
        (judged.by_stop, STOPPED),
    )  # fmt: skip
    straggler = judged.by_time | judged.by_arrival | judged.by_data | judged.by_stop
    named_by = [" and ".join(name for by, name in signals if by[i]) for i in range(len(straggler))]
    out = pd.DataFrame(
        {
            "rank": grid.columns.to_numpy(),
            "straggler": straggler,
            "named_by": named_by,
            "slower": np.expm1(judged.time_excess),
            "late": judged.lateness,
            "data": judged.data,
            "stopped": judged.stop,
            "behind_s": totals["behind_s"].to_numpy(),
            "mean_s": totals["mean_s"].to_numpy(),
        }
    )
    order = np.lexsort((-np.nan_to_num(judged.over_bar, nan=-np.inf), ~straggler))
    return out.iloc[order].reset_index(drop=True)


@dataclass(frozen=True)
class _Judged:
    """Per rank of a grid, the straggler detector's signals over the window."""

    by_time: np.ndarray  # bool: named by its time (confirmed by arriving last)
    by_arrival: np.ndarray  # bool: named by its lateness at the step's end
    time_excess: np.ndarray  # median log ratio of its time over the median rank's
    lateness: np.ndarray  # median lateness, a fraction of the step (NaN without waits)
    over_bar: np.ndarray  # the largest of the signals' medians, each over its signal's bar
    burst_share: float  # share of the other ranks' buckets in bursts (`in_bursts`)
    by_data: np.ndarray  # bool: named by its wait for data (all False without it)
    data: np.ndarray  # median wait for data beyond the median rank's, a fraction of the step
    by_stop: np.ndarray  # bool: named by its time stopped (all False without it)
    stop: np.ndarray  # median time stopped beyond the median rank's, a fraction of the step


def _judge(
    grid: pd.DataFrame,
    waits: np.ndarray | None,
    syncs: np.ndarray | None,
    step_median_s: np.ndarray | float,
    k: int,
    tp: int,
    s: StragglerSettings,
) -> _Judged:
    """Both signals of `grid` (steps x ranks of a per-rank time), with `waits` (at the
    step's end: who arrived last) and `syncs` (`sync_time_s`: how late) on the same cells
    (None where not reported), each bucket's median step `step_median_s` (NaN: none),
    judged over windows of `k` buckets. Without waits only the time is judged, unconfirmed."""
    ranks = grid.columns.to_numpy()
    x = excess(grid.to_numpy(dtype="float64"))

    def confirmed(rows: slice, columns: np.ndarray) -> np.ndarray:
        assert waits is not None
        return kept_waiting(waits[rows], columns, ranks, tp, s)

    by_time, time_scores = _slow_in_a_window(x, k, s, None if waits is None else confirmed)
    over_bar = time_scores.median() / time_scores.bar
    bursts = in_bursts(x, time_scores.bar)
    if waits is None:
        nothing = np.zeros(len(ranks), bool)
        lateness = np.full(len(ranks), np.nan)
        share = _burst_share(bursts, by_time)
        return _Judged(
            by_time, nothing, time_scores.median(), lateness, over_bar, share,
            nothing, lateness, nothing, lateness,
        )  # fmt: skip
    late_x = arrival_excess(syncs, step_median_s)
    by_arrival, late_scores = _slow_in_a_window(late_x, k, s)
    lateness = late_scores.median()
    over_bar = np.fmax(over_bar, lateness / late_scores.bar)
    bursts |= in_bursts(late_x, late_scores.bar)
    share = _burst_share(bursts, by_time | by_arrival)
    nothing = np.zeros(len(ranks), bool)
    unknown = np.full(len(ranks), np.nan)
    return _Judged(
        by_time, by_arrival, time_scores.median(), lateness, over_bar, share,
        nothing, unknown, nothing, unknown,
    )  # fmt: skip


def _judge_share(
    judged: _Judged,
    name: str,
    times_s: np.ndarray,
    step_median_s: np.ndarray,
    k: int,
    s: StragglerSettings,
) -> _Judged:
    """`judged` with the data signal (`name` "data") or the stopped one ("stop"): each
    rank's time beyond the median rank's, as a fraction of the step (`times_s` on the
    grid's cells, `step_median_s` each bucket's median step), against its own bar (`s`:
    the settings `for_data` or `for_stops`), unconfirmed as in the detector."""
    x = share_excess(times_s, step_median_s)
    slow, scores = _slow_in_a_window(x, k, s)
    median = scores.median()
    over_bar = np.fmax(judged.over_bar, median / scores.bar)
    return replace(judged, **{f"by_{name}": slow, name: median, "over_bar": over_bar})


def _burst_share(bursts: np.ndarray, slow: np.ndarray) -> float:
    """Share of the buckets of the ranks not judged slow spent in bursts: the window's
    own measure of a restless cohort (the detector's counts the steps before its window)."""
    clean = bursts[:, ~slow]
    return float(clean.mean()) if clean.size else 0.0


def _slow_in_a_window(
    x: np.ndarray,
    k: int,
    s: StragglerSettings,
    confirm: Callable[[slice, np.ndarray], np.ndarray] | None = None,
) -> tuple[np.ndarray, RankScores]:
    """Per rank of `x` (buckets x ranks of one signal's excess): whether the detector's
    judgement, `rank_scores` over each run of `k` buckets (its persistence window), found
    it slow at some point of the window (`confirm(rows, columns)`: which of those columns
    also kept the others waiting); and the judgement over the whole window (its bar and
    median excess order the ranks). The bar is the whole window's spread."""
    sigma = sigma_of(step_spread(x))
    slow = np.zeros(x.shape[1], bool)
    k = min(k, len(x))
    for end in range(k, len(x) + 1):
        rows = slice(end - k, end)
        new = np.flatnonzero(rank_scores(x[rows], sigma, s).slow & ~slow)
        if confirm is not None and len(new):
            new = new[confirm(rows, new)]
        slow[new] = True
    return slow, rank_scores(x, sigma, s)


def _on_grid(frame: pd.DataFrame | None, grid: pd.DataFrame) -> np.ndarray | None:
    """`frame` (step, rank, value) as a steps x ranks array on `grid`'s steps and ranks;
    None where it holds no value."""
    if frame is None or not frame["value"].notna().any():
        return None
    wide = frame.pivot_table(index="step", columns="rank", values="value", aggfunc="mean")
    return wide.reindex(index=grid.index, columns=grid.columns).to_numpy(dtype="float64")


def steps_covered(bucket_starts: pd.Series, bucket_steps: int) -> pd.Series:
    """Steps each bucket holding logged rows stands for, indexed by the bucket's first step.

    A logged step stands for the steps since the previous logged one, and a bucket for the
    steps since the previous bucket holding a logged step: `bucket_steps` when every bucket
    holds one, the logging interval when buckets are narrower than it (the buckets in
    between hold nothing). The first bucket's predecessor is outside the window: it stands
    for the median gap of the others (`bucket_steps` if it is alone).
    """
    starts = pd.Series(sorted(bucket_starts.unique()), dtype="float64")
    gaps = starts.diff()
    gaps.iloc[:1] = gaps.median() if len(starts) > 1 else bucket_steps
    return pd.Series(gaps.to_numpy(), index=starts.astype("int64"))


def collective_bandwidth(
    bytes_per_step: pd.DataFrame, time_s_per_step: pd.DataFrame
) -> pd.DataFrame:
    """Per rank (step, rank, value): algorithm bandwidth in GB/s of one kind of collective.

    Both grids hold, per rank, a window mean (step, rank, value) of the bytes of the
    collectives per step and of the time they took per step. Their ratio is the bytes
    moved over the time spent, over the window's logged steps: nccl-tests' algorithm
    bandwidth. Null where the backend did not time the collectives.
    """
    key = ["step", "rank"]
    both = bytes_per_step.merge(time_s_per_step, on=key, how="left", suffixes=("_b", "_s"))
    seconds = both["value_s"].where(both["value_s"] > 0)
    return both.assign(value=both["value_b"] / seconds / BYTES_PER_GB)[[*key, "value"]]


AGREES, DIFFERS, SPLIT = "agrees", "differs from the majority", "no majority"


def fingerprint_agreement(grid: pd.DataFrame) -> pd.DataFrame:
    """Status of each (bucket, rank) canary fingerprint, by the SDC canary detector's vote.

    `grid` holds bucket means of the fingerprints (step, rank, value); null where a bucket
    has no canary step. Each bucket's ranks vote as the detector's ranks do at a canary
    step (analyzer.sdc.CanaryDetector), counted by the same function,
    analyzer.replica.outvoted: a rank outvoted by a strict majority DIFFERS; where no
    value is held by more than half of the ranks, nobody can be blamed: the bucket is
    SPLIT. Healthy ranks hash the same results, so their means are equal to the bit; a
    rank whose mean differs had a different fingerprint at a canary step of the bucket
    (or missed one).
    """
    canary = grid.dropna(subset=["value"])
    buckets = canary["step"].to_numpy(dtype="float64")
    wrong, split = outvoted(canary["value"].to_numpy(dtype="float64"), buckets)
    status = np.full(len(canary), AGREES, dtype=object)
    status[np.isin(buckets, split)] = SPLIT
    status[wrong] = DIFFERS
    return canary.assign(status=status)


def first_jump(layers: pd.DataFrame) -> pd.Series | None:
    """The earliest cell at least JUMP_RATIO x its layer's median over the window, or
    non-finite; None when no cell is.

    `layers` holds step, layer, layer_name, value and nonfinite, as the client's
    `layers()` gives them: a NaN value that is not `nonfinite` was never measured and is
    no jump. Ties on the step go to the layer nearer the input.
    """
    nonfinite = layers["nonfinite"]
    median = layers.groupby("layer")["value"].transform("median")
    jumped = ((layers["value"] >= JUMP_RATIO * median) & (median > 0)) | nonfinite
    hits = layers.assign(median=median)[jumped]
    if hits.empty:
        return None
    return hits.sort_values(["step", "layer"]).iloc[0]


def intermittent_ranks(alerts: pd.DataFrame, first: int, last: int | None) -> dict[int, float]:
    """Ranks an `intermittent_straggler` episode named that overlaps steps first..last
    (None: to the latest), each with the largest share of the logged time it held the job
    up (the alert's value). The detector judges single steps, which the Ranks view's
    bucket means average away: its alerts are the only faithful source."""
    rows = alerts[(alerts["kind"] == "intermittent_straggler") & alerts["rank"].notna()]
    end = float("inf") if last is None else last
    named: dict[int, float] = {}
    for rank, episodes in rows.sort_values("step").groupby("rank"):
        raised: tuple[int, float] | None = None
        for row in episodes.itertuples():
            if row.severity != "resolved":
                raised = (int(row.step), float(row.value))
                continue
            if raised is not None and raised[0] <= end and row.step >= first:
                named[int(rank)] = max(named.get(int(rank), 0.0), raised[1])
            raised = None
        if raised is not None and raised[0] <= end:  # still open
            named[int(rank)] = max(named.get(int(rank), 0.0), raised[1])
    return named


def first_alert_after(faults: pd.DataFrame, alerts: pd.DataFrame) -> pd.DataFrame:
    """Each injected fault with the first alert at or after its step, and the delay in steps.

    Any kind of alert counts: this is what an on-call person would have seen first, not a
    scoring of one detector (bench/ scores detectors against labelled scenarios).
    """
    found = alerts[["step", "kind"]].rename(columns={"kind": "first_alert"})
    found = found.assign(alert_step=found["step"]).astype({"step": "int64"})
    matched = pd.merge_asof(
        faults.sort_values("step"), found.sort_values("step"), on="step", direction="forward"
    )
    return matched.assign(delay_steps=matched["alert_step"] - matched["step"])


def smoothed(values: pd.Series, weight: float) -> pd.Series:
    """Exponential moving average as TensorBoard's smoothing slider computes it:
    s_t = weight x s_{t-1} + (1 - weight) x v_t, debiased at the start (pandas'
    `adjust=True`), so the first points are not pulled toward zero. `weight` 0 returns the
    values; nulls are skipped, not spread."""
    if weight <= 0:
        return values
    return values.ewm(alpha=1 - weight, adjust=True, ignore_na=True).mean().where(values.notna())
