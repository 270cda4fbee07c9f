"""Replica fingerprints: which member of a disagreeing replica group is corrupt.

Ranks of one replica_group must hold identical copies of some parameters (hooks/replica.py)
and report a fingerprint of them; a strict majority of a group outvotes a member
(`outvoted`, which the canary's vote uses too). Which member is to blame is a separate
question, because a corrupt rank's gradients also corrupt its data-parallel peers' copies:
ReplicaDetector reads the ranks that the canary and the peer outliers name (`Suspects`,
sdc.py) to tell the source from the receivers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from .alerts import Alert
from .detectors import data_query
from .runinfo import RunInfo, name_rank, name_ranks
from .views import StepView

_NONE = np.empty(0, dtype=np.int64)
# How the Suspects board says who named a rank (ReplicaDetector quotes it).
CANARY = "its SDC canary disagrees with the majority"
PEERS = "a persistent outlier among its data-parallel peers"


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
class Suspects:
    """Ranks that the canary or the peer outliers name at present, by signal.

    One run's three SDC detectors share one board (see `sdc_detectors`): the canary and
    the peer-outlier detectors write what they currently find, and the replica detector
    reads it to tell the corrupt member of a replica group from the members that only
    received its corrupted gradients.
    """

    by_signal: dict[str, frozenset[int]] = field(default_factory=dict)

    def set(self, signal: str, ranks: list[int]) -> None:
        self.by_signal[signal] = frozenset(ranks)

    def named(self) -> dict[int, str]:
        """rank -> the signal that names it (the first, when several do)."""
        out: dict[int, str] = {}
        for signal, ranks in self.by_signal.items():
            for rank in ranks:
                out.setdefault(rank, signal)
        return out


@dataclass(frozen=True)
class ReplicaSettings:
    """Section `replica`: nothing to tune. Copies of one parameter agree bit for bit or
    not at all; a strict majority of a replica group outvotes a member, and which member
    is corrupt comes from the canary and the peer outliers (see ReplicaDetector)."""


@dataclass
class ReplicaDetector:
    """Replica groups whose members' parameter fingerprints disagree, and who is to blame.

    Which member is corrupt. Under FSDP x TP (trainer/parallel.py) a replica group is one
    data-parallel index: its members, one per tp index, hold the same shard of the
    tp-replicated weights (hooks/replica.py). A member's copy changes with the gradients
    reduced over its data-parallel peers, the ranks with its tp index in every other
    group. So a rank that computes wrong numbers corrupts its own copy *and*, through that
    reduction, the copy of the member at its tp index in every other group: those
    received the corruption, they are not its source. Hence:
    - a disagreeing member that the canary or the peer outliers name (`Suspects`) is the
      corrupt one; members of other groups at its tp index are named as receivers;
    - otherwise, members that disagree at the same tp index in several groups could each
      be the source: none is blamed, the alert says the fingerprints cannot tell;
    - a disagreement in one group only is that group's own: a strict majority names the
      outvoted members; a group without one (a pair) is reported without a culprit.
    Like the canary, each culprit and each unexplained disagreement is reported once per
    episode (until it agrees again); a culprit identified later gets an alert then.
    """

    settings: ReplicaSettings = field(default_factory=ReplicaSettings)
    suspects: Suspects = field(default_factory=Suspects)
    kind: ClassVar[str] = "sdc_replica"
    _named: set = field(default_factory=set, repr=False)  # culprits reported
    _reported: set = field(default_factory=set, repr=False)  # unexplained disagreements

    def observe(self, s: StepView) -> list[Alert]:
        r = s.ranks
        if r is None or not np.isfinite(r.replica_fingerprint).any():
            return []
        wrong, split = outvoted(r.replica_fingerprint, r.replica_group)
        disputed = np.zeros(len(r), bool)
        disputed[wrong] = True
        disputed |= np.isin(r.replica_group, split) & np.isfinite(r.replica_fingerprint)
        # The path a rank's gradients take into other groups' copies: its tp index (global
        # rank = dp_index * tp + tp_index). Without tensor parallelism a gradient
        # reduction reaches every replica alike and makes none disagree: each rank is a
        # path of its own, so every disagreement is its group's own.
        path = r.rank % r.tp if r.tp > 1 else r.rank
        blame = _blame(
            r.rank,
            r.replica_group,
            path,
            disputed,
            {int(g) for g in split},
            self.suspects.named(),
        )
        self._named &= set(blame.culprits)
        new = [x for x in blame.culprits if x not in self._named]
        self._named.update(new)
        keys = blame.unexplained_keys()
        fresh = keys - self._reported
        self._reported = keys
        if not new and not fresh:
            return []
        outvoted_ranks = set(r.rank[wrong].tolist())
        parts = [blame.describe_culprits(s.run, new)] if new else []
        parts += blame.describe_unexplained(s.run, fresh, outvoted_ranks)
        local = [x for x in blame.local_ranks if x in outvoted_ranks]
        return [
            Alert.at(
                s,
                kind=self.kind,
                severity="critical",
                message=f"replica fingerprints disagree at step {s.step}: "
                + "; ".join(parts)
                + ". Data: "
                + data_query(s.run_id, "ranks", "replica_fingerprint", s.step, s.step),
                rank=new[0] if new else (local[0] if local else None),
            )
        ]


@dataclass
class _Blame:
    """Who a step's replica disagreements point at (see ReplicaDetector)."""

    culprits: list[int]  # disagreeing members the canary or peer outliers name
    why: dict[int, str]  # culprit -> the signal naming it
    receivers: dict[int, list[int]]  # culprit -> members that summed its gradients
    local_ranks: list[int]  # disagreeing members no other group disagrees with on their path
    local_groups: list[int]  # their groups
    ambiguous: dict[int, list[int]]  # path -> disagreeing members on it, in several groups
    group_of: dict[int, int]  # rank -> replica group, for the ranks above
    tp_of: dict[int, int]  # rank -> its path: the tp index (the rank itself when tp = 1)

    def unexplained_keys(self) -> set:
        return {("group", g) for g in self.local_groups} | {("tp", p) for p in self.ambiguous}

    def describe_culprits(self, run: RunInfo, new: list[int]) -> str:
        lines = []
        for c in new:
            line = (
                f"{name_rank(run, c)} ({self.why[c]}) holds a corrupt copy of replica group "
                f"{self.group_of[c]}'s parameters: the corruption is its own, drain its node"
            )
            if got := self.receivers.get(c):
                groups = sorted({self.group_of[x] for x in got})
                one = len(got) == 1
                line += (
                    f"; {name_ranks(run, got)} (tp index {self.tp_of[c]} of replica group"
                    f"{'' if len(groups) == 1 else 's'} {_listed(groups)}) "
                    f"{'differs' if one else 'differ'} too only because "
                    f"{'it sums' if one else 'they sum'} rank {c}'s gradients in "
                    f"the data-parallel reduction: {'it' if one else 'they'} received the "
                    f"corruption, {'its' if one else 'their'} own device is not at fault; "
                    f"restore {'its copy' if one else 'their copies'} from a healthy replica"
                )
            lines.append(line)
        return "; ".join(lines)

    def describe_unexplained(self, run: RunInfo, keys: set, outvoted: set) -> list[str]:
        parts = []
        positions = sorted(k[1] for k in keys if k[0] == "tp")
        if positions:
            members = sorted(x for p in positions for x in self.ambiguous[p])
            groups = sorted({self.group_of[x] for x in members})
            parts.append(
                f"{name_ranks(run, members)} (tp index{'es' if len(positions) > 1 else ''} "
                f"{_listed(positions)} of replica groups {_listed(groups)}) disagree with "
                "their groups: one rank's corruption reaches the member at its tp index in "
                "every group through the data-parallel gradient reduction, so the "
                "fingerprints cannot tell which group holds the source and none is blamed; "
                "the SDC canary or the peer outliers can tell (none names a rank yet)"
            )
        for g in sorted(k[1] for k in keys if k[0] == "group"):
            members = [
                x for x, gx in zip(self.local_ranks, self.local_groups, strict=True) if gx == g
            ]
            named = [x for x in members if x in outvoted]
            if named:
                parts.append(
                    f"{name_ranks(run, named)} hold{'s' if len(named) == 1 else ''} a copy "
                    f"that differs from the majority of replica group {g}: silent corruption "
                    "in its arithmetic or memory (or a missed update); drain the node and "
                    "restore the replica from a healthy peer"
                )
            else:
                parts.append(
                    f"replica group {g} ({name_ranks(run, members)}) disagrees without a "
                    "strict majority: one of its members is corrupt, which one the "
                    "fingerprints cannot tell"
                )
        return parts


