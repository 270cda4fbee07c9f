"""Straggler scoring: the bar from the run's own spread, persistence, episodes; real runs."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import signal
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import orjson
import pytest

from tests.conftest import kill_job, patience_s, run_trainer, wait_until
from trainvitals.analyzer import Analyzer
from trainvitals.analyzer.runinfo import RunInfo
from trainvitals.analyzer.straggler import (
    StragglerDetector,
    StragglerSettings,
    arrival_excess,
    excess,
    rank_scores,
    sync_time_s,
)
from trainvitals.analyzer.views import COLLECTIVE_TIMES, RankView, StepView
from trainvitals.schema import to_arrow
from trainvitals.simulate import splice_slowdown
from trainvitals.trainer.launch import descendants, torchrun_command

COMPUTE_S = 0.1
DATA = Path(__file__).parent / "data"


def cohort(
    steps: int,
    ranks: int,
    *,
    noise: float = 0.005,
    slow: dict[int, list[tuple[int, int, float]]] | None = None,
    seed: int = 0,
    log_every: int = 1,
):
    """StepViews of a synchronous job: compute 100 ms x lognormal noise (sigma `noise`).

    slow: rank -> [(first step, end step, slowdown)]. Every rank waits for the slowest.
    log_every: a view for every log_every-th step only (steps 0, log_every, ...).
    """
    rng = np.random.default_rng(seed)
    slow = slow or {}
    for step in range(steps):
        compute = COMPUTE_S * np.exp(noise * rng.standard_normal(ranks))
        for rank, spans in slow.items():
            for first, end, frac in spans:
                if first <= step < end:
                    compute[rank] *= 1 + frac
        if step % log_every == 0:
            yield _step(step, compute)


def _step(step: int, compute: np.ndarray, step_s: float | None = None) -> StepView:
    end = float(compute.max())
    view = RankView.of(compute_time_s=compute.tolist(), wait_time_s=(end - compute).tolist())
    return StepView("r", step, float(step), 2.0, 1.0, step_time_s=step_s or end, ranks=view)


def rows(views, settings: StragglerSettings | None = None) -> list:
    d = StragglerDetector(settings or StragglerSettings())
    return [a for v in views for a in d.observe(v)]


@pytest.mark.parametrize(
    "field, value",
    [
        ("persist_steps", 2),
        ("min_logged_steps", 2),
        ("min_logged_steps", 26),
        ("persist_fraction", 0.5),
        ("spread_multiple", 0.0),
        ("min_excess", -0.1),
        ("spread_steps", 5),
        ("resolve_fraction", 1.0),
        ("restless_share", 0.0),
        ("restless_persist_steps", 24),
        ("min_last_fraction", 1.5),
        ("min_stopped_share", 0.0),
        ("min_data_share", 1.0),
    ],
)
def test_bad_settings_name_the_field(field: str, value) -> None:
    with pytest.raises(ValueError, match=rf"^straggler\.{field} "):
        StragglerSettings(**{field: value})


def test_the_bar_follows_the_runs_own_spread() -> None:
    # The same rank 12% slower: clear on an even cohort (1% noise, the bar is the 6% floor),
    # within the noise of a cohort whose ranks differ by 5% a step (the bar: 5 sigmas, ~20%).
    slow = {2: [(50, 400, 0.12)]}
    assert [a.rank for a in rows(cohort(400, 4, noise=0.01, slow=slow))] == [2]
    assert rows(cohort(400, 4, noise=0.05, slow=slow)) == []


def test_one_noisy_step_or_a_short_burst_does_not_count() -> None:
    # Rank 1 twice as slow for single steps, then 50% slower for 15 steps (a busy
    # neighbour): under the 20 of 25 steps a straggler needs. The same 50% for 40 steps is one.
    hiccups = [(s, s + 1, 1.0) for s in range(40, 200, 7)]
    assert rows(cohort(400, 4, slow={1: [*hiccups, (250, 265, 0.5)]})) == []
    (alert,) = rows(cohort(400, 4, slow={1: [(250, 290, 0.5)]}))[:1]
    assert alert.rank == 1


def test_an_episode_has_its_onset_its_cost_and_one_resolve() -> None:
    # Rank 3 of 8 computes 30% longer (30 ms a step) from step 100 to step 300.
    alert, resolved = rows(cohort(500, 8, slow={3: [(100, 300, 0.3)]}))
    assert (alert.kind, alert.rank, alert.severity) == ("straggler", 3, "warning")
    assert alert.start_step == 100
    assert 100 < alert.step < 130
    assert alert.value == pytest.approx(1.3, rel=0.02)
    assert int(re.search(r"about (\d+) ms per step", alert.message).group(1)) in range(29, 32)
    assert (resolved.severity, resolved.rank, resolved.start_step) == ("resolved", 3, 100)
    assert 300 < resolved.step < 330


def test_a_straggler_near_the_bar_is_one_episode() -> None:
    # 10% slower, then 4.5% (under the 6% bar, above half of it), then 10% again: the
    # dip does not end the episode, so it is not raised twice.
    spans = [(50, 150, 0.10), (150, 250, 0.045), (250, 400, 0.10)]
    alerts = rows(cohort(400, 4, slow={0: spans}))
    assert [(a.rank, a.severity) for a in alerts] == [(0, "warning")]


def test_ranks_slow_at_the_same_step_share_one_alert() -> None:
    (alert,) = rows(cohort(300, 8, slow={2: [(100, 300, 0.3)], 5: [(100, 300, 0.4)]}))
    assert alert.rank == 5  # the slowest first
    assert "also rank 2" in alert.message


def test_never_two_rows_at_one_step() -> None:
    # Rank 1's episode ends exactly when rank 4's begins: the alert goes first, the resolve
    # one step later (the alerts table holds one row per run, kind and step).
    alerts = rows(cohort(400, 4, noise=0.0, slow={1: [(100, 200, 0.3)], 3: [(200, 400, 0.3)]}))
    got = [(a.step, a.rank, a.severity) for a in alerts]
    assert got == [(119, 1, "warning"), (219, 3, "warning"), (220, 1, "resolved")]


def test_persistence_counts_training_steps_not_logged_ones() -> None:
    # Logged every 4 steps, as the README's screenshot run: a 50% straggler from step 48
    # of 80 is named within the 25 steps the persistence asks for (7 logged steps), where
    # 25 logged steps would have needed 100 steps and never named it.
    alerts = rows(cohort(80, 4, slow={1: [(48, 80, 0.5)]}, log_every=4))
    assert [(a.rank, a.start_step) for a in alerts] == [(1, 48)]
    assert 48 + 20 <= alerts[0].step <= 48 + 24
    # A slowdown shorter than 25 steps is still no straggler at log_every=4.
    assert rows(cohort(400, 4, slow={1: [(100, 115, 0.5)]}, log_every=4)) == []


def test_a_sparse_log_every_widens_the_window_to_min_logged_steps() -> None:
    # Logged every 10 steps, 25 steps hold 3 logged ones: too few to tolerate one noisy
    # step. The window reaches back to 6 (60 steps): a 40-step burst, 4 logged steps above
    # the bar, is not named; a sustained slowdown is, once 5 of its last 6 are slow.
    assert rows(cohort(400, 4, slow={2: [(195, 235, 0.5)]}, log_every=10)) == []
    (alert,) = rows(cohort(400, 4, slow={2: [(200, 400, 0.5)]}, log_every=10))
    assert (alert.rank, alert.start_step, alert.step) == (2, 200, 240)


def _tp_cohort(steps: int, slow_rank: int, in_group_last: float, seed: int = 0):
    """8 ranks, dp=4 x tp=2 (peer groups: even and odd ranks). Each peer group leaves its
    gradient reduction at its own time and its ranks then arrive within 5 ms; the group of
    `slow_rank` arrives first but in every 10th step. From step 10 `slow_rank` computes 15%
    longer and arrives last of its group in `in_group_last` of the steps (else at random)."""
    rng = np.random.default_rng(seed)
    for step in range(steps):
        compute = COMPUTE_S * np.exp(0.01 * rng.standard_normal(8))
        arrival_s = rng.uniform(0.0, 0.005, 8)
        own_group = np.arange(8) % 2 == slow_rank % 2
        arrival_s[~own_group if step % 10 else own_group] += 0.02
        if step >= 10:
            compute[slow_rank] *= 1.15
            if rng.random() < in_group_last:
                arrival_s[slow_rank] = arrival_s[own_group].max() + 0.001
        waits = arrival_s.max() - arrival_s
        yield compute, waits


def _views(cohort_rows, tp: int):
    for step, (compute, waits) in enumerate(cohort_rows):
        ranks = RankView.of(tp=tp, compute_time_s=compute.tolist(), wait_time_s=waits.tolist())
        yield StepView("r", step, float(step), 2.0, 1.0, step_time_s=0.3, ranks=ranks)


def test_with_tensor_parallelism_a_straggler_is_last_of_its_data_parallel_peers() -> None:
    # Last of its peer group in every step, but of all 8 ranks in 10% (its group usually
    # arrives first): under the 25% (twice chance) of the whole cohort, over the
    # 50% of its group of 4. Named within 25 steps where the run's tp is known, not without.
    alerts = rows(_views(_tp_cohort(60, 5, in_group_last=1.0), tp=2))
    assert [(a.rank, a.start_step) for a in alerts] == [(5, 10)]
    assert alerts[0].step <= 10 + 25
    assert rows(_views(_tp_cohort(60, 5, in_group_last=1.0), tp=1)) == []
    # Slow by its CPU time but arriving in its group at random: it kept nobody waiting.
    assert rows(_views(_tp_cohort(200, 5, in_group_last=0.0), tp=2)) == []


def test_recorded_8_rank_run_the_straggler_is_named_within_30_steps() -> None:
    # A real dp=4 x tp=2 run, 8 ranks on 2 cores: rank 5 15% slower from step 10. It
    # arrived last of all in 20% of its first 25 slow steps (the even and odd peer groups
    # reach the hooks' collective in either order), last of its 3 peers in 64%.
    views = _recorded("quiet_8rank_straggler.csv", ranks=8, tp=2)
    (alert,) = rows(views)
    assert (alert.rank, alert.start_step) == (5, 10)
    assert alert.step <= 10 + 30
    # Judged against all 8 ranks alone (the run's tp unknown), it was named 33 steps late.
    assert [a.step for a in rows(_recorded("quiet_8rank_straggler.csv", ranks=8))] == [43]


def _idle_cohort(steps: int, slow_rank: int | None, seed: int = 0):
    """8 ranks on an idle machine, 100 ms steps. Their CPU times vary by 4% a step (a
    rank's CPU time also counts its polling in the collectives); they reach the step's
    end within 1 ms of each other. From step 10 `slow_rank` works 15 ms more a step: 15%
    more CPU time, inside the CPU times' noise (the bar, 5 sigmas, is about 20%), and it
    arrives 15 ms after the others."""
    rng = np.random.default_rng(seed)
    for step in range(steps):
        compute = 0.1 * np.exp(0.04 * rng.standard_normal(8))
        arrival_s = rng.uniform(0.0, 0.001, 8)
        if slow_rank is not None and step >= 10:
            compute[slow_rank] *= 1.15
            arrival_s[slow_rank] += 0.015
        waits = arrival_s.max() - arrival_s
        ranks = RankView.of(tp=2, compute_time_s=compute.tolist(), wait_time_s=waits.tolist())
        yield StepView("r", step, float(step), 2.0, 1.0, step_time_s=0.1, ranks=ranks)


def test_a_straggler_hidden_in_the_cpu_times_noise_is_named_by_its_arrival() -> None:
    (alert,) = rows(_idle_cohort(100, slow_rank=5))
    assert (alert.rank, alert.start_step) == (5, 10)
    assert alert.step <= 10 + 25
    assert "15% of a step later than the median rank" in alert.message
    assert "metric=wait_time_s" in alert.message
    assert int(re.search(r"about (\d+) ms per step", alert.message).group(1)) in range(14, 17)
    assert rows(_idle_cohort(1000, slow_rank=None)) == []


def test_recorded_runs_of_an_idle_16_core_machine() -> None:
    # dp=4 x tp=2 on CPU: CPU times spread 4% a step (bar 20%), the ranks reach the step's
    # end within 1 ms but for the straggler (rank 5, 15% slower from step 10): named by its
    # arrival within 20 steps. The clean run of 200 steps raises nothing.
    (alert,) = rows(_recorded("idle16_8rank_straggler.csv", ranks=8, tp=2))
    assert (alert.rank, alert.start_step) == (5, 10)
    assert alert.step <= 10 + 20
    assert "metric=wait_time_s" in alert.message
    assert rows(_recorded("idle16_8rank_clean.csv", ranks=8, tp=2)) == []


def _realistic_clean(steps: int, ranks: int, seed: int):
    """A clean cohort on a busy machine, shaped after the loaded 4-rank CPU runs
    (docs/benchmarks.md): heavy-tailed per-step noise (Student t, 3 degrees of freedom,
    median absolute excess 0.016), one-off hiccups (5% of steps, one rank 50% slower) and
    busy-neighbour bursts (a rank 15-25% slower for 5-15 steps, a few per 1,000 steps)."""
    rng = np.random.default_rng(seed)
    burst_rank, burst_end, burst_frac = 0, -1, 0.0
    for step in range(steps):
        log_noise = 0.016 / 0.765 * rng.standard_t(3, ranks)  # t3's MAD is 0.765
        compute = COMPUTE_S * np.exp(log_noise)
        if rng.random() < 0.05:
            compute[rng.integers(ranks)] *= 1.5
        if step >= burst_end and rng.random() < 0.005:
            burst_rank, burst_end = rng.integers(ranks), step + rng.integers(5, 16)
            burst_frac = rng.uniform(0.15, 0.25)
        if step < burst_end:
            compute[burst_rank] *= 1 + burst_frac
        yield _step(step, compute)


@pytest.mark.parametrize("ranks", [4, 8])
def test_no_alert_on_noisy_clean_cohorts(ranks: int) -> None:
    for seed in range(5):
        assert rows(_realistic_clean(1000, ranks, seed)) == [], seed


def _recorded(name: str, ranks: int = 4, tp: int = 1) -> list[StepView]:
    """A recorded real CPU run: each row a step's compute_time_s then wait_time_s of each
    rank, then (where recorded) its step_time_s. loaded_clean_*: clean, 4 ranks (dp=2 x
    tp=2), 1,000 steps with 8 busy processes on its 2 cores. `tp`: the run's
    tensor-parallel degree as the view has it."""
    return _views_of(np.loadtxt(DATA / name, delimiter=","), ranks, tp)


def _slowed(table: np.ndarray, rank: int, first: int, end: int, slowdown: float) -> np.ndarray:
    """A recorded 4-rank table (no step_time_s column) with `splice_slowdown` applied."""
    compute, waits = splice_slowdown(table[:, :4], table[:, 4:8], rank, first, end, slowdown)
    return np.hstack([compute, waits])


def _views_of(table: np.ndarray, ranks: int, tp: int) -> list[StepView]:
    assert table.shape[1] in (2 * ranks, 2 * ranks + 1)
    views = []
    for step, row in enumerate(table):
        compute, waits = row[:ranks], row[ranks : 2 * ranks]
        end = float(row[-1] if len(row) > 2 * ranks else (compute + waits).max())
        view = RankView.of(tp=tp, compute_time_s=compute.tolist(), wait_time_s=waits.tolist())
        views.append(StepView("r", step, float(step), 2.0, 1.0, step_time_s=end, ranks=view))
    return views


def test_no_alert_on_recorded_clean_runs_of_a_loaded_machine() -> None:
    # Run a: one rank ran 23% slower for about 18 steps, near step 400. A fixed 8% bar
    # over 10 steps (7 of them), as before, raises alerts on it; the run's own bar does not.
    assert rows(_recorded("loaded_clean_a.csv")) == []
    fixed = StragglerSettings(persist_steps=10, persist_fraction=0.7, spread_multiple=1e-9,
                              min_excess=0.077)  # fmt: skip
    assert rows(_recorded("loaded_clean_a.csv"), fixed)
    # Run b: rank 0's CPU time ran 20-40% over for about 20 steps near step 260, yet it
    # arrived last in a quarter of them (a busy neighbour, not a slow rank): compute time
    # alone would name it.
    assert rows(_recorded("loaded_clean_b.csv")) == []
    compute_only = StragglerSettings(min_last_fraction=0.0)
    assert [a.rank for a in rows(_recorded("loaded_clean_b.csv"), compute_only)][:1] == [0]


def test_a_restless_cohort_asks_for_a_longer_window() -> None:
    # The recorded loaded run a: its clean ranks' bursts over the bar (a busy neighbour
    # each) make the cohort restless after its first 100-200 steps. A 30-step slowdown of
    # rank 1 there, 25% and making everyone wait, is what a busy neighbour does: judged
    # over 25 steps, as on a quiet machine, it would be named; over the restless
    # cohort's 60, it is not.
    table = np.loadtxt(DATA / "loaded_clean_a.csv", delimiter=",")
    burst = _views_of(_slowed(table, rank=1, first=500, end=530, slowdown=0.25), 4, 1)
    assert rows(burst) == []
    never_restless = StragglerSettings(restless_share=1.0)
    assert [(a.rank, a.severity) for a in rows(burst, never_restless)][:1] == [(1, "warning")]
    # A sustained 15% straggler in the same restless cohort is still named, about 50 steps
    # after it began (20 over 25 steps), with the reason in its message.
    (alert,) = rows(_views_of(_slowed(table, rank=1, first=500, end=1000, slowdown=0.15), 4, 1))
    assert alert.rank == 1 and 500 <= alert.start_step < 530
    assert 500 + 48 <= alert.step <= 500 + 60
    old = rows(_views_of(_slowed(table, rank=1, first=500, end=1000, slowdown=0.15), 4, 1),
               never_restless)  # fmt: skip
    assert old[0].step < 500 + 48
    assert "a restless cohort" in alert.message and "the window is 60 steps" in alert.message


def test_a_stragglers_own_steps_never_make_its_cohort_restless() -> None:
    # A straggler's steps, before it was named and during its episode, are left out of
    # the bursts: a second straggler after the first one's episode ended is named within
    # the quiet window.
    d = StragglerDetector()
    alerts = [a for v in cohort(700, 8, slow={3: [(100, 300, 0.3)], 6: [(500, 700, 0.2)]})
              for a in d.observe(v)]  # fmt: skip
    assert [(a.rank, a.severity) for a in alerts] == [(3, "warning"), (3, "resolved"),
                                                     (6, "warning")]  # fmt: skip
    assert alerts[-1].step <= 500 + 25
    assert d._restless_share() == 0.0


def test_a_rank_slow_by_its_compute_time_must_also_keep_the_others_waiting() -> None:
    # Rank 1 computes 30% longer from step 50 but arrives in random order (its extra CPU
    # time does not delay it): not named. Arriving last in 60% of steps, it is.
    def views(p_last: float):
        rng = np.random.default_rng(0)
        for step in range(200):
            compute = COMPUTE_S * np.exp(0.01 * rng.standard_normal(4))
            compute[1] *= 1.3 if step >= 50 else 1.0
            waits = rng.uniform(0.01, 0.02, 4)
            late = 1 if step >= 50 and rng.random() < p_last else rng.integers(4)
            waits[late] = 0.0
            ranks = RankView.of(compute_time_s=compute.tolist(), wait_time_s=waits.tolist())
            yield StepView("r", step, float(step), 2.0, 1.0, step_time_s=0.2, ranks=ranks)

    assert rows(views(p_last=0.0)) == []
    assert [a.rank for a in rows(views(p_last=0.6))] == [1]


def test_without_compute_times_arrival_names_the_late_rank() -> None:
    rng = np.random.default_rng(0)
    d, alerts = StragglerDetector(), []
    for step in range(200):
        compute = COMPUTE_S * np.exp(0.01 * rng.standard_normal(4))
        compute[2] *= 1.3 if step >= 50 else 1.0
        end = float(compute.max())
        view = RankView.of(compute_time_s=[None] * 4, wait_time_s=(end - compute).tolist())
        alerts += d.observe(StepView("r", step, float(step), 2.0, 1.0, step_time_s=end,
                                     ranks=view))  # fmt: skip
    assert [(a.rank, a.start_step) for a in alerts] == [(2, 50)]


def test_rank_scores_rank_the_slow_rank_first() -> None:
    # Rank 1 is 20% slower in every one of 30 steps; rank 3 once 3x slower.
    compute = np.full((30, 4), COMPUTE_S)
    compute[:, 1] *= 1.2
    compute[5, 3] *= 3
    scores = rank_scores(excess(compute), sigma=0.0, s=StragglerSettings())
    assert scores.order()[0] == 1
    assert scores.slow.tolist() == [False, True, False, False]
    assert scores.median([1])[0] == pytest.approx(np.log(1.2))


# ---------------------------------------------------------------------------- real runs


def _straggler_alerts(
    path: Path, drop: tuple[str, ...] = (), kinds: tuple[str, ...] = ("straggler",)
) -> list:
    """The alerts of `kinds` of a telemetry file, its ranks' `drop` columns left out."""
    analyzer, alerts = Analyzer(), []
    for line in path.read_bytes().splitlines():
        run_id, tables = to_arrow(orjson.loads(line))
        if drop and "ranks" in tables:
            tables["ranks"] = tables["ranks"].drop_columns(list(drop))
        alerts += analyzer.observe(run_id, tables)
    return [a for a in alerts if a.kind in kinds]


def _most_open_per_rank(alerts: list) -> int:
    """The most episodes open at once for one rank, counted after each step's rows."""
    open_at: dict[tuple[str, int], bool] = {}
    most = 0
    for step in sorted({a.step for a in alerts}):
        for a in (a for a in alerts if a.step == step):
            open_at[(a.kind, a.rank)] = not a.resolves
        per_rank = Counter(rank for (_, rank), is_open in open_at.items() if is_open)
        most = max(most, *per_rank.values(), 0)
    return most


# The straggler's run: 90 steps of straggling. On a busy machine the cohort can look
# restless, and a slowdown must then last restless_persist_steps (60), not 25 (at 50
# steps, 40 of straggling, the test failed 1 of 3 times beside two busy loops, and once in
# CI). The clean run: 50.
REAL_STEPS = {True: 100, False: 50}


@pytest.mark.slow
@pytest.mark.parametrize("inject", [["--inject", "straggler:rank=2,step=10,slowdown=0.25"], []])
def test_real_4_rank_run(tmp_path: Path, inject: list[str]) -> None:
    """A real dp=2 x tp=2 run on CPU: a 25% straggler from step 10 is named (rank 2, its
    onset at step 10 or the step before, one alert); a clean run raises no straggler alert."""
    out = tmp_path / "run.jsonl"
    steps = REAL_STEPS[bool(inject)]
    run_trainer(["--dp", "2", "--tp", "2", "--steps", str(steps), "--canary-every", "10",
                 "--telemetry-file", str(out), *inject], nproc=4)  # fmt: skip
    alerts = _straggler_alerts(out)
    if not inject:
        assert alerts == []
        return
    assert [(a.rank, a.severity) for a in alerts] == [(2, "warning")]
    # Its onset: step 10, or step 9 when that one cleared the bar by noise on a busy machine
    # (no rule can tell it from the slowdown's start): 9 once in a CI run.
    assert alerts[0].start_step >= 10 - 1


@pytest.mark.slow
def test_real_run_logged_every_4_steps(tmp_path: Path) -> None:
    """A real dp=2 x tp=2 run on CPU logged every 4 steps, as the README's screenshot run:
    a 50% straggler from step 20 of 64 (11 logged steps of it) is named, once. Counted in
    logged steps, the persistence (25) would have outlasted the run."""
    out = tmp_path / "run.jsonl"
    run_trainer(["--dp", "2", "--tp", "2", "--steps", "64", "--log-every", "4",
                 "--canary-every", "8", "--telemetry-file", str(out),
                 "--inject", "straggler:rank=1,step=20,slowdown=0.5"], nproc=4)  # fmt: skip
    alerts = _straggler_alerts(out)
    assert [(a.rank, a.severity) for a in alerts] == [(1, "warning")]
    # Its onset: step 20, or a logged step before it when those cleared the bar by noise
    # (no rule can tell them from the slowdown's start): 16 once in a CI run, 12 once
    # beside a test suite and a training bench (load about 5 on 2 cores), 20 in 11 quiet
    # reruns and in 4 beside 4 busy loops.
    assert alerts[0].start_step >= 20 - 2 * 4


def stopped_cohort(steps: int, ranks: int, stopped: dict[int, tuple[int, float]], seed: int = 0):
    """A job whose ranks compute alike (100 ms) and are stopped ~1% of a step (the stopped
    clock's noise, 0.5% rank to rank); rank -> (first step, share of the step) stopped on
    top from then. The others wait for a stopped rank inside the collectives, not at the
    step's end: every rank arrives at the same time, as on the CPU reference runs."""
    rng = np.random.default_rng(seed)
    for step in range(steps):
        compute = COMPUTE_S * np.exp(0.005 * rng.standard_normal(ranks))
        step_s = float(compute.max()) / (1 - max((f for a, f in stopped.values() if step >= a),
                                                  default=0.0))  # fmt: skip
        stop = step_s * np.clip(0.01 + 0.005 * rng.standard_normal(ranks), 0, None)
        for rank, (first, share) in stopped.items():
            if step >= first:
                stop[rank] += share * step_s
        view = RankView.of(compute_time_s=compute.tolist(), wait_time_s=[0.01] * ranks,
                           stopped_time_s=stop.tolist())  # fmt: skip
        yield StepView("r", step, float(step), 2.0, 1.0, step_time_s=step_s, ranks=view)


def test_a_rank_stopped_from_outside_is_named_by_its_stopped_time() -> None:
    """Neither its CPU time nor its arrival moves; its stopped time does: named once, with
    the cost, within the window; resolved when the stops end."""
    views = list(stopped_cohort(200, 4, {2: (60, 0.12)}))
    got = rows(views)
    assert [(a.kind, a.rank, a.severity) for a in got] == [("straggler", 2, "warning")]
    alert = got[0]
    assert alert.start_step >= 60 and alert.step <= 60 + 30
    assert "stopped 12% of a step longer than the median rank" in alert.message, alert.message
    assert "bar: 3%" in alert.message
    # Without the stopped times (a producer that does not report them), nobody is named.
    blind = [
        StepView(v.run_id, v.step, v.time_unix_s, v.loss, v.tokens_per_s,
                 step_time_s=v.step_time_s,
                 ranks=RankView.of(compute_time_s=v.ranks.compute_time_s.tolist(),
                                   wait_time_s=v.ranks.wait_time_s.tolist()))
        for v in views
    ]  # fmt: skip
    assert rows(blind) == []


def data_cohort(steps: int, ranks: int, slow: dict[int, tuple[int, float]], seed: int = 0):
    """A job whose ranks compute alike (100 ms) and fetch each batch in ~0.5 ms (rank to
    rank within 0.2 ms); rank -> (first step, share of the step) spent waiting for data on
    top from then: off the CPU, and the others wait for it in the forward's collectives,
    which are not timed, so every rank arrives at the step's end at the same time."""
    rng = np.random.default_rng(seed)
    for step in range(steps):
        compute = COMPUTE_S * np.exp(0.005 * rng.standard_normal(ranks))
        share = max((f for a, f in slow.values() if step >= a), default=0.0)
        step_s = float(compute.max()) / (1 - share)
        data = np.clip(0.0005 + 0.0002 * rng.standard_normal(ranks), 0, None)
        for rank, (first, extra) in slow.items():
            if step >= first:
                data[rank] += extra * step_s
        view = RankView.of(compute_time_s=compute.tolist(), wait_time_s=[0.01] * ranks,
                           data_time_s=data.tolist())  # fmt: skip
        yield StepView("r", step, float(step), 2.0, 1.0, step_time_s=step_s, ranks=view)


def test_a_rank_waiting_for_its_data_is_named_by_its_data_time() -> None:
    """A slow file system on one rank's node: its CPU time, its arrival at the step's end
    and its stopped time do not move, its wait for data does: named once, within the
    window, with its cost; without the data times nobody is, and an even cohort is
    never named."""
    views = list(data_cohort(200, 4, {1: (60, 0.15)}))
    got = rows(views)
    assert [(a.kind, a.rank, a.severity) for a in got] == [("straggler", 1, "warning")]
    alert = got[0]
    assert alert.start_step >= 60 and alert.step <= 60 + 30
    assert "waiting for its data 15% of a step longer than the median rank" in alert.message
    assert "bar: 3%" in alert.message and "loses about 18 ms per step" in alert.message
    blind = [
        dataclasses.replace(v, ranks=dataclasses.replace(v.ranks, data_time_s=None)) for v in views
    ]
    assert rows(blind) == []
    assert rows(data_cohort(1000, 8, {}, seed=4)) == []
    # On a GPU run the host's data time also holds its waits for the device: not judged.
    gpu = RunInfo(device_type="cuda")
    assert rows(dataclasses.replace(v, run=gpu) for v in views) == []
    cpu = RunInfo(device_type="cpu")
    assert [a.rank for a in rows(dataclasses.replace(v, run=cpu) for v in views)] == [1]


def test_stops_that_end_resolve_and_noise_is_not_a_stop() -> None:
    views = list(stopped_cohort(300, 4, {1: (50, 0.2)}))
    ended = [*views[:150], *stopped_cohort(150, 4, {}, seed=1)]
    got = rows(dataclasses.replace(v, step=i) for i, v in enumerate(ended))
    assert [(a.kind, a.rank, a.severity) for a in got] == [
        ("straggler", 1, "warning"), ("straggler", 1, "resolved")
    ]  # fmt: skip
    assert "stopped 0% of a step longer" in got[1].message, got[1].message  # not -0%, nor -1%
    assert rows(stopped_cohort(1000, 8, {}, seed=3)) == []  # 1% +- 0.5% on every rank


def test_sync_time_adds_the_collectives_timed_on_every_rank() -> None:
    wait = np.array([0.002, 0.003, 0.001])
    gather = np.array([0.05, 0.02, 0.05])
    partial = np.array([0.01, np.nan, 0.01])  # not timed on rank 1: left out at this step
    got = sync_time_s(wait, (gather, partial))
    assert got == pytest.approx([0.052, 0.023, 0.051])
    # Rows of a grid: each row (step) on its own.
    grid = sync_time_s(np.vstack([wait, wait]), (np.vstack([gather, partial]),))
    assert grid == pytest.approx(np.vstack([[0.052, 0.023, 0.051], wait]))
    # Rank 1 arrived 30 ms of a 100 ms step after the median rank.
    assert arrival_excess(got, 0.1)[1] == pytest.approx(0.28)


def _rank_pid(job: subprocess.Popen, rank: int) -> int | None:
    for pid in descendants(job.pid):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and b"LOCAL_RANK=" + str(rank).encode() in env:
            return pid
    return None


def _stop_now_and_then(pid: int, stopped_ms: int, done: threading.Event) -> None:
    """SIGSTOP `pid` for `stopped_ms` of every 100 ms until `done`."""
    try:
        while not done.is_set():
            os.kill(pid, signal.SIGSTOP)
            time.sleep(stopped_ms / 1000)
            os.kill(pid, signal.SIGCONT)
            time.sleep((100 - stopped_ms) / 1000)
    except ProcessLookupError:
        return
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


@pytest.mark.slow
def test_real_run_with_a_rank_stopped_from_outside(tmp_path: Path) -> None:
    """A real 4-rank run (dp=4, gloo) with rank 1 stopped 40 ms of every 100 ms by SIGSTOP
    and SIGCONT from this test, as a CPU quota or a freezer would: rank 1 is named, by the
    time its process was stopped (its CPU time does not move), and nobody else."""
    out = tmp_path / "run.jsonl"
    args = ["--dp", "4", "--steps", "60", "--telemetry-file", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    job = subprocess.Popen(torchrun_command(4, args), env=env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True)  # fmt: skip
    done = threading.Event()
    try:
        pid = wait_until(lambda: _rank_pid(job, 1), timeout_s=120)
        stopper = threading.Thread(target=_stop_now_and_then, args=(pid, 40, done))
        stopper.start()
        try:
            _, err = job.communicate(timeout=patience_s(600))
        finally:
            done.set()
            stopper.join()
        assert job.returncode == 0, err[-3000:]
    finally:
        done.set()
        if job.poll() is None:
            kill_job(job)
    alerts = _straggler_alerts(out)
    assert [(a.rank, a.severity) for a in alerts] == [(1, "warning")], alerts
    assert "its process stopped" in alerts[0].message, alerts[0].message


@pytest.mark.slow
def test_real_run_with_a_rank_held_off_the_cpu(tmp_path: Path) -> None:
    """A real 4-rank run (dp=2 x tp=2, gloo) with rank 3 asleep in each forward from step
    20 for twice its compute time (`how=idle`: a CPU quota, a slow file read), about a
    quarter of a step: neither its CPU time nor its stopped time moves, and the others wait
    for it in the model's collectives, not at the step's end: its tensor-parallel peer in
    DTensor's, which the hooks time where they wait for them, the other two in FSDP's. It
    is named by its arrival there, and nobody else is (not its tensor-parallel peer, which
    arrives with it at FSDP's); with the collectives' times left out (the step's end alone,
    as before), nobody is named."""
    out = tmp_path / "run.jsonl"
    # From step 20, not 10: the run's first steps are the noisiest, and the onset is the
    # window's first step over the bar after two in a row under it.
    run_trainer(["--dp", "2", "--tp", "2", "--steps", "70", "--telemetry-file", str(out),
                 "--inject", "straggler:rank=3,step=20,slowdown=2,how=idle"],
                nproc=4)  # fmt: skip
    alerts = _straggler_alerts(out)
    assert [(a.rank, a.severity) for a in alerts] == [(3, "warning")], alerts
    assert "at the step's end and in the model's collectives" in alerts[0].message, alerts[
        0
    ].message
    # The onset may be a step or two early: steps just before the fault that
    # cleared the bar by noise (18 once in CI) cannot be told from its start.
    assert alerts[0].start_step >= 20 - 2
    assert _straggler_alerts(out, drop=COLLECTIVE_TIMES) == []
    # Its onset may look like hiccups first: then the intermittent episode is handed over
    # when the straggler alert opens (one slow rank, one open alert).
    both = _straggler_alerts(out, kinds=("straggler", "intermittent_straggler"))
    assert _most_open_per_rank(both) == 1, both


@pytest.mark.slow
def test_real_run_with_a_rank_waiting_for_its_data(tmp_path: Path) -> None:
    """A real dp=2 x tp=2 run (gloo) with rank 2 waiting for each batch as long as it
    computes from step 20 (`how=data`: a slow file system on its node). The others wait
    for it in the forward's collectives, and it is named, by its arrival there, and nobody
    else is. Without those collectives' times (the hooks did not time DTensor's on gloo
    before) its data time alone names it, and still nobody else: its data-parallel peer,
    rank 0, waits for it in FSDP's first all-gather, which the hooks do not count as data
    time."""
    out = tmp_path / "run.jsonl"
    run_trainer(["--dp", "2", "--tp", "2", "--steps", "70", "--telemetry-file", str(out),
                 "--inject", "straggler:rank=2,step=20,slowdown=1,how=data"],
                nproc=4)  # fmt: skip
    alerts = _straggler_alerts(out)
    assert [(a.rank, a.severity) for a in alerts] == [(2, "warning")], alerts
    # The onset may be a step or two early: steps just before the fault that
    # cleared the bar by noise (18 once in CI) cannot be told from its start.
    assert alerts[0].start_step >= 20 - 2
    by_data = _straggler_alerts(out, drop=COLLECTIVE_TIMES)
    assert [(a.rank, a.severity) for a in by_data] == [(2, "warning")], by_data
    assert "waiting for its data" in by_data[0].message, by_data[0].message
    assert "also" not in by_data[0].message, by_data[0].message
    assert _straggler_alerts(out, drop=(*COLLECTIVE_TIMES, "data_time_s")) == []
