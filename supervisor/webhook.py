"""An Alertmanager webhook receiver: Prometheus' alerts wake the supervisor at once.

Alertmanager POSTs its webhook payload (version 4: {"alerts": [{"status", "labels": {
alertname, kind, run_id, rank, ...}}]}); the receiver requires a bearer token, and refuses
a notification for another run or of an unknown alert kind with a clear message, and
nothing is done. An accepted one only wakes the supervisor: the alert's evidence (its
step, onset, rank) is read from the collector, the one source of it (alerts.py).
deploy/alertmanager/examples/supervisor.yml routes the trainvitals alerts here.
"""

from __future__ import annotations

import threading
from typing import Any

import uvicorn
from fastapi import FastAPI, Header, HTTPException, Request

from trainvitals.collector.ingest import bearer_matches

from .policy import PolicyError, check_kind

PATH = "/alerts"


def check_notification(payload: Any, run_id: str) -> list[str]:
    """The alert kinds a notification names; ValueError naming what is wrong (nothing is
    taken from a notification with any bad alert)."""
    alerts = payload.get("alerts") if isinstance(payload, dict) else None
    if not isinstance(alerts, list):
        raise ValueError("expected Alertmanager's webhook payload: an object with 'alerts'")
    kinds = []
    for a in alerts:
        labels = a.get("labels") if isinstance(a, dict) else None
        if not isinstance(labels, dict) or "kind" not in labels:
            raise ValueError(
                "every alert needs labels with its 'kind' (the trainvitals rules set it)"
            )
        if labels.get("run_id") != run_id:
            raise ValueError(
                f"alert for run {labels.get('run_id')!r}; this supervisor runs {run_id!r}"
            )
        check_kind(labels["kind"])  # PolicyError (a ValueError) for an unknown kind
        if a.get("status", "firing") == "firing":
            kinds.append(labels["kind"])
    return kinds


def create_app(run_id: str, token: str, wake: threading.Event) -> FastAPI:
    """The receiver; `wake` is set for every accepted notification that has a firing alert."""
    if not token:
        raise ValueError("the webhook needs a token (--webhook-token): it triggers actions")
    app = FastAPI(title="trainvitals supervisor")

    @app.post(PATH, status_code=202)
    async def receive(request: Request, authorization: str | None = Header(None)) -> dict:
        if not bearer_matches(authorization, token):
            raise HTTPException(
                401, "missing or wrong bearer token", {"WWW-Authenticate": "Bearer"}
            )
        try:
            kinds = check_notification(await request.json(), run_id)
        except PolicyError as e:
            raise HTTPException(422, str(e)) from e
        except ValueError as e:  # includes a body that is not JSON
            raise HTTPException(422, f"refused: {e}") from e
        if kinds:
            wake.set()
        return {"accepted": kinds}

    return app


class WebhookServer:
    """The receiver under uvicorn on a thread of the supervisor."""

    def __init__(self, app: FastAPI, host: str, port: int) -> None:
        config = uvicorn.Config(app, host=host, port=port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
