"""SDC: replica fingerprints, persistent peer outliers, the canary, on labeled fleets."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from trainvitals.analyzer.runinfo import RunInfo
from trainvitals.analyzer.sdc import (
    CanaryDetector,
    PeerOutlierDetector,
    PeerOutlierSettings,
    ReplicaDetector,
    outvoted,
    sdc_detectors,
)

from .synthetic import fleet, run


def run_all(detectors: list, views) -> list:
    """Alerts of several detectors fed the same steps, in the engine's order."""
    return [a for v in views for d in detectors for a in d.observe(v)]


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


def _layout(tp: int, faulty: int, after: int, canary: bool = True, outlier: bool = False):
    """FSDP x TP as the trainer lays it out (replica group = rank // tp, the dp index):
    from step `after` the faulty rank's own copy and, through the data-parallel gradient
    reduction, the copy of the member at its tp index in every other group drift; its
    canary (if `canary`) and its local gradient norm (if `outlier`) go wrong too."""

    def fault(step: int, cols: dict) -> None:
        r = cols["ranks"]
        n = len(r["replica_group"])
        r["replica_group"] = (np.arange(n) // tp).astype(float)
        if np.isfinite(r["replica_fingerprint"]).all():
            r["replica_fingerprint"] = 1000.0 * step + r["replica_group"]
            if step >= after:
                r["replica_fingerprint"][faulty % tp :: tp] += 0.5 + np.arange(n // tp)
        if step >= after and canary and np.isfinite(r["canary_fingerprint"]).all():
            r["canary_fingerprint"][faulty] += 1
        if step >= after and outlier:
            r["grad_norm_local"][faulty] *= 3

    return fault


HOSTS = RunInfo(tp=4, hosts=("a", "a", "a", "a", "b", "b", "b", "b"))


def _on(hosts: RunInfo, views):
    return (replace(v, run=hosts) for v in views)


def test_replica_blames_the_member_the_canary_names_and_not_its_receivers() -> None:
    # dp=2 x tp=4: rank 1 is faulty; rank 5 (tp index 1 of group 1) only sums its gradients.
    views = fleet(60, ranks=8, tp=4, fault=_layout(tp=4, faulty=1, after=30))
    alerts = run_all(sdc_detectors(), _on(HOSTS, views))
    (replica,) = [a for a in alerts if a.kind == "sdc_replica"]
    assert (replica.step, replica.rank) == (30, 1)
    assert "rank 1 on a (its SDC canary disagrees" in replica.message
    assert "rank 5 on b (tp index 1 of replica group 1) differs too only because" in replica.message
    assert "not at fault" in replica.message


def test_replica_without_a_named_member_blames_no_group() -> None:
    views = fleet(60, ranks=8, tp=4, fault=_layout(tp=4, faulty=1, after=30, canary=False))
    (replica,) = run(ReplicaDetector(), _on(HOSTS, views))
    assert replica.rank is None and "ranks 1 on a, 5 on b (tp index 1" in replica.message
    assert "none is blamed" in replica.message
    assert "differs from the majority" not in replica.message


def test_replica_names_the_culprit_once_the_canary_finds_it() -> None:
    # The copies drift at step 30, the canary only catches the unit at step 40.
    fault = _layout(tp=4, faulty=1, after=30, canary=False)

    def later_canary(step: int, cols: dict) -> None:
        fault(step, cols)
        if step >= 40 and step % 10 == 0:
            cols["ranks"]["canary_fingerprint"][1] += 1

    alerts = run_all(sdc_detectors(), fleet(60, ranks=8, tp=4, fault=later_canary))
    replica = [(a.step, a.rank) for a in alerts if a.kind == "sdc_replica"]
    assert replica == [(30, None), (40, 1)]


def test_a_persistent_peer_outlier_names_the_member_of_split_pairs() -> None:
    # dp=4 x tp=2: every group is a pair, so the fingerprints alone name nobody; rank 3's
    # gradient norm stands apart from its data-parallel peers (ranks 1, 5, 7) from step 100.
    fault = _layout(tp=2, faulty=3, after=100, canary=False, outlier=True)
    alerts = run_all(sdc_detectors(), fleet(160, ranks=8, tp=2, seed=1, fault=fault))
    kinds = [(a.kind, a.rank) for a in alerts]
    assert ("sdc_outlier", 3) in kinds
    blamed = [a for a in alerts if a.kind == "sdc_replica" and a.rank is not None]
    assert blamed and blamed[0].rank == 3
    assert "a persistent outlier among its data-parallel peers" in blamed[0].message
    assert "ranks 1, 5, 7 (tp index 1 of replica groups 0, 2, 3)" in blamed[0].message
    unblamed = [a for a in alerts if a.kind == "sdc_replica" and a.rank is None]
    assert all("none is blamed" in a.message for a in unblamed)


def test_peer_outlier_settings_name_the_bad_field() -> None:
    with pytest.raises(ValueError, match=r"peer_outlier\.min_hits must be in \[1, window=10\]"):
        PeerOutlierSettings(min_hits=11)
    with pytest.raises(ValueError, match=r"peer_outlier\.min_ratio must be > 1"):
        PeerOutlierSettings(min_ratio=1.0)
    stricter = PeerOutlierDetector(PeerOutlierSettings(min_hits=10))
    fault = _layout(tp=1, faulty=3, after=100, canary=False, outlier=True)
    assert run(stricter, fleet(108, ranks=8, seed=1, fault=fault)) == []  # 8 hits, not 10
    assert run(PeerOutlierDetector(), fleet(108, ranks=8, seed=1, fault=fault)) != []


def test_without_tensor_parallelism_each_disagreeing_group_is_its_own() -> None:
    # tp = 1: gradients reach every replica alike, so two groups that disagree hold two
    # faults, one each: both outvoted members are named (no canary needed).
    def fault(step: int, cols: dict) -> None:
        if step >= 30 and step % 10 == 0:
            cols["ranks"]["replica_fingerprint"][[2, 5]] += 1

    (alert,) = run(ReplicaDetector(), fleet(40, ranks=8, replica_groups=2, fault=fault))
    assert alert.rank == 2 and "none is blamed" not in alert.message
    assert "rank 2 holds a copy that differs from the majority of replica group 0" in alert.message
    assert "rank 5 holds a copy that differs from the majority of replica group 1" in alert.message
