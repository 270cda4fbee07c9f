"""Ranks missing from a step: a node whose leader's rows did not arrive.

Per-rank rows travel per node (hooks/topology.py): rank 0 sends the steps row with its
own node's ranks, every other node's leader sends its node's ranks on its own. A step that
has ranks rows, but fewer than the run's world size, lost a node's export (its leader
crashed or hung, its spool is full, its network is down), and every per-rank detector
(stragglers, SDC peers, stalls) is blind to those ranks for that step: a finding of its
own. A step with no ranks rows at all is a producer that does not send them (an import of
steps alone, an older exporter), not a gap.

One alert when ranks go missing (the episode's start), one "resolved" row when a step is
whole again. The live driver waits for a step's ranks up to a deadline before it analyses
the step without them (live.py); replay sees what the store holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from .alerts import Alert
from .runinfo import name_ranks
from .views import RunEvent, StepView


@dataclass
class MissingRanksDetector:
    """Steps whose ranks rows cover only part of the world (module docstring)."""

    kind: ClassVar[str] = "ranks_missing"
    _start: int | None = None  # first step of the running episode
    _rank: int | None = None  # the first rank it found missing (names the episode)
    # The ranks of the launch since the last restart that said (0: the runs row's). A
    # relaunch on fewer nodes has fewer ranks; the store keeps the run's first runs row.
    _world: int = 0

    def observe_events(self, events: list[RunEvent]) -> None:
        for e in events:
            if e.kind == "restart" and e.world_size:
                self._world = e.world_size

    def observe(self, s: StepView) -> list[Alert]:
        world = self._world or s.run.world_size
        if not world or s.ranks is None or len(s.ranks) == 0:
            return []
        present = np.zeros(world, bool)
        ranks = s.ranks.rank
        present[ranks[(ranks >= 0) & (ranks < world)]] = True
        missing = np.flatnonzero(~present)
        if len(missing) and self._start is None:
            self._start, self._rank = s.step, int(missing[0])
            return [
                Alert.at(
                    s,
                    self.kind,
                    "warning",
                    f"{len(missing)} of {world} ranks sent no telemetry for step {s.step} "
                    f"({name_ranks(s.run, missing.tolist())}): their node's export did not "
                    "arrive, and per-rank detectors cannot see them",
                    value=float(len(missing)),
                    baseline=float(world),
                    rank=self._rank,
                )
            ]
        if not len(missing) and self._start is not None:
            start, self._start = self._start, None
            return [
                Alert.at(
                    s,
                    self.kind,
                    "resolved",
                    f"every rank's telemetry arrives again (missing since step {start})",
                    rank=self._rank,
                    start_step=start,
                )
            ]
        return []
