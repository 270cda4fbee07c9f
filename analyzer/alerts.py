"""What a detector emits: an alert with its evidence."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Alert:
    """One detected event. Field names match the store's `alerts` table (schema.ALERTS)."""

    run_id: str
    step: int
    kind: str
    severity: str  # "warning" or "critical"
    message: str
    time_unix_s: float
    value: float | None = None
    baseline: float | None = None
    rank: int | None = None
    layer: int | None = None

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

    def to_dict(self) -> dict:
        return asdict(self)
