"""The Alertmanager receiver: a token, this run's alerts of known kinds; else refused, and
the supervisor is not woken."""

from __future__ import annotations

import threading

import pytest
from fastapi.testclient import TestClient

from trainvitals.supervisor.webhook import PATH, create_app

TOKEN = "s3cret"


def notification(run_id: str = "run-a", kind: str = "sdc", status: str = "firing") -> dict:
    labels = {"alertname": "TrainvitalsSDCSuspect", "kind": kind, "run_id": run_id, "rank": "2"}
    return {"version": "4", "status": status, "alerts": [{"status": status, "labels": labels}]}


@pytest.fixture
def receiver() -> tuple[TestClient, threading.Event]:
    wake = threading.Event()
    return TestClient(create_app("run-a", TOKEN, wake)), wake


def post(client: TestClient, body, token: str | None = TOKEN):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return client.post(PATH, json=body, headers=headers)


def test_an_alert_of_this_run_wakes_the_supervisor(receiver) -> None:
    client, wake = receiver
    r = post(client, notification())
    assert r.status_code == 202 and r.json() == {"accepted": ["sdc"]}
    assert wake.is_set()


def test_a_resolved_alert_is_taken_but_wakes_nobody(receiver) -> None:
    client, wake = receiver
    assert post(client, notification(status="resolved")).status_code == 202
    assert not wake.is_set()


@pytest.mark.parametrize(
    ("body", "token", "status", "message"),
    [
        (notification(), None, 401, "missing or wrong bearer token"),
        (notification(), "guess", 401, "missing or wrong bearer token"),
        (notification(run_id="run-b"), TOKEN, 422, "alert for run 'run-b'"),
        (notification(kind="cosmic_ray"), TOKEN, 422, "unknown alert kind 'cosmic_ray'"),
        ({"alerts": [{"labels": {"run_id": "run-a"}}]}, TOKEN, 422, "'kind'"),
        ([1, 2], TOKEN, 422, "webhook payload"),
    ],
)
def test_bad_notifications_are_refused_and_nothing_is_done(
    receiver, body, token, status: int, message: str
) -> None:
    client, wake = receiver
    r = post(client, body, token)
    assert r.status_code == status and message in r.json()["detail"], r.text
    assert not wake.is_set()


def test_a_webhook_without_a_token_is_refused_at_start() -> None:
    with pytest.raises(ValueError, match="needs a token"):
        create_app("run-a", "", threading.Event())
