"""What a detector emits: an alert with its evidence, and the row that ends an episode."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

RESOLVED = "resolved"  # severity of the row that ends an episode
# Kinds whose alert opens an episode that stays active until a "resolved" row of the same
# kind and rank ends it (the others are one-off events: a spike, a fingerprint mismatch).
EPISODE_KINDS = frozenset(
    {"straggler", "intermittent_straggler", "rank_lost", "hang", "loss_diverging", "ranks_missing"}
)


@dataclass(frozen=True)
class Alert:
    """One detected event. Field names match the store's `alerts` table (schema.ALERTS).

    Episodes (a straggler, a hang, a lost rank, a divergence) raise one alert when they are
    detected, with `start_step` at their onset, and one row of severity "resolved" (same
    kind, rank and start_step) when they end: `/metrics` keeps the episode active in
    between, which is what the Prometheus rules fire on.
    """

    run_id: str
    step: int
    kind: str
    severity: str  # "warning", "critical" or "resolved"
    message: str
    time_unix_s: float
    value: float | None = None
    baseline: float | None = None
    rank: int | None = None
    layer: int | None = None
    start_step: int | None = None  # onset of the episode, when before `step`

    @classmethod
    def at(cls, step: Any, kind: str, severity: str, message: str, **evidence: Any) -> Alert:
        """An alert about `step` (a StepView): run, step and time come from it."""
        return cls(
            run_id=step.run_id,
            step=step.step,
            kind=kind,
            severity=severity,
            message=message,
            time_unix_s=step.time_unix_s,
            **evidence,
        )

    @property
    def resolves(self) -> bool:
        return self.severity == RESOLVED

    def resolved_at(self, step: int, time_unix_s: float, message: str) -> Alert:
        """The row that ends this alert's episode, at `step`."""
        return replace(
            self,
            step=step,
            severity=RESOLVED,
            message=message,
            time_unix_s=time_unix_s,
            value=None,
            start_step=self.step if self.start_step is None else self.start_step,
        )

    def to_dict(self) -> dict:
        return asdict(self)
