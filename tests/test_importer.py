"""`trainvitals import` of spool directories: one rank's, or the folder of rank<k>/ above."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import duckdb
import pytest

from tests.collector.conftest import make_batch
from trainvitals.hooks.spool import Spool
from trainvitals.importer import spool_files


def _import(path: Path, collector_url: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "trainvitals", "import", str(path), "--collector", collector_url]
    return subprocess.run(argv, capture_output=True, text=True, timeout=300)


def test_spool_files_go_rank_by_rank_each_rank_oldest_first(tmp_path: Path) -> None:
    for rank in (10, 2, 0):  # rank10 sorts after rank2: by number, not by name
        spool = Spool(tmp_path / f"rank{rank}")
        spool.put(b"{}")
        spool.put(b"{}")
    (tmp_path / "rank2" / "000000000002.tmp").write_bytes(b"{")  # half written: not sent
    names = [str(p.relative_to(tmp_path)) for p in spool_files(tmp_path)]
    assert names == [f"rank{k}/{i:012d}.json" for k in (0, 2, 10) for i in (0, 1)]
    assert spool_files(tmp_path / "rank2") == Spool(tmp_path / "rank2").pending()


@pytest.mark.slow
def test_import_of_the_spool_folder_loads_every_rank(tmp_path: Path, collector) -> None:
    root = tmp_path / "spool"  # as $TRAINVITALS_SPOOL_DIR after a run lost its collector
    for rank, first in ((0, 0), (1, 3)):
        Spool(root / f"rank{rank}").put(make_batch(steps=range(first, first + 3)).to_json())
    r = _import(root, collector.url)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"2 batches stored, 0 rejected, from {root}" in r.stdout
    collector.stop()
    con = duckdb.connect(str(collector.store), read_only=True)
    steps = con.execute("SELECT step FROM steps WHERE run_id = 'r1' ORDER BY step").fetchall()
    con.close()
    assert [s for (s,) in steps] == list(range(6))


@pytest.mark.slow
@pytest.mark.parametrize("layout", [[], ["rank0"], ["rank0", "rank1"]])
def test_import_of_an_empty_spool_says_there_is_nothing_to_import(
    tmp_path: Path, layout: list[str]
) -> None:
    root = tmp_path / "spool"
    root.mkdir()
    for name in layout:
        Spool(root / name)
    r = _import(root, "http://127.0.0.1:9")  # never contacted: nothing to send
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip() == f"nothing to import: {root} holds no spooled batches"


class _ScriptedCollector:
    """An ingest endpoint on 127.0.0.1 that answers the first requests as `script` says
    ('drop': close the connection unanswered, or a status code), then 202; it keeps the
    bodies it accepted."""

    def __init__(self, script: list) -> None:
        import http.server
        import threading

        self.script, self.accepted, self.requests = list(script), [], 0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as a real collector

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                outer.requests += 1
                answer = outer.script.pop(0) if outer.script else 202
                if answer == "drop":
                    self.close_connection = True
                    return
                detail = {500: "Internal Server Error", 503: "write queue is full; retry later"}
                reply = b'{"detail": "%s"}' % detail.get(answer, "ok").encode()
                self.send_response(answer)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)
                if answer == 202:
                    outer.accepted.append(body)

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_import_resends_what_the_collector_could_not_take_yet(tmp_path: Path, capsys) -> None:
    """A dropped connection, a 500 and a 503 (write queue full) are resent, as the sender
    does; before, the first aborted the import and the others counted as rejected."""
    from trainvitals.importer import run_import

    path = tmp_path / "telemetry.jsonl"
    lines = [make_batch(steps=[step]).to_json() for step in range(4)]
    path.write_bytes(b"\n".join(lines) + b"\n")
    collector = _ScriptedCollector([500, "drop", 503, 429])
    try:
        assert run_import(path, collector.url) == 0
    finally:
        collector.close()
    assert capsys.readouterr().out == f"4 batches stored, 0 rejected, from {path}\n"
    assert [b.rstrip() for b in collector.accepted] == lines and collector.requests == 8


def test_import_reports_a_batch_the_collector_keeps_failing_and_goes_on(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    from trainvitals import sender
    from trainvitals.importer import run_import

    monkeypatch.setattr(sender, "RETRY_LIMIT", 3)  # about 0.15 s of back-off, not 30 s
    path = tmp_path / "telemetry.jsonl"
    lines = [make_batch(steps=[step]).to_json() for step in range(2)]
    path.write_bytes(b"\n".join(lines) + b"\n")
    collector = _ScriptedCollector([500, 500, 500])
    try:
        assert run_import(path, collector.url) == 1
    finally:
        collector.close()
    assert capsys.readouterr().out == (
        f"{path}, line 1: not stored after 3 attempts (500): Internal Server Error\n"
        f"1 batches stored, 0 rejected, 1 not stored (the collector kept failing), from {path}\n"
    )
    assert [b.rstrip() for b in collector.accepted] == lines[1:]


def _duckdb_file(path: Path) -> Path:
    with duckdb.connect(str(path)) as con:
        con.execute("CREATE TABLE steps AS SELECT range AS step FROM range(100000)")
    return path


def _parquet_file(path: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"step": list(range(1000))}), path)
    return path


@pytest.mark.slow
@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda d: _duckdb_file(d / "run.duckdb"),
            "{path} is a DuckDB file; to load a collector's store, export it first "
            "(`trainvitals export STORE OUT`) and import the folder OUT",
        ),
        (
            lambda d: _parquet_file(d / "steps.parquet"),
            "{path} is a Parquet file; import takes the folder `trainvitals export` writes",
        ),
        (
            lambda d: (d / "notes.txt").write_text("hello\n") and d / "notes.txt",
            "{path} is not JSON lines: expected a JSON-lines telemetry file",
        ),
        (
            lambda d: (d / "other.jsonl").write_text('{"loss": 1}\n') and d / "other.jsonl",
            "{path}, line 1 is not a telemetry batch: expected a JSON-lines telemetry file",
        ),
    ],
)
def test_import_refuses_a_file_that_is_not_telemetry_and_sends_nothing(
    tmp_path: Path, make, message: str
) -> None:
    path = make(tmp_path)
    collector = _ScriptedCollector([])
    try:
        r = _import(path, collector.url)
    finally:
        collector.close()
    assert r.returncode == 2 and r.stderr == ""
    assert r.stdout.startswith("error: " + message.format(path=path))
    assert len(r.stdout.splitlines()) == 1
    assert collector.requests == 0
