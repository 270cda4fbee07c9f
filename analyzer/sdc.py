"""Silent data corruption: a rank computing wrong numbers without crashing.

Three signals, three detectors, three alert kinds:
- `sdc` (CanaryDetector): every rank runs the same fixed computation on a canary step and
  reports a fingerprint of the result's bits (hooks/canary.py). Healthy identical devices
  agree bit for bit, so a strict majority names the faulty ranks.
- `sdc_replica` (ReplicaDetector): ranks of one replica_group must hold identical
  parameters and report their fingerprint. This sees corruption that already reached the
  weights; which member is to blame comes from the canary and the peer outliers, since a
  corrupt rank's gradients also corrupt the copies of its data-parallel peers.
- `sdc_outlier` (PeerOutlierDetector): a rank whose local gradient norm or local loss is
  a persistent robust outlier among its data-parallel peers (same model shard, different
  data: their statistics scatter, but no rank should stand apart step after step).
A corruption that changes no fingerprint and no statistic is invisible to all three.
`sdc_detectors()` builds the three for one run, sharing one Suspects board.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from .alerts import Alert
from .attribution import MAD_TO_SIGMA
from .detectors import data_query
from .replica import (
    CANARY,
    PEERS,
    ReplicaDetector,
    ReplicaSettings,
    Suspects,
    outvoted,
)
from .rolling import RollingWindow
from .rolling import median as fast_median
from .runinfo import name_rank, name_ranks
from .views import StepView

SIGNALS = ("grad_norm_local", "loss")  # per-rank columns the peer-outlier test watches


def sdc_detectors(
    canary: CanarySettings | None = None,
    replica: ReplicaSettings | None = None,
    peer_outlier: PeerOutlierSettings | None = None,
) -> list:
    """One run's three SDC detectors, sharing one Suspects board, in the order that lets
    the replica detector read the canary's and the peer outliers' findings of the same
    step. None: the defaults."""
    board = Suspects()
    return [
        CanaryDetector(canary or CanarySettings(), board),
        PeerOutlierDetector(peer_outlier or PeerOutlierSettings(), board),
        ReplicaDetector(replica or ReplicaSettings(), board),
    ]


@dataclass(frozen=True)
class CanarySettings:
    """Section `canary`: nothing to tune. Healthy identical devices running the same
    kernels agree bit for bit, so any disagreement counts and a strict majority of all
    ranks names the culprits; how often the canary runs is the hooks' `canary_every`."""


@dataclass
class CanaryDetector:
    """A rank whose canary fingerprint disagrees with the strict majority of all ranks.

    With two ranks, or no majority, the disagreement is reported without a culprit, once
    until a majority returns. A rank is named once; it is named again only after it has
    agreed with the majority once more (a transient fault that came back). One alert per
    step, naming every new culprit.
    Latency: the canary interval (`--canary-every`, steps between canaries).
    """

    settings: CanarySettings = field(default_factory=CanarySettings)
    suspects: Suspects = field(default_factory=Suspects)
    kind: ClassVar[str] = "sdc"
    _named: set = field(default_factory=set, repr=False)
    _split: bool = False

    def observe(self, s: StepView) -> list[Alert]:
        r = s.ranks
        if r is None:
            return []
        fp = r.canary_fingerprint
        n = int(np.isfinite(fp).sum())
        if n < 2:
            return []  # not a canary step: the last verdict stands
        wrong, split = outvoted(fp, np.zeros(len(fp)))
        if len(split):  # no strict majority: something is wrong, nobody named
            self.suspects.set(CANARY, [])
            was, self._split = self._split, True
            _, votes = np.unique(fp[np.isfinite(fp)], return_counts=True)
            return [] if was else [self._alert(s, [], n - int(votes.max()), n)]
        self._split = False
        wrong_ranks = r.rank[wrong].tolist()
        self.suspects.set(CANARY, wrong_ranks)
        self._named &= set(wrong_ranks)
        new = [x for x in wrong_ranks if x not in self._named]
        self._named.update(new)
        return [self._alert(s, new, len(wrong_ranks), n)] if new else []

    def _alert(self, s: StepView, ranks: list[int], n_wrong: int, n_ranks: int) -> Alert:
        who = f"{name_ranks(s.run, ranks)}:" if ranks else "the ranks'"
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


