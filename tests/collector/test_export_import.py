"""`trainvitals export` then `trainvitals import`: a real run, exported from one collector
as Parquet and imported into a fresh one through its ingest API, reads back identically."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import orjson
import pytest

from tests.conftest import CollectorProcess
from trainvitals.schema import LAYERS, RANKS, to_arrow


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainvitals", *map(str, args)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip


def _everything(url: str, run_id: str) -> dict:
    """What the query API serves about a run: metadata, every series, events, alerts."""
    api = f"{url}/api/v1/runs/{run_id}"
    (run,) = [r for r in httpx.get(f"{url}/api/v1/runs").json() if r["run_id"] == run_id]
    out = {"run": run, "steps": httpx.get(f"{api}/steps").json()}
    out["events"] = httpx.get(f"{api}/events").json()
    out["alerts"] = httpx.get(f"{api}/alerts").json()  # raised again by the fresh analyzer
    for table, key in ((LAYERS, "layer"), (RANKS, "rank")):
        for f in table.fields:
            if f.name not in ("step", key):
                grid = httpx.get(f"{api}/{table.name}", params={"metric": f.name}).json()
                out[f"{table.name}.{f.name}"] = grid
    return out


@pytest.mark.slow
def test_an_export_imports_into_a_fresh_collector_identically(trained_run, tmp_path) -> None:
    run_id = trained_run["run_id"]
    source = trained_run["collector"]
    source.stop()  # export reads a stopped store (the collector owns its file while it runs)
    try:
        r = _cli("export", source.store, tmp_path / "export", "--run", run_id)
        assert r.returncode == 0, r.stderr
    finally:
        source = CollectorProcess(source.store)
        trained_run["collector"], trained_run["url"] = source, source.url
    fresh = CollectorProcess(tmp_path / "fresh.duckdb")
    try:
        for _ in range(2):  # the second import stores nothing new
            # 60 rows: several batches of whole steps for a 12-step, 5-layer, 4-rank run
            r = _cli("import", tmp_path / "export", "--collector", fresh.url, "--batch-rows", 60)
            assert r.returncode == 0, r.stdout + r.stderr
            assert "0 rejected" in r.stdout
            batches = int(r.stdout.split()[0])
            assert batches > 3, r.stdout
        expected = _everything(source.url, run_id)
        assert _everything(fresh.url, run_id) == expected
        assert len(expected["steps"]["columns"]["step"]) == trained_run["steps"]
        assert len(expected["layers.grad_norm"]["step"]) == trained_run["steps"] * 5
        assert len(expected["ranks.step_time_s"]["step"]) == trained_run["steps"] * 4
        assert expected["events"], "the run's end is an event"
    finally:
        fresh.stop()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d: (d / "notes.txt").write_text("x"), "neither a Parquet export"),
        (lambda d: (d / "steps").mkdir(), "no run_id=<id>/*.parquet files"),
        (lambda d: (d / "steps" / "run_id=a").mkdir(parents=True)
         or (d / "steps" / "run_id=a" / "x.parquet").write_bytes(b"not parquet"),
         "cannot read the export"),
    ],
)  # fmt: skip
def test_a_folder_that_is_not_an_export_gets_a_clear_error(tmp_path: Path, make, message) -> None:
    folder = tmp_path / "folder"
    folder.mkdir()
    make(folder)
    r = _cli("import", folder, "--collector", "http://127.0.0.1:9")
    assert r.returncode == 2 and message in r.stdout, r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr


@pytest.mark.slow
def test_batch_rows_must_be_positive(tmp_path: Path) -> None:
    r = _cli("import", tmp_path, "--batch-rows", "0")
    assert r.returncode == 2 and "--batch-rows: must be at least 1" in r.stderr


def test_a_failed_export_leaves_nothing_behind(tmp_path: Path, monkeypatch) -> None:
    from trainvitals.collector import export
    from trainvitals.collector.store import Store

    from .conftest import make_batch

    store_path = str(tmp_path / "s.duckdb")
    store = Store(store_path)
    store.start()
    store.submit("r1", to_arrow(orjson.loads(make_batch().to_json()))[1]).result(timeout=60)
    store.close()
    out = tmp_path / "out"
    real_write = export._write

    def disk_full_at_ranks(rows, folder: Path) -> None:
        if folder.name == "ranks":
            raise OSError(28, "No space left on device")
        real_write(rows, folder)

    monkeypatch.setattr(export, "_write", disk_full_at_ranks)
    with pytest.raises(OSError, match="No space left"):
        export.export_store(store_path, str(out))
    assert list(out.iterdir()) == []  # steps and layers were written, then removed
    monkeypatch.setattr(export, "_write", real_write)
    assert export.export_store(store_path, str(out))["ranks"] == 6  # the retry is not refused
    assert sorted(p.name for p in out.iterdir()) == ["layers", "ranks", "steps"]
