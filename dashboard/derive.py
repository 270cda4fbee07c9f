"""Quantities the dashboard derives from the collector's series: pure functions, no I/O.

The collector serves measurements. What is computed from them here is shown as derived,
and each function says what it counts and what it assumes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd

from trainvitals.dashboard.client import RunSummary

J_PER_KWH = 3.6e6
# A layer's value this many times its median over the window marks where a spike starts:
# one decade, one step of the heatmaps' log colour scale.
JUMP_RATIO = 10.0


def tokens_per_joule(tokens_per_s: pd.Series, power_w: pd.Series) -> pd.Series:
    """Energy efficiency: (tokens/s) / W = tokens/J, since a watt is a joule per second."""
    return tokens_per_s / power_w.where(power_w > 0)


@dataclass(frozen=True)
class Progress:
    """Where the run stands. NaN where the run did not send what a figure needs."""

    tokens_done: float  # estimated: (last step + 1) x mean tokens per logged step
    wall_s: float  # from the run's start to its latest logged step
    goodput_ratio: float
    eta_s: float  # to the token target; 0 once reached


def progress(
    run: RunSummary, first_step: int, median_step_time_s: float, mean_tokens: float
) -> Progress:
    """Tokens so far, goodput and time to the token target, from whole-run figures.

    Goodput (an estimate) is the share of wall time the run would have needed had every
    step taken the median step time: steps since the first logged one x median step time
    / wall time since the run started. It counts as lost what keeps steps from their usual
    pace: start-up, restarts (steps done again count once), checkpoints, stalls and slow
    steps. It is capped at 1. The time to the token target assumes the run keeps its pace
    so far, lost time included: tokens done in this wall time / wall time. Tokens per
    logged step stand for the steps between logged steps.
    """
    tokens_done = (run.last_step + 1) * mean_tokens
    start = run.started_unix_s
    wall_s = run.last_time_unix_s - start if start and run.last_time_unix_s else math.nan
    if not wall_s > 0:
        return Progress(tokens_done, math.nan, math.nan, math.nan)
    steps_seen = run.last_step - first_step + 1
    goodput = min(1.0, steps_seen * median_step_time_s / wall_s)
    eta_s = math.nan
    if run.token_target:
        tokens_per_wall_s = steps_seen * mean_tokens / wall_s
        eta_s = max(0.0, run.token_target - tokens_done) / tokens_per_wall_s
    return Progress(tokens_done, wall_s, goodput, eta_s)


def rank_costs(means: pd.DataFrame, bucket_steps: int) -> pd.DataFrame:
    """Per rank: seconds behind the median rank over the window, slowest rank first.

    `means` is a step x rank grid (step, rank, value) of bucket means of a per-rank time.
    A synchronous step ends when its slowest rank does, so a rank's excess over the
    median rank is time the whole job waits for it: what that rank costs the job were it
    the only slow one (two ranks slow at the same step do not add up). A bucket mean
    stands for every step of its bucket, logged or not.
    """
    median = means.groupby("step")["value"].transform("median")
    behind = (means["value"] - median).clip(lower=0) * bucket_steps
    out = (
        means.assign(behind_s=behind)
        .groupby("rank", as_index=False)
        .agg(behind_s=("behind_s", "sum"), mean_s=("value", "mean"))
    )
    return out.sort_values(["behind_s", "rank"], ascending=[False, True], ignore_index=True)


AGREES, DIFFERS, SPLIT = "agrees", "differs from the majority", "no majority"


def fingerprint_agreement(grid: pd.DataFrame) -> pd.DataFrame:
    """Status of each (bucket, rank) canary fingerprint against the bucket's majority.

    `grid` holds bucket means of the fingerprints (step, rank, value); null where a bucket
    has no canary step. Healthy ranks hash the same results, so their means are equal to
    the bit; a rank whose mean differs had a different fingerprint at a canary step of
    the bucket (or missed one). Where no value is held by more than half of the ranks,
    nobody can be blamed: the bucket is SPLIT.
    """
    canary = grid.dropna(subset=["value"])
    counts = canary.groupby(["step", "value"]).size().rename("n").reset_index()
    ranks = canary.groupby("step").size().rename("ranks")
    top = counts.sort_values("n").groupby("step").tail(1).set_index("step").join(ranks)
    majority = top["value"].where(top["n"] * 2 > top["ranks"])
    expected = canary["step"].map(majority)
    status = expected.isna().map({True: SPLIT, False: DIFFERS})
    status = status.mask(canary["value"] == expected, AGREES)
    return canary.assign(status=status.to_numpy())


def first_jump(layers: pd.DataFrame) -> pd.Series | None:
    """The earliest cell at least JUMP_RATIO x its layer's median over the window, or null.

    A null cell is a non-finite value of a layer that reported finite ones elsewhere.
    Ties on the step go to the layer nearer the input. None when no cell jumps.
    """
    median = layers.groupby("layer")["value"].transform("median")
    jumped = (layers["value"] >= JUMP_RATIO * median) | (layers["value"].isna() & median.notna())
    hits = layers.assign(median=median)[jumped & (median > 0)]
    if hits.empty:
        return None
    return hits.sort_values(["step", "layer"]).iloc[0]


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
