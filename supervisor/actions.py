"""From an alert to a plan: which node to fence, which checkpoint to roll back to, which data
to skip; and the limits that keep a false alarm from taking a job down again and again.

Pure decisions with an injected clock; agent.py carries them out.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from .alerts import Alert
from .policy import (
    FENCE_RESUME,
    FENCE_ROLLBACK,
    RERUN,
    RESPONSES,
    ROLLBACK,
    KindPolicy,
    Limits,
)


@dataclass(frozen=True)
class Plan:
    alert: Alert
    response: str
    node: str | None  # to fence; None: fence nothing
    rollback_at_most_step: int | None  # newest checkpoint to keep; None: the latest
    skip_data: bool

    def describe(self) -> str:
        parts = ["re-run the step on other ranks to tell data from hardware"]
        if self.response != RERUN:
            parts = []
        if self.node:
            parts.append(f"fence {self.node}" + (" if hardware" if self.response == RERUN else ""))
        if self.rollback_at_most_step is None:
            parts.append("resume from the latest checkpoint")
        elif self.rollback_at_most_step < 0:
            parts.append("restart from scratch (no checkpoint is clean)")
        else:
            parts.append(
                f"roll back to the last checkpoint at or before step {self.rollback_at_most_step}"
            )
        if self.skip_data:
            parts.append("skip the data the diverged run trained on after it")
        return ", ".join(parts)


def node_of(rank: int, nodes: list[str], nproc_per_node: int) -> str | None:
    """The node a global rank ran on, in a launch on `nodes` (static rendezvous order)."""
    i = rank // nproc_per_node
    return nodes[i] if rank >= 0 and i < len(nodes) else None


def plan(
    alert: Alert,
    kind_policy: KindPolicy,
    nodes: list[str],
    nproc_per_node: int,
    canary_steps: list[int] | None = None,
) -> Plan:
    """What to do about `alert`, raised by a launch on `nodes`. ValueError when the alert
    lacks what its response needs (a rank to fence)."""
    response = RESPONSES[alert.kind]
    node = None
    if response in (FENCE_RESUME, FENCE_ROLLBACK):
        if alert.rank is None:
            raise ValueError(f"{alert.kind} at step {alert.step} names no rank: no node to fence")
        node = node_of(alert.rank, nodes, nproc_per_node)
        if node is None:
            raise ValueError(f"{alert.kind} names rank {alert.rank}, not a rank of {nodes}")
    elif response == RERUN and alert.rank is not None:  # the suspect, if the re-run says so
        node = node_of(alert.rank, nodes, nproc_per_node)
    at_most = None
    if response == FENCE_ROLLBACK:
        at_most = clean_before_sdc(alert, canary_steps or [])
    elif response == ROLLBACK:
        at_most = alert.onset_step - 1  # the onset is the last healthy step: before it
    elif response == RERUN:
        at_most = alert.step - 1  # the weights the step started from
    return Plan(alert, response, node, at_most, kind_policy.skip_data and response == ROLLBACK)


def clean_before_sdc(alert: Alert, canary_steps: list[int]) -> int:
    """The newest step whose state is known clean: the last canary that ran before the
    first evidence (the corruption began after it). Without one, nothing is known clean
    (-1: start from scratch). The checkpoint of a step holds its state after the step."""
    earlier = [s for s in canary_steps if s < alert.onset_step]
    return earlier[-1] if earlier else -1


class Limiter:
    """At most `max_restarts_per_hour` actions in any hour, `cooldown_s` apart."""

    def __init__(self, limits: Limits, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits, self.clock = limits, clock
        self.times: deque[float] = deque()

    def refusal(self) -> str | None:
        """Why an action now is refused, or None when it is allowed."""
        now = self.clock()
        while self.times and now - self.times[0] >= 3600:
            self.times.popleft()
        if len(self.times) >= self.limits.max_restarts_per_hour:
            return (
                f"{len(self.times)} restarts in the last hour, the policy's "
                f"limits.max_restarts_per_hour"
            )
        if self.times and now - self.times[-1] < self.limits.cooldown_s:
            return (
                f"{now - self.times[-1]:.0f} s since the last action, within the policy's "
                f"limits.cooldown_s {self.limits.cooldown_s:g}"
            )
        return None

    def record(self) -> None:
        self.times.append(self.clock())


# A re-run reproduces the step when its loss is within this fraction of the stored one: the
# same batch and weights on another dp layout differ by float rounding only (3e-8 measured
# on the reference trainer, dp 2 -> 1), a faulty unit's spike by far more.
RERUN_REL_TOL = 0.02


def classify(stored: float | None, rerun: float | None) -> str:
    """'data' when the re-run reproduces the stored loss (both non-finite counts), else
    'hardware'; 'unknown' when the re-run gave no loss. None or NaN: non-finite (the
    collector's client gives None for a stored loss that is not finite)."""
    if rerun is None:
        return "unknown"
    bad_stored = stored is None or not math.isfinite(stored)
    if bad_stored or not math.isfinite(rerun):
        return "data" if bad_stored and not math.isfinite(rerun) else "hardware"
    return "data" if abs(rerun - stored) <= RERUN_REL_TOL * abs(stored) else "hardware"
