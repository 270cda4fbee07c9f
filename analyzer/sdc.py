"""Silent data corruption: a rank computing wrong numbers without crashing.

Three signals, three detectors, three alert kinds:
- `sdc` (CanaryDetector): every rank runs the same fixed computation on a canary step and
  reports a fingerprint of the result's bits (hooks/canary.py). Healthy identical devices
  agree bit for bit, so a strict majority names the faulty ranks.
- `sdc_replica` (ReplicaDetector): ranks of one replica_group must hold identical
  parameters and report their fingerprint; within each group the majority fingerprint
  wins and the minority is named. This sees corruption that already reached the weights.
- `sdc_outlier` (PeerOutlierDetector): a rank whose local gradient norm or local loss is
  a persistent robust outlier among its data-parallel peers (same model shard, different
  data: their statistics scatter, but no rank should stand apart step after step).
A corruption that changes no fingerprint and no statistic is invisible to all three.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .alerts import Alert
from .attribution import MAD_TO_SIGMA
from .detectors import data_query, name_ranks
from .rolling import RollingWindow
from .rolling import median as fast_median
from .views import StepView

_NONE = np.empty(0, dtype=np.int64)


def outvoted(values: np.ndarray, groups: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(positions outvoted by a strict majority of their group, groups split without one).

    Only finite values and groups take part. Vectorised: one sort by (group, value), then
    run lengths; a step where every group agrees costs the sort and one comparison.
    """
    ok = np.flatnonzero(np.isfinite(values) & np.isfinite(groups))
    if len(ok) < 2:
        return _NONE, _NONE
    v, g = values[ok], groups[ok]
    order = np.lexsort((v, g))
    vs, gs = v[order], g[order]
    new_group = np.r_[True, gs[1:] != gs[:-1]]
    new_run = new_group | np.r_[True, vs[1:] != vs[:-1]]
    if np.array_equal(new_run, new_group):
        return _NONE, _NONE  # every group agrees
    run_start = np.flatnonzero(new_run)
    run_len = np.diff(np.r_[run_start, len(vs)])
    group_of_run = np.cumsum(new_group[run_start]) - 1
    group_start = np.flatnonzero(new_group[run_start])
    size = np.add.reduceat(run_len, group_start)
    best = np.maximum.reduceat(run_len, group_start)
    majority = 2 * best > size
    minority_run = majority[group_of_run] & (run_len < best[group_of_run])
    positions = ok[order][np.repeat(minority_run, run_len)]
    split = gs[run_start[group_start]][~majority & (best < size)]
    return np.sort(positions), split


@dataclass
class CanaryDetector:
    """A rank whose canary fingerprint disagrees with the strict majority of all ranks.

    With two ranks, or no majority, the disagreement is reported without a culprit, once
    until a majority returns. A rank is named once; it is named again only after it has
    agreed with the majority once more (a transient fault that came back). One alert per
    step, naming every new culprit.
    Latency: the canary interval (`--canary-every`, steps between canaries).
    """

    kind: str = "sdc"
    _named: set = field(default_factory=set, repr=False)
    _split: bool = False

    def observe(self, s: StepView) -> list[Alert]:
        r = s.ranks
        if r is None:
            return []
        fp = r.canary_fingerprint
        n = int(np.isfinite(fp).sum())
        if n < 2:
            return []
        wrong, split = outvoted(fp, np.zeros(len(fp)))
        if len(split):  # no strict majority: something is wrong, nobody named
            was, self._split = self._split, True
            _, votes = np.unique(fp[np.isfinite(fp)], return_counts=True)
            return [] if was else [self._alert(s, [], n - int(votes.max()), n)]
        self._split = False
        wrong_ranks = r.rank[wrong].tolist()
        self._named &= set(wrong_ranks)
        new = [x for x in wrong_ranks if x not in self._named]
        self._named.update(new)
        return [self._alert(s, new, len(wrong_ranks), n)] if new else []

    def _alert(self, s: StepView, ranks: list[int], n_wrong: int, n_ranks: int) -> Alert:
        who = f"{name_ranks(ranks)}'s" if ranks else "the ranks'"
        return Alert.at(
            s,
            kind=self.kind,
            severity="critical",
            message=(
                f"{who} SDC canary fingerprint disagrees with the majority at step {s.step} "
                f"({n_wrong} of {n_ranks} ranks differ"
                + ("" if ranks else "; no strict majority")
                + "): its device computes wrong numbers; drain the node and rerun the steps "
                "since its last agreeing canary. Data: "
                + data_query(s.run_id, "ranks", "canary_fingerprint", s.step, s.step)
            ),
            rank=ranks[0] if ranks else None,
        )


