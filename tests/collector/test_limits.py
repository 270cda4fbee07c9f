"""Bounded work per request (collector/limits.py): gzip members in linear time and off the
event loop, a collector-wide budget of bytes being decoded, 503 with Retry-After past it."""

from __future__ import annotations

import asyncio
import gzip
import zlib

import pytest

from trainvitals.collector.limits import DecodeBudget, GzipError, OverBudget, TooLarge, gunzip
from trainvitals.collector.settings import Settings

from .conftest import counts, make_batch

EMPTY_MEMBER = gzip.compress(b"")  # 20 bytes
_decompressobj = zlib.decompressobj


class _CountingDecompressor:
    """zlib's decompressor, counting the input bytes it is handed (the work gunzip does)."""

    fed = 0

    def __init__(self, *args, **kwargs) -> None:
        self._d = _decompressobj(*args, **kwargs)

    def decompress(self, data, max_length=0):
        _CountingDecompressor.fed += len(data)
        return self._d.decompress(data, max_length)

    def __getattr__(self, name):
        return getattr(self._d, name)


def test_many_gzip_members_cost_linear_work(monkeypatch) -> None:
    """The old loop handed the decompressor the whole rest of the body for every member:
    bytes fed grew as members^2 (2 MB of empty members held a worker 8.5 s)."""
    monkeypatch.setattr(zlib, "decompressobj", _CountingDecompressor)
    for members in (1_000, 10_000):
        _CountingDecompressor.fed = 0
        body = EMPTY_MEMBER * members
        assert gunzip(body, 1024, max_members=members) == b""
        # Each member is fed in slices of 64 bytes or more: at most 64 + its own size.
        assert _CountingDecompressor.fed <= members * (64 + len(EMPTY_MEMBER)), members


def test_gunzip_members_limits_and_errors() -> None:
    data = b"trainvitals " * 10_000
    assert gunzip(gzip.compress(data) + gzip.compress(b"!"), 10**6) == data + b"!"
    with pytest.raises(TooLarge):
        gunzip(gzip.compress(b"\0" * 10**7), 1000)  # a bomb stops one byte past the limit
    with pytest.raises(GzipError, match="truncated"):
        gunzip(gzip.compress(data)[:-5], 10**6)
    with pytest.raises(GzipError, match=r"data after its end \(byte \d+\)"):
        gunzip(gzip.compress(data) + b"junk", 10**6)
    with pytest.raises(GzipError):
        gunzip(b"", 10)
    with pytest.raises(GzipError, match="more than 3 gzip members"):
        gunzip(EMPTY_MEMBER * 4, 10, max_members=3)
    assert gunzip(EMPTY_MEMBER * 3, 10, max_members=3) == b""


def test_decode_budget() -> None:
    budget = DecodeBudget(100)
    budget.reserve(60)
    with pytest.raises(OverBudget, match=r"decoding 60 bytes .*\(limit 100\)"):
        budget.reserve(41)
    budget.release(60)
    budget.reserve(100)
    assert budget.refused == 1
    with pytest.raises(ValueError, match="limit"):
        DecodeBudget(0)


def test_budget_must_hold_the_largest_body() -> None:
    with pytest.raises(ValueError, match=r"max_decoding_bytes .* at least max_body_bytes"):
        Settings(max_body_bytes=2000, max_decoding_bytes=1000)


def test_a_body_past_the_decode_budget_gets_503_and_the_budget_comes_back(client) -> None:
    """Eight concurrent 32 MB bodies took the collector to 4 GB: beyond the budget a body
    waits for its turn at the sender (503, Retry-After) instead of in the collector's memory."""
    budget: DecodeBudget = client.app.state.decode_budget
    body = make_batch().to_json()
    budget.reserve(budget.limit - len(body) + 1)  # another request holds nearly all of it
    r = client.post("/api/v1/ingest", content=body)
    assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
    assert "decoding" in r.json()["detail"]
    assert counts(client) == {"steps": 0, "layers": 0, "ranks": 0}
    budget.release(budget.in_use)
    # Every answer gives its share back: stored, refused, bad gzip, too large.
    assert client.post("/api/v1/ingest", content=body).status_code == 202
    assert client.post("/api/v1/ingest", content=b"{").status_code == 422
    gz = {"content-encoding": "gzip"}
    assert client.post("/api/v1/ingest", content=b"not gzip", headers=gz).status_code == 400
    assert client.post("/api/v1/ingest", content=gzip.compress(body), headers=gz).status_code == 202
    assert budget.in_use == 0


def test_gzip_is_undone_off_the_event_loop(client, monkeypatch) -> None:
    """Decompression ran in the async handler: a 2 MB body of empty members froze /healthz
    and every other request for 8.5 s. It must run where no event loop runs (a worker)."""
    from trainvitals.collector import ingest

    loops = []

    def spy(body: bytes, limit: int) -> bytes:
        try:
            loops.append(asyncio.get_running_loop())
        except RuntimeError:
            loops.append(None)
        return gunzip(body, limit)

    monkeypatch.setattr(ingest, "gunzip", spy)
    payload = EMPTY_MEMBER * 1000 + gzip.compress(make_batch().to_json())
    r = client.post("/api/v1/ingest", content=payload, headers={"content-encoding": "gzip"})
    assert r.status_code == 202, r.text
    assert loops == [None]
    assert counts(client) == {"steps": 3, "layers": 6, "ranks": 6}


def test_a_large_heartbeat_batch_is_decoded_off_the_event_loop(client, monkeypatch) -> None:
    """Heartbeats were decoded on the event loop whatever their size (32 MB allowed)."""
    from trainvitals.collector import heartbeat

    loops = []
    real = heartbeat.heartbeats_to_arrow

    def spy(doc, received_unix_s):
        try:
            loops.append(asyncio.get_running_loop())
        except RuntimeError:
            loops.append(None)
        return real(doc, received_unix_s)

    monkeypatch.setattr(heartbeat, "heartbeats_to_arrow", spy)
    for n in (2, 5000):  # a few hundred bytes; about 200 KB
        cols = {"rank": list(range(n)), "time_unix_s": [1.0] * n, "host": ["h"] * n,
                "step_started": [1] * n, "step_finished": [1] * n,
                "phase": ["forward"] * n}  # fmt: skip
        doc = {"schema_version": 1, "run_id": "r1", "heartbeats": cols}
        assert client.post(heartbeat.PATH, json=doc).status_code == 202
    assert loops[0] is not None and loops[1] is None


def test_a_large_heartbeat_batch_is_judged_off_the_event_loop(client, monkeypatch) -> None:
    """The watchdog judged every heartbeat batch on the event loop: 66,000 ranks held it,
    and /healthz, for 300 ms."""
    from trainvitals.collector import heartbeat

    watchdog = client.app.state.watchdog
    loops = []
    real = watchdog.observe

    def spy(run_id, table):
        try:
            loops.append(asyncio.get_running_loop())
        except RuntimeError:
            loops.append(None)
        return real(run_id, table)

    monkeypatch.setattr(watchdog, "observe", spy)
    for n in (2, 5000):  # a few hundred bytes; about 200 KB
        cols = {"rank": list(range(n)), "time_unix_s": [1.0] * n, "host": ["h"] * n,
                "step_started": [1] * n, "step_finished": [1] * n,
                "phase": ["forward"] * n}  # fmt: skip
        doc = {"schema_version": 1, "run_id": "r1", "heartbeats": cols}
        assert client.post(heartbeat.PATH, json=doc).status_code == 202
    assert loops[0] is not None and loops[1] is None
