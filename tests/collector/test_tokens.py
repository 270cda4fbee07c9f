"""Readers need a token too: the query API, /metrics, /docs and /openapi.json answered
anyone, whatever --token said. A read token, a write token, or one for both; probes open."""

from __future__ import annotations

import logging

import pytest
from fastapi.testclient import TestClient

from trainvitals.collector.main import create_app, open_to_the_network
from trainvitals.collector.settings import Settings
from trainvitals.dashboard.client import CollectorClient, CollectorError

from ..conftest import CollectorProcess
from .conftest import make_batch

READS = ("/api/v1/runs", "/api/v1/runs/r1/steps", "/metrics", "/docs", "/openapi.json")
PROBES = ("/healthz", "/readyz")


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


def test_one_token_guards_reads_and_writes(settings: Settings) -> None:
    settings.ingest_token = "both"
    with TestClient(create_app(settings)) as c:
        assert c.post("/api/v1/ingest", content=make_batch().to_json()).status_code == 401
        ok = c.post("/api/v1/ingest", content=make_batch().to_json(), headers=bearer("both"))
        assert ok.status_code == 202
        c.app.state.store.flush()
        for path in READS:
            r = c.get(path)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", path
            assert c.get(path, headers=bearer("wrong")).status_code == 401, path
            assert c.get(path, headers=bearer("both")).status_code == 200, path
        for path in PROBES:
            assert c.get(path).status_code == 200, path


def test_a_read_token_and_a_write_token(settings: Settings) -> None:
    settings.ingest_token, settings.read_token = "writer", "reader"
    with TestClient(create_app(settings)) as c:
        body = make_batch().to_json()
        assert c.post("/api/v1/ingest", content=body, headers=bearer("reader")).status_code == 401
        assert c.post("/api/v1/ingest", content=body, headers=bearer("writer")).status_code == 202
        c.app.state.store.flush()
        for path in READS:
            assert c.get(path, headers=bearer("writer")).status_code == 401, path
            assert c.get(path, headers=bearer("reader")).status_code == 200, path


@pytest.mark.parametrize("field", ["ingest_token", "read_token"])
def test_a_token_with_spaces_around_is_refused(field: str) -> None:
    """' s3cret' could never match: the header is split on spaces. Nothing said so."""
    with pytest.raises(ValueError, match=f"{field} has leading or trailing spaces"):
        Settings(**{field: " s3cret"})


def test_binding_beyond_loopback_without_a_token_warns(settings: Settings, caplog) -> None:
    assert open_to_the_network(settings) is None  # 127.0.0.1
    settings.host = "0.0.0.0"
    warning = open_to_the_network(settings)
    assert warning.startswith("WARNING: the collector listens on 0.0.0.0 with no token for "
                              "reads and writes")  # fmt: skip
    settings.ingest_token = "t"
    assert open_to_the_network(settings) is None  # one token guards both
    settings.ingest_token, settings.read_token = "", "r"
    assert "no token for writes" in open_to_the_network(settings)
    settings.read_token = ""
    with caplog.at_level(logging.WARNING), TestClient(create_app(settings)):
        pass
    assert "with no token for reads and writes" in caplog.text


@pytest.mark.slow
def test_the_dashboard_client_sends_the_token(tmp_path, monkeypatch) -> None:
    """The collector and the dashboard read the same variable; a real collector."""
    monkeypatch.setenv("TRAINVITALS_INGEST_TOKEN", "shared")
    c = CollectorProcess(tmp_path / "store.duckdb")
    try:
        with CollectorClient(c.url) as client:
            assert client.runs() == []
        with CollectorClient(c.url, token="wrong") as client, pytest.raises(CollectorError):
            client.runs()
    finally:
        c.stop()