@dataclass
class ReplicaDetector:
    """Within each replica_group, the ranks whose replica fingerprint the majority outvotes.

    Groups of two that disagree, or any group without a strict majority, are reported
    without a culprit. Like the canary: a rank is named once per episode.
    """

    kind: str = "sdc_replica"
    _named: set = field(default_factory=set, repr=False)
    _split: set = field(default_factory=set, repr=False)

    def observe(self, s: StepView) -> list[Alert]:
        r = s.ranks
        if r is None or not np.isfinite(r.replica_fingerprint).any():
            return []
        wrong, split = outvoted(r.replica_fingerprint, r.replica_group)
        wrong_ranks = r.rank[wrong].tolist()
        self._named &= set(wrong_ranks)
        new = [x for x in wrong_ranks if x not in self._named]
        self._named.update(new)
        split_groups = {int(g) for g in split}
        new_split = sorted(split_groups - self._split)
        self._split = split_groups
        if not new and not new_split:
            return []
        parts = []
        if new:
            groups = sorted({int(g) for g in r.replica_group[wrong]})
            parts.append(
                f"{name_ranks(new)} hold{'s' if len(new) == 1 else ''} parameters that differ "
                f"from the majority of {'its' if len(new) == 1 else 'their'} replica group"
                f"{'s' if len(groups) > 1 else ''} {', '.join(map(str, groups[:8]))} at step "
                f"{s.step}: silent corruption in its arithmetic or memory (or a missed update)"
                "; drain the node and restore the replica from a healthy peer"
            )
        if new_split:
            parts.append(
                f"replica group{'s' if len(new_split) > 1 else ''} "
                f"{', '.join(map(str, new_split[:8]))} disagree without a strict majority: "
                "some member is corrupt, which one the fingerprints cannot tell"
            )
        return [
            Alert.at(
                s,
                kind=self.kind,
                severity="critical",
                message="; ".join(parts)
                + ". Data: "
                + data_query(s.run_id, "ranks", "replica_fingerprint", s.step, s.step),
                rank=new[0] if new else None,
            )
        ]


@dataclass
class _Signal:
    """Per-rank hit history of one signal: a ring of the last `window` steps' hits."""

    ranks: np.ndarray
    window: int
    spread_window: int
    hits: np.ndarray = field(init=False)
    count: np.ndarray = field(init=False)
    spread: RollingWindow = field(init=False)
    pos: int = 0

    def __post_init__(self) -> None:
        self.hits = np.zeros((self.window, len(self.ranks)), dtype=bool)
        self.count = np.zeros(len(self.ranks), dtype=np.int64)
        self.spread = RollingWindow(self.spread_window)

    def push(self, hit: np.ndarray) -> None:
        self.count -= self.hits[self.pos]
        self.hits[self.pos] = hit
        self.count += hit
        self.pos = (self.pos + 1) % self.window


