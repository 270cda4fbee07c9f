"""Large bodies are decoded in a worker process (collector/decoding.py), small ones in a
thread; errors come back as raised, a dead worker is replaced."""

from __future__ import annotations

import asyncio
import os
import signal

import orjson
import pytest
from fastapi.testclient import TestClient

from trainvitals.collector.decoding import Decoder, DecoderLost
from trainvitals.collector.main import create_app
from trainvitals.collector.settings import Settings
from trainvitals.schema import SchemaError

from .conftest import counts, make_batch

pytestmark = pytest.mark.slow  # each test starts a worker process


def _pid(body: bytes) -> int:
    return os.getpid()


def _refuse(body: bytes) -> None:
    raise SchemaError(f"steps.loss: {body.decode()}")


def _die(body: bytes) -> None:
    os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer would


def test_large_bodies_go_to_a_worker_process_small_ones_stay() -> None:
    decoder = Decoder(workers=1, in_process_bytes=100)
    try:
        assert asyncio.run(decoder.run(_pid, b"x" * 10)) == os.getpid()
        assert decoder.worker_pids() == []  # no worker until a large body comes
        worker = asyncio.run(decoder.run(_pid, b"x" * 100))
        assert worker != os.getpid() and decoder.worker_pids() == [worker]
        with pytest.raises(SchemaError, match=r"steps\.loss: bad"):
            asyncio.run(decoder.run(_refuse, b"bad" * 100))
        with pytest.raises(DecoderLost, match="resend"):
            asyncio.run(decoder.run(_die, b"x" * 100))
        replacement = asyncio.run(decoder.run(_pid, b"x" * 100))  # the next one works
        assert replacement not in (worker, os.getpid())
    finally:
        decoder.close()
    assert decoder.worker_pids() == []


def test_the_collector_decodes_large_bodies_off_its_own_process(tmp_path) -> None:
    """Decoding holds the GIL: in the collector's process a 4 MB body held /healthz and
    every other request for up to 2 s (bench/adversarial.py)."""
    settings = Settings(store_path=str(tmp_path / "s.duckdb"), decode_in_process_bytes=0)
    with TestClient(create_app(settings)) as client:
        assert client.post("/api/v1/ingest", content=make_batch().to_json()).status_code == 202
        decoder = client.app.state.decoder
        assert len(decoder.worker_pids()) == 1 and os.getpid() not in decoder.worker_pids()
        bad = make_batch()
        bad._columns["steps"]["step"][0] = -1
        r = client.post("/api/v1/ingest", content=bad.to_json())
        assert r.status_code == 422 and "steps.step" in r.json()["detail"], r.text
        client.app.state.store.flush()
        assert counts(client)["steps"] == 3  # the first batch; nothing of the refused one
    assert decoder.worker_pids() == []  # stopped with the collector


def test_a_huge_string_is_refused_in_the_worker_naming_the_field(tmp_path) -> None:
    """A 4 MB runs.model: validated where it was decoded, so the collector's process never
    holds it as a Python string; the 422 names the field and nothing is stored."""
    from .test_ingest import _runs_row

    settings = Settings(store_path=str(tmp_path / "s.duckdb"), decode_in_process_bytes=1024)
    doc = {"schema_version": 1, "run_id": "r1", "runs": _runs_row(model="m" * 4_000_000)}
    with TestClient(create_app(settings)) as client:
        r = client.post("/api/v1/ingest", content=orjson.dumps(doc))
        assert r.status_code == 422, r.text
        assert r.json()["detail"] == (
            "runs.model: a value of 4000000 bytes exceeds the limit of 4096 bytes"
        )
        assert len(client.app.state.decoder.worker_pids()) == 1  # the body went there
        assert client.get("/api/v1/runs").json() == []
