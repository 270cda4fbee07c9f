"""The app around the routers: request counting, health checks."""

from __future__ import annotations

from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from trainvitals.collector.deps import get_store
from trainvitals.collector.main import create_app

from .conftest import make_batch


class _BrokenStore:
    """The real store, except that submitting a batch fails as an unforeseen bug would."""

    def __init__(self, store) -> None:
        self._store = store

    def __getattr__(self, name: str):
        return getattr(self._store, name)

    def submit(self, run_id, tables):
        raise RuntimeError("injected failure")


def _requests_by_code(client: TestClient) -> dict[str, float]:
    text = client.get("/metrics").text
    (family,) = (
        f for f in text_string_to_metric_families(text) if f.name.endswith("http_requests")
    )
    return {s.labels["code"]: s.value for s in family.samples}


def test_an_unhandled_error_is_counted_as_500(settings) -> None:
    app = create_app(settings)
    with TestClient(app, raise_server_exceptions=False) as client:
        app.dependency_overrides[get_store] = lambda: _BrokenStore(app.state.store)
        r = client.post("/api/v1/ingest", content=make_batch().to_json())
        assert r.status_code == 500
        app.dependency_overrides.clear()
        assert _requests_by_code(client) == {"500": 1.0}
        r = client.post("/api/v1/ingest", content=make_batch().to_json())
        assert r.status_code == 202  # the collector keeps working


def test_healthz_answers_head(client) -> None:
    r = client.head("/healthz")
    assert r.status_code == 200 and r.content == b""
    assert client.get("/healthz").json()["status"] == "ok"


def test_the_middleware_is_pure_asgi(settings) -> None:
    # BaseHTTPMiddleware (`@app.middleware("http")`) runs each request's app in a task of
    # its own and streams the answer back through a memory channel: a per-request cost.
    from starlette.middleware.base import BaseHTTPMiddleware

    app = create_app(settings)
    assert app.user_middleware, "the collector's middleware is missing"
    assert not [m for m in app.user_middleware if issubclass(m.cls, BaseHTTPMiddleware)]
