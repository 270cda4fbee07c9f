"""SDC: replica fingerprints, persistent peer outliers, the canary, on labeled fleets."""

from __future__ import annotations

import numpy as np

from trainvitals.analyzer.sdc import (
    CanaryDetector,
    PeerOutlierDetector,
    ReplicaDetector,
    outvoted,
)

from .synthetic import fleet, run


def test_outvoted_names_minorities_and_split_groups() -> None:
    values = np.array([7, 7, 9, 7, 1, 2, 5, 5, np.nan])
    groups = np.array([0, 0, 0, 0, 1, 1, 2, 2, 2.0])
    wrong, split = outvoted(values, groups)
    assert wrong.tolist() == [2] and split.tolist() == [1]
    assert outvoted(np.array([3.0, 3, 3]), np.zeros(3))[0].tolist() == []


def test_replica_minority_is_named_once() -> None:
    def fault(step: int, cols: dict) -> None:
        if step >= 35 and step % 10 == 0:
            cols["ranks"]["replica_fingerprint"][6] += 1  # rank 6's copy has drifted

    alerts = run(ReplicaDetector(), fleet(80, ranks=8, replica_groups=2, fault=fault))
    assert [(a.kind, a.step, a.rank) for a in alerts] == [("sdc_replica", 40, 6)]
    assert "replica group 0" in alerts[0].message


def test_replica_pair_that_disagrees_names_nobody() -> None:
    def fault(step: int, cols: dict) -> None:
        if step == 20:
            cols["ranks"]["replica_fingerprint"][1] += 1  # groups of two: ranks 1 and 3

    (alert,) = run(ReplicaDetector(), fleet(30, ranks=4, replica_groups=2, fault=fault))
    assert alert.rank is None and "without a strict majority" in alert.message


def test_persistent_gradient_outlier_is_named() -> None:
    def fault(step: int, cols: dict) -> None:
        if step >= 100:
            cols["ranks"]["grad_norm_local"][3] *= 3

    alerts = run(PeerOutlierDetector(), fleet(200, ranks=8, seed=1, fault=fault))
    assert [(a.kind, a.rank) for a in alerts] == [("sdc_outlier", 3)]
    assert 100 <= alerts[0].step <= 110 and alerts[0].value > 2
    assert "grad_norm_local" in alerts[0].message


def test_tensor_parallel_shards_are_not_compared_with_each_other() -> None:
    def shards(step: int, cols: dict) -> None:
        cols["ranks"]["grad_norm_local"][3::4] *= 2  # tp index 3 holds a different shard

    # dp=4 x tp=4: ranks 3, 7, 11, 15 are peers of one another, not of the others.
    assert run(PeerOutlierDetector(), fleet(150, ranks=16, tp=4, fault=shards)) == []
    assert run(PeerOutlierDetector(), fleet(150, ranks=16, tp=1, fault=shards)) != []


def test_canary_names_every_new_culprit_in_one_alert() -> None:
    def fault(step: int, cols: dict) -> None:
        if step >= 20 and step % 10 == 0:
            cols["ranks"]["canary_fingerprint"][[2, 5]] += 1

    (alert,) = run(CanaryDetector(), fleet(40, ranks=8, fault=fault))
    assert (alert.step, alert.rank) == (20, 2) and "ranks 2, 5" in alert.message


def test_clean_fleets_raise_no_sdc() -> None:
    for seed in range(4):
        for detector in (CanaryDetector(), ReplicaDetector(), PeerOutlierDetector()):
            assert run(detector, fleet(300, ranks=16, seed=seed)) == [], seed
