"""Property-based fuzzing of every endpoint from the collector's own OpenAPI schema: whatever
schemathesis sends, the collector answers without a 5xx (the `not_a_server_error` check).

The app runs in-process over ASGI; its lifespan runs once, for the module, so the store and
its writer are real, and a stored run gives the run endpoints data to read. Examples per
endpoint are bounded to keep the test well under a minute on two cores.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from trainvitals.collector.main import create_app
from trainvitals.collector.settings import Settings

from .conftest import make_batch

# Per endpoint; TRAINVITALS_FUZZ_EXAMPLES=500 for a longer hunt.
MAX_EXAMPLES = int(os.environ.get("TRAINVITALS_FUZZ_EXAMPLES", "25"))
# OTLP's protobuf bodies: random bytes, as schemathesis sends for application/octet-stream.
schemathesis.serializer.alias("application/x-protobuf", "application/octet-stream")


# The schema is read from the app at collection time; the store behind it opens (in a fresh
# folder) only while this module's tests run. Until then, a path that cannot open.
SETTINGS = Settings(store_path="/nonexistent/set-by-the-fixture.duckdb", max_body_bytes=1 << 18)
APP = create_app(SETTINGS)


async def _served_app(scope, receive, send) -> None:
    """The app without its lifespan: schemathesis starts a lifespan per call, and the store
    (which owns its DuckDB file) must open once, in the fixture below, not per request."""
    if scope["type"] != "lifespan":
        return await APP(scope, receive, send)
    while True:
        message = await receive()
        await send({"type": message["type"] + ".complete"})
        if message["type"] == "lifespan.shutdown":
            return


schema = schemathesis.openapi.from_asgi("/openapi.json", _served_app)


@pytest.fixture(scope="module", autouse=True)
def running_collector(tmp_path_factory) -> Iterator[None]:
    SETTINGS.store_path = str(Path(tmp_path_factory.mktemp("fuzz")) / "store.duckdb")
    with TestClient(APP) as client:  # runs the lifespan: store and writer are up
        r = client.post("/api/v1/ingest", content=make_batch("r1", steps=range(50)).to_json())
        assert r.status_code == 202, r.text
        yield


@schema.parametrize()
@settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    database=None,  # no example database kept between runs
)
def test_no_endpoint_answers_5xx(case) -> None:
    case.call_and_validate(checks=[not_a_server_error])
    if "run_id" in (case.path_parameters or {}):
        # Random ids find no run (404); the same parameters on the stored run reach the SQL.
        case.path_parameters["run_id"] = "r1"
        case.call_and_validate(checks=[not_a_server_error])