@dataclass
class PeerOutlierDetector:
    """A rank whose local gradient norm or local loss persistently stands apart from its
    data-parallel peers (same tp index: same model shard, different data).

    Each step, for each signal: d = log(value / peers' median) (views.peer_deviation) and
    the step's spread, the median |d| over ranks. A rank hits when |d| exceeds
    `z_threshold` x 1.4826 x the median spread of the last `spread_window` steps *and* a
    factor `min_ratio`; it is named when it hit in at least `min_hits` of the last
    `window` logged steps. Peers' data differ, so one-off outliers are common and harmless;
    only persistence names a rank. Needs at least `min_peers` peers (with two, either
    could be the odd one). Re-armed once the rank has a whole window without a hit.
    Per step: O(ranks), vectorised.
    """

    signals: tuple[str, ...] = ("grad_norm_local", "loss")
    window: int = 10
    min_hits: int = 8
    z_threshold: float = 6.0
    min_ratio: float = 1.3
    min_peers: int = 3
    spread_window: int = 50
    min_history: int = 10
    kind: str = "sdc_outlier"
    _state: dict = field(default_factory=dict, repr=False)
    _flagged: np.ndarray = field(default_factory=lambda: np.zeros(0, bool), repr=False)

    def __post_init__(self) -> None:
        if not 1 <= self.min_hits <= self.window or self.min_peers < 3:
            raise ValueError("PeerOutlierDetector: need 1 <= min_hits <= window, min_peers >= 3")
        if self.z_threshold <= 0 or self.min_ratio <= 1:
            raise ValueError("PeerOutlierDetector: z_threshold must be > 0, min_ratio > 1")

    def observe(self, s: StepView) -> list[Alert]:
        r = s.ranks
        if r is None or not len(r):
            return []
        if len(self._flagged) != len(r):
            self._state.clear()
            self._flagged = np.zeros(len(r), bool)
        suspect = np.zeros(len(r), bool)
        active = np.zeros(len(r), bool)
        evidence = {}
        for name in self.signals:
            st = self._state.get(name)
            if st is None or not np.array_equal(st.ranks, r.rank):
                st = self._state[name] = _Signal(r.rank.copy(), self.window, self.spread_window)
            d, peers = r.peer_deviation(name)
            eligible = (peers >= self.min_peers) & np.isfinite(d)
            if eligible.any():  # else a step without this signal: the history stands
                absd = np.abs(np.where(eligible, d, 0.0))
                hit = np.zeros(len(r), bool)
                if len(st.spread) >= self.min_history:
                    bar = max(
                        self.z_threshold * MAD_TO_SIGMA * st.spread.median(),
                        math.log(self.min_ratio),
                    )
                    hit = eligible & (absd > bar)
                st.spread.push(fast_median(absd[eligible]))
                st.push(hit)
            suspect |= st.count >= self.min_hits
            active |= st.count > 0
            if eligible.any():
                evidence[name] = (d, st.count)
        new = suspect & ~self._flagged
        self._flagged = suspect | (self._flagged & active)
        if not new.any():
            return []
        where = np.flatnonzero(new)
        first = int(where[0])
        lines = []
        for name, (d, count) in evidence.items():
            if count[first] >= self.min_hits:
                lines.append(
                    f"{name} {math.exp(d[first]):.2f}x its peers' median at step {s.step}, "
                    f"outlying in {count[first]} of the last {self.window} logged steps"
                )
        ids = r.rank[where].tolist()
        # A count reaches min_hits only on a step that carried its signal: one is here.
        signal = next(n for n, (_, c) in evidence.items() if c[first] >= self.min_hits)
        return [
            Alert.at(
                s,
                kind=self.kind,
                severity="warning",
                message=(
                    f"{name_ranks(ids)} persistently stand{'s' if len(ids) == 1 else ''} apart "
                    f"from {'its' if len(ids) == 1 else 'their'} data-parallel peers: rank "
                    f"{ids[0]}'s {'; '.join(lines)}. Peers hold the same model shard, so this "
                    "points at the rank's device (SDC) or its data; check its canary. Data: "
                    + data_query(s.run_id, "ranks", signal, s.step - self.window, s.step)
                ),
                value=math.exp(evidence[signal][0][first]),
                baseline=1.0,
                rank=ids[0],
            )
        ]
