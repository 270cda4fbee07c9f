"""A full disk, for real: the store on a tmpfs of 8 MB, filled by a file beside it.

Writes fail with 503 naming the cause, /readyz and /metrics say the store cannot take
writes, and once space returns the collector reopens the store by itself: nothing it
acknowledged is lost. A start on a full disk leaves no empty store file behind. Mounting
needs root (CAP_SYS_ADMIN); elsewhere these tests are skipped, saying so.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import duckdb
import pytest
from fastapi.testclient import TestClient

from trainvitals.collector.main import create_app
from trainvitals.collector.settings import Settings
from trainvitals.collector.store import Store, StoreError

from ..conftest import wait_until
from .conftest import make_batch


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    """An 8 MB filesystem of its own."""
    mount = tmp_path / "disk"
    mount.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {proc.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def fill(disk: Path, leave_bytes: int) -> Path:
    """A file that takes all the free space of `disk` but `leave_bytes`."""
    stat = os.statvfs(disk)
    filler = disk / "filler"
    with open(filler, "wb") as f:
        f.write(b"\0" * max(0, stat.f_bavail * stat.f_frsize - leave_bytes))
    return filler


def post(client: TestClient, run_id: str):
    body = make_batch(run_id, range(50), n_layers=8, world=64).to_json()
    return client.post("/api/v1/ingest", content=body)


def test_a_full_disk_refuses_writes_then_heals_and_loses_nothing(disk: Path) -> None:
    """After a failed checkpoint DuckDB refused every later write until a restart, while
    /healthz said ok."""
    settings = Settings(store_path=str(disk / "store.duckdb"))
    acked: list[str] = []
    with TestClient(create_app(settings)) as client:
        # Checkpoint every 64 KB of log (16 MB by default): the failed checkpoint that
        # invalidates the database comes within a few batches of the disk filling up.
        client.app.state.store.cursor().execute("SET checkpoint_threshold = '64KB'")
        for i in range(3):
            assert post(client, f"before-{i}").status_code == 202
            acked.append(f"before-{i}")
        filler = fill(disk, leave_bytes=100_000)
        refused = None
        for i in range(40):
            r = post(client, f"full-{i}")
            if r.status_code == 202:
                acked.append(f"full-{i}")
                continue
            refused = r
            break
        assert refused is not None and refused.status_code == 503, "the disk never filled"
        assert "No space left on device" in refused.json()["detail"]
        ready = client.get("/readyz")
        assert ready.status_code == 503
        assert "the store cannot take writes: disk full" in ready.json()["reason"]
        assert "trainvitals_collector_store_writable 0.0" in client.get("/metrics").text
        r = post(client, "while-full")
        assert r.status_code == 503 and r.headers.get("retry-after") == "1", r.text

        filler.unlink()  # space returns: the writer reopens the store by itself
        wait_until(lambda: client.get("/readyz").status_code == 200)
        assert "trainvitals_collector_store_writable 1.0" in client.get("/metrics").text
        assert post(client, "after").status_code == 202
        acked.append("after")
    con = duckdb.connect(str(disk / "store.duckdb"), read_only=True)
    try:
        stored = {r[0] for r in con.execute("SELECT DISTINCT run_id FROM steps").fetchall()}
    finally:
        con.close()
    assert set(acked) <= stored, sorted(set(acked) - stored)


def test_a_start_on_a_full_disk_leaves_no_empty_store(disk: Path) -> None:
    """The failed start left a 0-byte file, which the next start refused."""
    path = disk / "store.duckdb"
    filler = fill(disk, leave_bytes=0)
    with pytest.raises(StoreError, match=r"No space left on device|Could not write"):
        Store(str(path))
    assert not path.exists()
    filler.unlink()
    path.touch()  # as an older version left it
    store = Store(str(path))
    store.close()
    assert path.stat().st_size > 0