def _blame(
    ranks: np.ndarray,
    groups: np.ndarray,
    tp_index: np.ndarray,
    disputed: np.ndarray,
    split: set[int],
    named: dict[int, str],
) -> _Blame:
    """Sort the disagreeing members into culprits, receivers and unexplained ones.

    Python work only over the disagreeing members (a handful): a step without any costs
    nothing here.
    """
    members = [(int(ranks[i]), int(groups[i]), int(tp_index[i])) for i in np.flatnonzero(disputed)]
    group_of = {x: g for x, g, _ in members}
    tp_of = {x: p for x, _, p in members}
    culprits = [x for x, _, _ in members if x in named]
    receivers: dict[int, list[int]] = {c: [] for c in culprits}
    for x, g, p in members:
        source = next((c for c in culprits if tp_of[c] == p and group_of[c] != g), None)
        if source is not None and x not in receivers:
            receivers[source].append(x)
    # A group without a majority has every member in dispute: one culprit or receiver
    # among them explains the whole split.
    explained = set(culprits).union(*receivers.values())
    explained_splits = {group_of[x] for x in explained} & split
    rest = [(x, g, p) for x, g, p in members if x not in explained and g not in explained_splits]
    groups_at: dict[int, set] = {}
    for _, g, p in rest:
        groups_at.setdefault(p, set()).add(g)
    ambiguous: dict[int, list[int]] = {}
    local_ranks, local_groups = [], []
    for x, g, p in rest:
        if len(groups_at[p]) > 1:
            ambiguous.setdefault(p, []).append(x)
        else:
            local_ranks.append(x)
            local_groups.append(g)
    return _Blame(
        culprits=culprits,
        why={c: named[c] for c in culprits},
        receivers={c: got for c, got in receivers.items() if got},
        local_ranks=local_ranks,
        local_groups=local_groups,
        ambiguous=ambiguous,
        group_of=group_of,
        tp_of=tp_of,
    )


def _listed(values: list[int], limit: int = 8) -> str:
    more = f" and {len(values) - limit} more" if len(values) > limit else ""
    return ", ".join(map(str, values[:limit])) + more
