"""Delivery: spooled while the collector is away, resent in order, never duplicated."""

from __future__ import annotations

import gzip
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import duckdb
import orjson
import pytest

from tests.collector.conftest import make_batch
from tests.conftest import CollectorProcess, free_port
from trainvitals.hooks.exporter import (
    ExportResult,
    HttpExporter,
    InMemoryExporter,
    JsonlExporter,
    MultiExporter,
)
from trainvitals.schema import decode_msgpack

SUCCESS, FAILURE = ExportResult.SUCCESS, ExportResult.FAILURE


def _stored_steps(store: Path, run_id: str = "r1") -> list[int]:
    con = duckdb.connect(str(store), read_only=True)
    try:
        rows = con.execute("SELECT step FROM steps WHERE run_id = ? ORDER BY step", [run_id])
        return [r[0] for r in rows.fetchall()]
    finally:
        con.close()


@pytest.mark.slow
def test_batches_spool_while_the_collector_is_down_and_resend_in_order(tmp_path: Path) -> None:
    port = free_port()
    exporter = HttpExporter(f"http://127.0.0.1:{port}", spool_dir=tmp_path / "spool",
                            retries=0, backoff_s=0.01)  # fmt: skip
    for first in (0, 3, 6):
        assert exporter.export(make_batch(steps=range(first, first + 3))) is FAILURE
    assert [p.name for p in exporter.spool.pending()] == [f"{i:012d}.json" for i in range(3)]
    collector = CollectorProcess(tmp_path / "store.duckdb", port=port)
    try:
        assert exporter.export(make_batch(steps=range(9, 12))) is SUCCESS
        assert exporter.spool.pending() == [] and exporter.dropped_batches == 0
        # A resend of what is already stored changes nothing.
        assert exporter.export(make_batch(steps=range(0, 12))) is SUCCESS
    finally:
        collector.stop()
    assert _stored_steps(tmp_path / "store.duckdb") == list(range(12))


def test_rejected_batch_is_not_spooled(tmp_path: Path, collector) -> None:
    exporter = HttpExporter(collector.url, spool_dir=tmp_path / "spool")
    bad = make_batch()
    bad._columns["steps"]["loss"][0] = "not a number"
    assert exporter.export(bad) is FAILURE
    assert exporter.rejected_batches == 1 and exporter.spool.pending() == []


class _FailsOnPoison(BaseHTTPRequestHandler):
    """A stand-in for a collector with a bug: 500 to every batch of run "poison", 202 to
    the others (kept in `received`). The real collector has no such batch left to fail on,
    which is why this part is not real."""

    received: ClassVar[list[dict]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["content-length"]))
        # msgpack as sent, JSON as resent from the spool
        binary = self.headers["content-type"] == "application/msgpack"
        if self.headers.get("content-encoding") == "gzip":
            body = gzip.decompress(body)
        doc = decode_msgpack(body) if binary else orjson.loads(body)
        poisoned = doc["run_id"] == "poison"
        if not poisoned:
            self.received.append(doc)
        self.send_response(500 if poisoned else 202)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *_) -> None:
        pass


@pytest.mark.slow
def test_a_batch_the_collector_keeps_failing_on_is_set_aside(tmp_path: Path, collector) -> None:
    """One batch answered 500 drain after drain must not hold back the run's later batches
    for ever: after FAILED_DRAINS drains it is set aside in the spool, counted as dropped,
    and `trainvitals import` of the spool still delivers it."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FailsOnPoison)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    spool = tmp_path / "spool"
    url = f"http://127.0.0.1:{server.server_port}"
    exporter = HttpExporter(url, spool_dir=spool, retries=0, backoff_s=0.001)
    try:
        assert exporter.export(make_batch("poison", steps=range(0, 3))) is FAILURE  # spooled
        delivered = [exporter.export(make_batch(steps=range(s, s + 3))) for s in (0, 3, 6)]
    finally:
        server.shutdown()
        server.server_close()
    # Two drains keep the order (the good batches queue behind it); the third sets it aside
    # and delivers the three in order.
    assert delivered == [FAILURE, FAILURE, SUCCESS]
    assert [doc["steps"]["step"][0] for doc in _FailsOnPoison.received] == [0, 3, 6]
    assert exporter.dropped_batches == 1 and exporter.spool.pending() == []
    assert [p.name for p in spool.iterdir()] == ["000000000000.failed.json"]
    argv = [sys.executable, "-m", "trainvitals", "import", str(spool), "--collector", collector.url]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    collector.stop()
    assert _stored_steps(collector.store, "poison") == [0, 1, 2]


def test_a_multi_exporter_counts_what_each_exporter_dropped() -> None:
    """The trainer sends through a MultiExporter: what one of its exporters drops must still
    reach the monitor's telemetry_dropped (it reads `dropped_batches`)."""
    unreachable = HttpExporter(f"http://127.0.0.1:{free_port()}", retries=0, backoff_s=0.001)
    multi = MultiExporter([InMemoryExporter(), unreachable])  # no spool: a batch is lost
    assert multi.export(make_batch()) is FAILURE
    assert unreachable.dropped_batches == 1 and multi.dropped_batches == 1


def test_a_telemetry_file_on_a_full_disk_counts_its_drops_and_closes_quietly() -> None:
    """/dev/full refuses every write: each batch is counted as dropped, and shutting the
    exporter down (which the monitor's close() does) does not raise into training."""
    exporter = JsonlExporter("/dev/full")
    assert exporter.export(make_batch()) is FAILURE and exporter.export(make_batch()) is FAILURE
    assert exporter.dropped_batches == 2
    exporter.shutdown(1.0)


@pytest.mark.slow
def test_import_loads_a_file_once_and_names_a_bad_line(tmp_path: Path, collector) -> None:
    good = [make_batch(steps=range(i, i + 2)).to_json() for i in (0, 2)]
    bad = orjson.loads(good[0])
    bad["steps"]["step"] = ["x", "y"]
    path = tmp_path / "telemetry.jsonl"
    path.write_bytes(b"\n".join([good[0], orjson.dumps(bad), good[1]]) + b"\n")
    argv = [sys.executable, "-m", "trainvitals", "import", str(path), "--collector", collector.url]
    for _ in range(2):
        r = subprocess.run(argv, capture_output=True, text=True, timeout=300)
        assert r.returncode == 1
        assert "line 2: rejected (422): steps.step: expected int64" in r.stdout
        assert "2 batches stored, 1 rejected" in r.stdout
    collector.stop()
    assert _stored_steps(collector.store) == [0, 1, 2, 3]


@pytest.mark.slow
def test_import_of_a_missing_path() -> None:
    r = subprocess.run([sys.executable, "-m", "trainvitals", "import", "/nonexistent.jsonl"],
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 2 and "does not exist" in r.stdout
