"""Derived quantities on small hand-computed cases."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from tests.analyzer.test_straggler import _slowed
from trainvitals.analyzer.straggler import StragglerDetector
from trainvitals.analyzer.views import RankView, StepView
from trainvitals.dashboard import derive
from trainvitals.dashboard.client import RunSummary


def grid(rows: list[tuple[int, int, float | None]]) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=["step", "rank", "value"]).astype({"value": "float64"})


def test_tokens_per_joule_is_throughput_over_power_and_ignores_zero_power() -> None:
    ratio = derive.tokens_per_joule(pd.Series([1000.0, 1000.0]), pd.Series([500.0, 0.0]))
    assert ratio[0] == 2.0
    assert math.isnan(ratio[1])


def test_progress_and_time_to_target() -> None:
    # 100 steps in 200 s of wall time.
    run = RunSummary(
        "r", started_unix_s=1000.0, last_time_unix_s=1200.0, last_step=99, token_target=400_000
    )
    p = derive.progress(run, first_step=0, mean_tokens=1000.0)
    assert p.tokens_done == 100_000
    assert p.wall_s == 200.0
    # 300,000 tokens to go at 100,000 tokens per 200 s.
    assert p.eta_s == pytest.approx(600.0)


def test_progress_says_reached_and_unknown() -> None:
    run = RunSummary("r", started_unix_s=1.0, last_time_unix_s=11.0, last_step=9, token_target=5)
    reached = derive.progress(run, first_step=0, mean_tokens=1.0)
    assert reached.eta_s == 0.0
    no_start = derive.progress(replace(run, started_unix_s=None), 0, 1.0)
    assert math.isnan(no_start.eta_s)


def test_rank_costs_rank_the_straggler_first_with_its_excess() -> None:
    # Rank 2 is 0.5 s over the median rank in both buckets of 10 steps.
    means = grid([(0, 0, 1.0), (0, 1, 1.0), (0, 2, 1.5), (10, 0, 1.0), (10, 1, 1.0), (10, 2, 1.5)])
    costs = derive.rank_costs(means, bucket_steps=10)
    assert costs["rank"].tolist() == [2, 0, 1]
    assert costs["straggler"].tolist() == [True, False, False]
    assert costs["slower"][0] == pytest.approx(0.5)
    assert costs["behind_s"].tolist() == [10.0, 0.0, 0.0]
    assert costs["mean_s"][0] == 1.5


def _noisy_window(seed: int) -> np.ndarray:
    """40 buckets x 4 ranks of compute means: 2% noise; rank 1 costs the most in total
    (one bucket 10x slower), rank 3 is persistently 15% slower."""
    rng = np.random.default_rng(seed)
    compute = 0.1 * np.exp(0.02 * rng.standard_normal((40, 4)))
    compute[:, 3] *= 1.15
    compute[7, 1] *= 10
    return compute


def test_rank_costs_rank_as_the_straggler_detector_names() -> None:
    # The table and the detector judge with the same function: the rank the detector
    # names comes first, although another rank cost more in total (one very slow bucket).
    compute = _noisy_window(0)
    means = grid([(s, r, compute[s, r]) for s in range(40) for r in range(4)])
    costs = derive.rank_costs(means, bucket_steps=1)
    detector = StragglerDetector()
    alerts = [a for s in range(40) for a in detector.observe(_step_view(s, compute[s]))]
    assert [a.rank for a in alerts] == [3]
    assert costs["rank"][0] == 3 and costs["straggler"].tolist() == [True, False, False, False]
    assert costs["behind_s"].idxmax() != 0  # ranked by the detector's score, not by cost


def test_rank_costs_name_a_rank_late_by_its_arrival_alone() -> None:
    # An idle machine: 8 ranks compute alike (4% noise, inside the compute bar) and reach
    # the step's end within 1 ms, but rank 6, 15 ms (15% of a 100 ms step) later from
    # bucket 5: its compute time names nobody, its lateness does.
    rng = np.random.default_rng(1)
    compute = 0.1 * np.exp(0.04 * rng.standard_normal((60, 8)))
    arrival_s = rng.uniform(0.0, 0.001, (60, 8))
    arrival_s[5:, 6] += 0.015
    waits = arrival_s.max(axis=1, keepdims=True) - arrival_s
    step_s = np.full((60, 8), 0.1)
    cells = [(s, r) for s in range(60) for r in range(8)]
    frames = [grid([(s, r, v[s, r]) for s, r in cells]) for v in (compute, waits, step_s)]
    costs = derive.rank_costs(frames[0], 1, waits=frames[1], step_times=frames[2], tp=2)
    assert costs["rank"][0] == 6
    assert costs["straggler"].tolist() == [True] + [False] * 7
    assert costs["named_by"][0] == derive.ARRIVAL
    assert costs["late"][0] == pytest.approx(0.15, abs=0.01)
    # Its compute time alone does not single it out.
    assert not derive.rank_costs(frames[0], 1)["straggler"].any()


def test_rank_costs_name_a_rank_stopped_from_outside_by_its_stopped_time() -> None:
    # 4 CPU ranks compute alike and arrive together (the others wait for a stopped rank
    # inside the collectives); rank 2's process is stopped 12% of a step more from bucket
    # 10, the others ~1% (the stopped clock's noise). Only the stopped time names it.
    rng = np.random.default_rng(2)
    compute = 0.1 * np.exp(0.01 * rng.standard_normal((60, 4)))
    waits = np.full((60, 4), 0.01)
    step_s = np.full((60, 4), 0.1)
    stopped = 0.001 + 0.0005 * rng.standard_normal((60, 4))
    stopped[10:, 2] += 0.012
    cells = [(s, r) for s in range(60) for r in range(4)]
    frames = [grid([(s, r, v[s, r]) for s, r in cells]) for v in (compute, waits, step_s, stopped)]
    costs = derive.rank_costs(frames[0], 1, waits=frames[1], step_times=frames[2],
                              stopped=frames[3])  # fmt: skip
    assert costs["rank"][0] == 2
    assert costs["straggler"].tolist() == [True, False, False, False]
    assert costs["named_by"][0] == derive.STOPPED
    assert costs["stopped"][0] == pytest.approx(0.12, abs=0.01)
    blind = derive.rank_costs(frames[0], 1, waits=frames[1], step_times=frames[2])
    assert not blind["straggler"].any()


def test_rank_costs_name_a_rank_waiting_for_its_data_by_its_data_time() -> None:
    # 4 ranks compute alike and arrive together (the others wait for it in collectives
    # that are not timed); rank 3 waits 15 ms of a 100 ms step longer for its batches from
    # bucket 10, the others ~0.5 ms. Only the data time names it, as the detector does.
    rng = np.random.default_rng(3)
    compute = 0.1 * np.exp(0.01 * rng.standard_normal((60, 4)))
    waits = np.full((60, 4), 0.01)
    step_s = np.full((60, 4), 0.1)
    data = 0.0005 + 0.0002 * rng.standard_normal((60, 4))
    data[10:, 3] += 0.015
    cells = [(s, r) for s in range(60) for r in range(4)]
    frames = [grid([(s, r, v[s, r]) for s, r in cells]) for v in (compute, waits, step_s, data)]
    costs = derive.rank_costs(frames[0], 1, waits=frames[1], step_times=frames[2],
                              data=frames[3])  # fmt: skip
    assert costs["rank"][0] == 3
    assert costs["straggler"].tolist() == [True, False, False, False]
    assert costs["named_by"][0] == derive.DATA
    assert costs["data"][0] == pytest.approx(0.15, abs=0.01)
    blind = derive.rank_costs(frames[0], 1, waits=frames[1], step_times=frames[2])
    assert not blind["straggler"].any()


def test_rank_costs_name_a_rank_the_others_waited_for_in_the_collectives() -> None:
    # 4 ranks compute alike and wait alike at the step's end; from bucket 10 the others
    # spend 25 ms more of a 100 ms step in the all-gathers, waiting for rank 1 (held off the
    # CPU, as by a CPU quota). Only the collectives' times name it.
    rng = np.random.default_rng(3)
    compute = 0.02 * np.exp(0.01 * rng.standard_normal((60, 4)))
    waits = 0.002 + 0.0005 * rng.random((60, 4))
    gathers = 0.04 + 0.002 * rng.standard_normal((60, 4))
    gathers[10:] += 0.025
    gathers[10:, 1] -= 0.025
    scatters = np.full((60, 4), 0.01)
    step_s = np.full((60, 4), 0.1)
    cells = [(s, r) for s in range(60) for r in range(4)]
    frames = [grid([(s, r, v[s, r]) for s, r in cells])
              for v in (compute, waits, step_s, gathers, scatters)]  # fmt: skip
    costs = derive.rank_costs(frames[0], 1, waits=frames[1], step_times=frames[2],
                              collectives=(frames[3], frames[4]))  # fmt: skip
    assert costs["rank"][0] == 1
    assert costs["straggler"].tolist() == [True, False, False, False]
    assert costs["named_by"][0] == derive.ARRIVAL
    # 25 ms less than the others; the median of 4 is the mean of the two middle ones,
    # which the gathers' noise pulls down.
    assert costs["late"][0] == pytest.approx(0.23, abs=0.015)
    blind = derive.rank_costs(frames[0], 1, waits=frames[1], step_times=frames[2])
    assert not blind["straggler"].any()


RECORDED = Path(__file__).parents[1] / "analyzer" / "data"


@pytest.mark.parametrize(
    "name, n_ranks, tp, slowed",
    [
        ("idle16_8rank_straggler.csv", 8, 2, None),
        ("idle16_8rank_clean.csv", 8, 2, None),
        ("quiet_8rank_straggler.csv", 8, 2, None),
        ("loaded_clean_a.csv", 4, 1, None),
        ("loaded_clean_b.csv", 4, 1, None),
        # A restless cohort: a 30-step burst of rank 1 is no straggler, 15% from step 500 is.
        ("loaded_clean_a.csv", 4, 1, (1, 500, 530, 0.25)),
        ("loaded_clean_a.csv", 4, 1, (1, 500, 1000, 0.15)),
    ],
)
def test_rank_costs_name_the_ranks_the_detector_names_on_recorded_runs(
    name: str, n_ranks: int, tp: int, slowed: tuple[int, int, int, float] | None
) -> None:
    # Real CPU runs (tests/analyzer/test_straggler.py reads them the same way): each row a
    # step's compute_time_s then wait_time_s of each rank, then (where recorded) its
    # step_time_s. Every step a bucket, the whole run the window. `slowed`: (rank, first
    # step, end step, slowdown) spliced in as test_straggler's `_slowed` does.
    table = np.loadtxt(RECORDED / name, delimiter=",")
    if slowed is not None:
        table = _slowed(table, *slowed)
    compute, waits = table[:, :n_ranks], table[:, n_ranks : 2 * n_ranks]
    end = table[:, -1] if table.shape[1] > 2 * n_ranks else (compute + waits).max(axis=1)
    detector = StragglerDetector()
    named = set()
    for step in range(len(table)):
        ranks = RankView.of(tp=tp, compute_time_s=compute[step].tolist(),
                            wait_time_s=waits[step].tolist())  # fmt: skip
        view = StepView("r", step, float(step), 2.0, 1.0, step_time_s=end[step], ranks=ranks)
        named |= {a.rank for a in detector.observe(view) if a.kind == "straggler"}
    cells = [(s, r) for s in range(len(table)) for r in range(n_ranks)]
    step_s = np.repeat(end[:, None], n_ranks, axis=1)
    frames = [grid([(s, r, v[s, r]) for s, r in cells]) for v in (compute, waits, step_s)]
    costs = derive.rank_costs(frames[0], 1, waits=frames[1], step_times=frames[2], tp=tp)
    assert set(costs["rank"][costs["straggler"]]) == named
    if slowed is not None:
        assert named == ({1} if slowed[2] - slowed[1] > 60 else set())
    if named:
        assert costs["rank"][0] in named


def _step_view(step: int, compute: np.ndarray) -> StepView:
    end = float(compute.max())
    ranks = RankView.of(compute_time_s=compute.tolist(), wait_time_s=(end - compute).tolist())
    return StepView("r", step, float(step), 2.0, 1.0, step_time_s=end, ranks=ranks)


def logged_every(interval: int, bucket_steps: int, n_steps: int) -> pd.DataFrame:
    """Bucket means as the collector serves them for a run logged every `interval` steps:
    rank 1 is 0.5 s slower than ranks 0 and 2 at every step; buckets without a logged
    step are absent."""
    starts = sorted({s // bucket_steps * bucket_steps for s in range(0, n_steps, interval)})
    return grid([(s, r, 1.5 if r == 1 else 1.0) for s in starts for r in range(3)])


@pytest.mark.parametrize("bucket_steps", [1, 4, 10, 25])
def test_rank_costs_count_every_step_whatever_the_bucket_and_logging_interval(
    bucket_steps: int,
) -> None:
    # 1,000 steps logged every 10th: rank 1 costs 0.5 s x 1,000 steps. A bucket narrower
    # than the interval holds one logged step, which stands for the 10 steps since the
    # previous one (the bucket mean x bucket_steps counted 1 or 4 of them).
    costs = derive.rank_costs(logged_every(10, bucket_steps, 1000), bucket_steps)
    assert costs["rank"][0] == 1
    assert costs["behind_s"][0] == pytest.approx(500.0, rel=0.01)


def test_steps_covered_by_each_bucket() -> None:
    # Buckets of 4 steps, a row every 10th step: buckets 0, 8, 20, 28 hold one each.
    covered = derive.steps_covered(pd.Series([0, 8, 20, 28, 28]), bucket_steps=4)
    assert covered.to_dict() == {0: 8.0, 8: 8.0, 20: 12.0, 28: 8.0}  # 0: the others' median
    assert derive.steps_covered(pd.Series([5]), bucket_steps=4).to_dict() == {5: 4.0}


def test_energy_so_far_continues_across_a_restart_over_the_same_span_as_tokens() -> None:
    # 500 W, 1 s and 100 tokens a step, 40 steps; hooks of old restarted energy_j from 0
    # when the run resumed at step 20. The run used 40 x 500 J: 0.2 tokens per joule.
    energy_j = [500.0 * (s + 1 if s < 20 else s - 19) for s in range(40)]
    steps = pd.DataFrame({"step": range(40), "tokens": [100.0] * 40, "energy_j": energy_j})
    energy = derive.energy_so_far(steps, latest_energy_j=energy_j[-1])
    assert energy.used_j == 20_000.0
    assert energy.tokens_per_j == pytest.approx(0.2)
    total = derive.continued_energy_j(steps["energy_j"])
    assert total.is_monotonic_increasing
    assert total[19:21].tolist() == [10_000.0, 10_500.0]


def test_energy_so_far_of_cumulative_energy_and_of_too_few_readings() -> None:
    steps = pd.DataFrame(
        {"step": [0, 10, 20], "tokens": [100.0] * 3, "energy_j": [None, 1000.0, 2000.0]}
    )
    energy = derive.energy_so_far(steps, latest_energy_j=2000.0)
    assert energy.used_j == 2000.0
    assert energy.tokens_per_j == pytest.approx(1.0)  # 10 steps x 100 tokens / 1000 J
    one = derive.energy_so_far(steps.head(2), latest_energy_j=math.nan)
    assert one.used_j == 1000.0
    assert math.isnan(one.tokens_per_j)
    assert math.isnan(derive.energy_so_far(steps.head(1), math.nan).used_j)


def test_continued_energy_of_a_window_counts_the_restarts_before_it() -> None:
    earlier = pd.Series([1000.0, 2000.0, 100.0, 200.0])  # a restart after 2000 J
    window = pd.Series([300.0, 50.0, 150.0], index=[7, 8, 9])  # and one inside the window
    total = derive.continued_energy_j(window, earlier)
    assert total.to_dict() == {7: 2300.0, 8: 2350.0, 9: 2450.0}


def test_continued_energy_takes_a_second_fall_after_a_bucket_straddling_a_restart_as_one() -> None:
    # Bucket means of 4 steps around a restart after 10 kJ: the bucket holding it mixes
    # both sides (4083 J), and the next one (3750 J) falls below it again.
    total = derive.continued_energy_j(pd.Series([7750.0, 4083.0, 3750.0, 6750.0]))
    assert total.tolist() == [7750.0, 11833.0, 11500.0, 14500.0]


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
            "nonfinite": False,
        }
    )
    jump = derive.first_jump(layers)
    assert (jump["step"], jump["layer_name"]) == (3, "b")
    assert derive.first_jump(layers.assign(value=1.0)) is None


def test_first_jump_counts_a_non_finite_cell() -> None:
    layers = pd.DataFrame(
        {"step": [0, 1, 2], "layer": [0, 0, 0], "layer_name": ["a"] * 3, "value": [1, None, 1]}
    ).astype({"value": "float64"})
    assert derive.first_jump(layers.assign(nonfinite=[False, True, False]))["step"] == 1
    assert derive.first_jump(layers.assign(nonfinite=False)) is None  # never measured
    infinite = layers.assign(value=[1.0, 1.0, math.inf], nonfinite=[False, False, True])
    assert derive.first_jump(infinite)["step"] == 2


def test_first_alert_after_each_fault_and_its_delay() -> None:
    faults = pd.DataFrame({"step": [80, 150, 200], "rank": [1, 2, -1], "kind": ["f"] * 3})
    alerts = pd.DataFrame({"step": [49, 85, 150], "kind": ["straggler", "straggler", "sdc"]})
    matched = derive.first_alert_after(faults, alerts.astype({"step": "Int64"}))
    assert matched["first_alert"].tolist()[:2] == ["straggler", "sdc"]
    assert matched["delay_steps"].tolist()[:2] == [5, 0]
    assert pd.isna(matched["first_alert"][2])  # nothing fired after step 200


def test_intermittent_ranks_are_the_episodes_that_overlap_the_window() -> None:
    alerts = pd.DataFrame(
        {
            "kind": ["intermittent_straggler"] * 4 + ["straggler"],
            "severity": ["warning", "resolved", "warning", "resolved", "warning"],
            "step": [100, 300, 400, 500, 50],
            "rank": pd.array([2, 2, 5, 5, 1], dtype="Int64"),
            "value": [0.06, math.nan, 0.04, math.nan, 0.2],
        }
    )
    assert derive.intermittent_ranks(alerts, 0, None) == {2: 0.06, 5: 0.04}
    assert derive.intermittent_ranks(alerts, 310, 399) == {}  # between the two episodes
    assert derive.intermittent_ranks(alerts, 250, 260) == {2: 0.06}  # inside rank 2's
    assert derive.intermittent_ranks(alerts, 0, 99) == {}  # before either began
    still_open = alerts[alerts["step"] != 500]
    assert derive.intermittent_ranks(still_open, 600, None) == {5: 0.04}
