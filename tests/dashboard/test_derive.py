"""Derived quantities on small hand-computed cases."""

from __future__ import annotations

import math
from dataclasses import replace

import pandas as pd
import pytest

from trainvitals.dashboard import derive
from trainvitals.dashboard.client import RunSummary


def grid(rows: list[tuple[int, int, float | None]]) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=["step", "rank", "value"]).astype({"value": "float64"})


def test_tokens_per_joule_is_throughput_over_power_and_ignores_zero_power() -> None:
    ratio = derive.tokens_per_joule(pd.Series([1000.0, 1000.0]), pd.Series([500.0, 0.0]))
    assert ratio[0] == 2.0
    assert math.isnan(ratio[1])


def test_progress_goodput_and_time_to_target() -> None:
    # 100 steps in 200 s of wall time at a median of 1.5 s per step: 150 s were steps.
    run = RunSummary(
        "r", started_unix_s=1000.0, last_time_unix_s=1200.0, last_step=99, token_target=400_000
    )
    p = derive.progress(run, first_step=0, median_step_time_s=1.5, mean_tokens=1000.0)
    assert p.tokens_done == 100_000
    assert p.wall_s == 200.0
    assert p.goodput_ratio == pytest.approx(0.75)
    # 300,000 tokens to go at 100,000 tokens per 200 s.
    assert p.eta_s == pytest.approx(600.0)


def test_progress_caps_goodput_and_says_reached_and_unknown() -> None:
    # 10 steps at a median of 2 s cannot fit in 10 s of wall time: an estimation error.
    run = RunSummary("r", started_unix_s=1.0, last_time_unix_s=11.0, last_step=9, token_target=5)
    reached = derive.progress(run, first_step=0, median_step_time_s=2.0, mean_tokens=1.0)
    assert reached.goodput_ratio == 1.0
    assert reached.eta_s == 0.0
    no_start = derive.progress(replace(run, started_unix_s=None), 0, 2.0, 1.0)
    assert math.isnan(no_start.goodput_ratio)
    assert math.isnan(no_start.eta_s)


def test_rank_costs_rank_the_straggler_first_with_its_excess() -> None:
    # Rank 2 is 0.5 s over the median rank in both buckets of 10 steps.
    means = grid([(0, 0, 1.0), (0, 1, 1.0), (0, 2, 1.5), (10, 0, 1.0), (10, 1, 1.0), (10, 2, 1.5)])
    costs = derive.rank_costs(means, bucket_steps=10)
    assert costs["rank"].tolist() == [2, 0, 1]
    assert costs["behind_s"].tolist() == [10.0, 0.0, 0.0]
    assert costs["mean_s"][0] == 1.5


def test_fingerprints_flag_the_rank_that_differs_and_buckets_without_majority() -> None:
    cells = [
        (0, 0, 7.0), (0, 1, 7.0), (0, 2, 7.0),  # all agree
        (5, 0, 9.0), (5, 1, 9.0), (5, 2, 4.0),  # rank 2 differs
        (10, 0, 1.0), (10, 1, 2.0),  # two ranks, two values: nobody to blame
        (15, 0, None), (15, 1, None),  # no canary step in this bucket
    ]  # fmt: skip
    status = derive.fingerprint_agreement(grid(cells)).set_index(["step", "rank"])["status"]
    assert status[0].eq(derive.AGREES).all()
    assert status[5].tolist() == [derive.AGREES, derive.AGREES, derive.DIFFERS]
    assert status[10].eq(derive.SPLIT).all()
    assert 15 not in status.index.get_level_values("step")


def test_first_jump_finds_the_earliest_layer_ten_times_its_median() -> None:
    # Layer b jumps at step 3, one step before layer a; both are 1.0 the rest of the time.
    a = [1.0, 1.0, 1.0, 1.0, 30.0, 1.0, 1.0]
    b = [1.0, 1.0, 1.0, 50.0, 80.0, 1.0, 1.0]
    layers = pd.DataFrame(
        {
            "step": list(range(7)) * 2,
            "layer": [0] * 7 + [1] * 7,
            "layer_name": ["a"] * 7 + ["b"] * 7,
            "value": a + b,
        }
    )
    jump = derive.first_jump(layers)
    assert (jump["step"], jump["layer_name"]) == (3, "b")
    assert derive.first_jump(layers.assign(value=1.0)) is None


def test_first_jump_counts_a_non_finite_cell() -> None:
    layers = pd.DataFrame(
        {"step": [0, 1, 2], "layer": [0, 0, 0], "layer_name": ["a"] * 3, "value": [1, None, 1]}
    ).astype({"value": "float64"})
    assert derive.first_jump(layers)["step"] == 1


def test_first_alert_after_each_fault_and_its_delay() -> None:
    faults = pd.DataFrame({"step": [80, 150, 200], "rank": [1, 2, -1], "kind": ["f"] * 3})
    alerts = pd.DataFrame({"step": [49, 85, 150], "kind": ["straggler", "straggler", "sdc"]})
    matched = derive.first_alert_after(faults, alerts.astype({"step": "Int64"}))
    assert matched["first_alert"].tolist()[:2] == ["straggler", "sdc"]
    assert matched["delay_steps"].tolist()[:2] == [5, 0]
    assert pd.isna(matched["first_alert"][2])  # nothing fired after step 200
