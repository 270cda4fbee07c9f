"""What a detector emits: an alert with its evidence."""

from __future__ import annotations

from dataclasses import asdict, dataclass


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

    def to_dict(self) -> dict:
        return asdict(self)