@dataclass(frozen=True)
class PeerOutlierSettings:
    """Thresholds of the peer-outlier detector (section `peer_outlier`). Windows count
    logged steps; deviations are log(value / peers' median), so ratios, not units."""

    # A rank is named when it stood out in `min_hits` of its last `window` logged steps:
    # peers see different data, so one-off outliers are common and harmless; 8 of 10 is
    # persistence that a bad batch does not produce.
    window: int = 10
    min_hits: int = 8
    # A step stands out when |d| exceeds `z_threshold` robust standard deviations of the
    # step-to-step spread of d over ranks...
    z_threshold: float = 6.0
    # ... and the value is at least this factor away from its peers' median (either way):
    # a fleet whose spread is tiny would otherwise name ranks for noise.
    min_ratio: float = 1.3
    # Data-parallel peers (same tp index) a rank needs, itself included: with two, either
    # could be the odd one.
    min_peers: int = 3
    # Logged steps of the spread history; at least `min_history` of them before judging.
    spread_window: int = 50
    min_history: int = 10

    def __post_init__(self) -> None:
        for name in ("window", "spread_window", "min_history"):
            if getattr(self, name) < 1:
                raise ValueError(f"peer_outlier.{name} must be >= 1, got {getattr(self, name)}")
        if not 1 <= self.min_hits <= self.window:
            raise ValueError(
                f"peer_outlier.min_hits must be in [1, window={self.window}], got {self.min_hits}"
            )
        if self.min_peers < 3:
            raise ValueError(f"peer_outlier.min_peers must be >= 3, got {self.min_peers}")
        if not self.z_threshold > 0:
            raise ValueError(f"peer_outlier.z_threshold must be > 0, got {self.z_threshold}")
        if not self.min_ratio > 1:
            raise ValueError(f"peer_outlier.min_ratio must be > 1, got {self.min_ratio}")


@dataclass
class PeerOutlierDetector:
    """A rank whose local gradient norm or local loss (SIGNALS) persistently stands apart
    from its data-parallel peers (same tp index: same model shard, different data).

    Each step, for each signal: d = log(value / peers' median) (views.peer_deviation) and
    the step's spread, the median |d| over ranks. A rank hits when |d| exceeds
    `z_threshold` x 1.4826 x the median spread of the last `spread_window` steps *and* a
    factor `min_ratio`; it is named when it hit in at least `min_hits` of the last
    `window` logged steps. Re-armed once the rank has a whole window without a hit.
    Per step: O(ranks), vectorised.
    """

    settings: PeerOutlierSettings = field(default_factory=PeerOutlierSettings)
    suspects: Suspects = field(default_factory=Suspects)
    kind: ClassVar[str] = "sdc_outlier"
    _state: dict = field(default_factory=dict, repr=False)
    _flagged: np.ndarray = field(default_factory=lambda: np.zeros(0, bool), repr=False)

    def observe(self, s: StepView) -> list[Alert]:
        cfg = self.settings
        r = s.ranks
        if r is None or not len(r):
            return []
        if len(self._flagged) != len(r):
            self._state.clear()
            self._flagged = np.zeros(len(r), bool)
        suspect = np.zeros(len(r), bool)
        active = np.zeros(len(r), bool)
        evidence = {}
        for name in SIGNALS:
            st = self._state.get(name)
            if st is None or not np.array_equal(st.ranks, r.rank):
                st = self._state[name] = _Signal(r.rank.copy(), cfg.window, cfg.spread_window)
            d, peers = r.peer_deviation(name)
            eligible = (peers >= cfg.min_peers) & np.isfinite(d)
            if eligible.any():  # else a step without this signal: the history stands
                absd = np.abs(np.where(eligible, d, 0.0))
                hit = np.zeros(len(r), bool)
                if len(st.spread) >= cfg.min_history:
                    bar = max(
                        cfg.z_threshold * MAD_TO_SIGMA * st.spread.median(),
                        math.log(cfg.min_ratio),
                    )
                    hit = eligible & (absd > bar)
                st.spread.push(fast_median(absd[eligible]))
                st.push(hit)
            suspect |= st.count >= cfg.min_hits
            active |= st.count > 0
            if eligible.any():
                evidence[name] = (d, st.count)
        new = suspect & ~self._flagged
        self._flagged = suspect | (self._flagged & active)
        self.suspects.set(PEERS, r.rank[self._flagged].tolist())
        if not new.any():
            return []
        where = np.flatnonzero(new)
        first = int(where[0])
        lines = []
        for name, (d, count) in evidence.items():
            if count[first] >= cfg.min_hits:
                lines.append(
                    f"{name} {math.exp(d[first]):.2f}x its peers' median at step {s.step}, "
                    f"outlying in {count[first]} of the last {cfg.window} logged steps"
                )
        ids = r.rank[where].tolist()
        # A count reaches min_hits only on a step that carried its signal: one is here.
        signal = next(n for n, (_, c) in evidence.items() if c[first] >= cfg.min_hits)
        return [
            Alert.at(
                s,
                kind=self.kind,
                severity="warning",
                message=(
                    f"{name_ranks(s.run, ids)} persistently stand{'s' if len(ids) == 1 else ''} "
                    f"apart from {'its' if len(ids) == 1 else 'their'} data-parallel peers"
                    + ("" if len(ids) == 1 else f"; {name_rank(s.run, ids[0])}")
                    + f": {'; '.join(lines)}. Peers hold the same model shard, so this "
                    "points at the rank's device (SDC) or its data; check its canary. Data: "
                    + data_query(s.run_id, "ranks", signal, s.step - cfg.window, s.step)
                ),
                value=math.exp(evidence[signal][0][first]),
                baseline=1.0,
                rank=ids[0],
            )
        ]
