"""Alerts as the supervisor reads them: from the collector's query API (polled), and the
collector's write API for the supervisor's own events.

The collector is the one source of an alert's evidence (its step, onset, rank); an
Alertmanager notification (webhook.py) only says that something fired, so the supervisor
reads the alert itself from here either way.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass
from typing import Any

import httpx

from trainvitals.schema import BatchBuilder, float_from_wire


@dataclass(frozen=True)
class Alert:
    run_id: str
    kind: str
    step: int
    severity: str
    time_unix_s: float
    message: str = ""
    rank: int | None = None
    start_step: int | None = None
    value: float | None = None

    @property
    def key(self) -> tuple:
        return (self.kind, self.step, self.rank)

    @property
    def onset_step(self) -> int:
        """The first step of the evidence: the episode's onset, else the detection step."""
        return self.step if self.start_step is None else self.start_step

    @property
    def evidence_unix_s(self) -> float:
        """When the evidence happened. A liveness alert's time is its deadline: the rank was
        last heard (rank_lost), or the job last progressed (hang), `value` seconds before."""
        if self.kind in ("rank_lost", "hang") and self.value is not None:
            return self.time_unix_s - self.value
        return self.time_unix_s

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> Alert:
        """An alert row of the collector's API (/api/v1/runs/<run>/alerts)."""
        return cls(
            run_id=str(row["run_id"]),
            kind=str(row["kind"]),
            step=int(row["step"]),
            severity=str(row["severity"]),
            time_unix_s=float(row.get("time_unix_s") or 0.0),
            message=str(row.get("message") or ""),
            rank=None if row.get("rank") is None else int(row["rank"]),
            start_step=None if row.get("start_step") is None else int(row["start_step"]),
            value=None if row.get("value") is None else float(float_from_wire(row["value"])),
        )


class CollectorClient:
    """The collector's API for one run: its alerts, progress, canary steps; and events."""

    def __init__(self, url: str, run_id: str, token: str = "", timeout_s: float = 10.0) -> None:
        self.url, self.run_id = url.rstrip("/"), run_id
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s)

    def alerts(self) -> list[Alert]:
        """The run's alerts in step order; [] before the run's first row is stored."""
        r = self.http.get(f"/api/v1/runs/{self.run_id}/alerts")
        if r.status_code == 404:
            return []
        r.raise_for_status()
        return [Alert.from_row(row) for row in r.json()]

    def caught_up(self) -> bool:
        """Whether the collector has analysed every stored step of the run, so that its
        alerts are all stored (True too where nothing analyses live: nothing to wait for)."""
        r = self.http.get(f"/api/v1/runs/{self.run_id}/analysis")
        if r.status_code == 404:  # no row of the run stored: no alert to wait for
            return True
        r.raise_for_status()
        progress = r.json()
        return bool(progress["caught_up"]) or not progress["live"]

    def last_step(self) -> int | None:
        """The newest step the collector holds of the run."""
        r = self.http.get("/api/v1/runs")
        r.raise_for_status()
        return next((x["last_step"] for x in r.json() if x["run_id"] == self.run_id), None)

    def step_loss(self, step: int) -> float | None:
        """The stored loss of one step (None: not stored, or not finite: it goes into an
        event's JSON detail, which has no literal for NaN or inf)."""
        r = self.http.get(f"/api/v1/runs/{self.run_id}/steps", params={"start": step, "end": step})
        r.raise_for_status()
        cols = r.json()["columns"]
        loss = float_from_wire(cols["loss"][0]) if cols.get("step") == [step] else None
        return loss if loss is not None and math.isfinite(loss) else None

    def canary_steps(self, before_step: int) -> list[int]:
        """The steps before `before_step` on which the ranks ran the SDC canary."""
        if before_step < 1:
            return []
        r = self.http.get(
            f"/api/v1/runs/{self.run_id}/ranks",
            params={
                "metric": "canary_fingerprint",
                "start": 0,
                "end": before_step - 1,
                "max_steps": 10_000,
            },
        )
        if r.status_code == 404:
            return []
        r.raise_for_status()
        cols = r.json()
        if cols.get("bucket_steps", 1) != 1:  # a run too long for one-step buckets
            return []
        return sorted(
            {s for s, v in zip(cols["step"], cols["value"], strict=True) if v is not None}
        )

    def event(self, kind: str, step: int, rank: int = -1, detail: dict | None = None) -> None:
        """Store one event of the run; a collector that does not take it is reported on
        stderr, never raised: the supervisor's actions do not wait on telemetry."""
        b = BatchBuilder(self.run_id)
        row = {"detail": json.dumps(detail or {}), "time_unix_s": time.time()}
        b.append("events", step=max(0, step), rank=rank, kind=kind, **row)
        try:
            r = self.http.post(
                "/api/v1/ingest", content=b.to_json(), headers={"Content-Type": "application/json"}
            )
            r.raise_for_status()
        except httpx.HTTPError as e:
            print(f"supervisor: event {kind} not stored by the collector: {e}", file=sys.stderr)
