"""Straggler and canary detectors on synthetic rank streams with known ground truth."""

from __future__ import annotations

import random

from trainvitals.analyzer.detectors import RankView, StepView
from trainvitals.analyzer.sdc import CanaryDetector
from trainvitals.analyzer.straggler import StragglerDetector


def _fleet(
    steps: int,
    ranks: int,
    seed: int,
    slow: dict[int, tuple[int, float]] | None = None,
    with_compute: bool = True,
    hiccups: bool = True,
):
    """Steps of a synchronous job: compute 100 ms +-2% noise (the rank-to-rank spread of
    4 CPU ranks sharing 2 cores), 1%/1000-step drift, hiccups.

    slow: rank -> (first step, slowdown fraction). Every rank waits for the slowest.
    """
    rng = random.Random(seed)
    slow = slow or {}
    for step in range(steps):
        drift = 1 + 0.01 * step / 1000
        compute = [0.1 * drift * rng.gauss(1, 0.02) for _ in range(ranks)]
        for rank, (start, frac) in slow.items():
            if step >= start:
                compute[rank] *= 1 + frac
        if hiccups and rng.random() < 0.05:  # a one-off 50% hiccup on a random rank
            compute[rng.randrange(ranks)] *= 1.5
        end = max(compute)
        view = RankView.of(
            compute_time_s=compute if with_compute else [None] * ranks,
            wait_time_s=[end - c for c in compute],
            loss=[2.0] * ranks,
        )
        yield StepView("r", step, float(step), 2.0, 1.0, step_time_s=end, ranks=view)


def _alerts(detector, views) -> list:
    return [a for v in views for a in detector.observe(v)]


def test_straggler_found_within_30_steps_and_named() -> None:
    # 15% slower: the bar is 5 sigmas of the run's own spread (about 9%), not a fixed 8%.
    for seed in range(10):
        alerts = _alerts(StragglerDetector(), _fleet(300, 8, seed, slow={5: (100, 0.15)}))
        assert [a.rank for a in alerts] == [5], seed
        assert 100 <= alerts[0].step < 130
        assert "ms per step" in alerts[0].message


def test_straggler_on_gpu_ranks_from_arrival_order_alone() -> None:
    views = _fleet(300, 8, 1, slow={3: (100, 0.2)}, with_compute=False)
    alerts = _alerts(StragglerDetector(), views)
    assert [a.rank for a in alerts] == [3] and alerts[0].step < 130


def test_no_straggler_alert_on_clean_fleets_with_noise_drift_and_hiccups() -> None:
    for seed in range(10):
        assert _alerts(StragglerDetector(), _fleet(2000, 8, seed)) == []
        assert _alerts(StragglerDetector(), _fleet(2000, 8, seed, with_compute=False)) == []


def _canary_step(step: int, prints: tuple) -> StepView:
    n = len(prints)
    view = RankView.of(loss=[2.0] * n, canary_fingerprint=prints)
    return StepView("r", step, 0.0, 2.0, 1.0, ranks=view)


def test_canary_majority_names_the_faulty_rank_once() -> None:
    d = CanaryDetector()
    assert d.observe(_canary_step(0, (7, 7, 7, 7))) == []
    (alert,) = d.observe(_canary_step(50, (7, 7, 9, 7)))
    assert alert.rank == 2 and alert.severity == "critical"
    assert d.observe(_canary_step(100, (7, 7, 9, 7))) == []  # already named
    assert d.observe(_canary_step(120, (None,) * 4)) == []  # not a canary step


def test_canary_without_majority_names_nobody() -> None:
    (alert,) = CanaryDetector().observe(_canary_step(0, (1, 2)))
    assert alert.rank is None
