"""A truncated or corrupt store file gets one line naming the file and what to do, from
every command that opens one (it was a 22-line traceback: the first read ran outside the
error handling)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from trainvitals.collector.store import Store
from trainvitals.schema import to_arrow

from .conftest import make_batch

# Starts processes (torchrun, a collector, a browser...) or runs for seconds: `make test` only.
pytestmark = pytest.mark.slow

COMMANDS = {
    "collector": ["collector", "--store", "{store}", "--port", "1"],
    "collector --replay": ["collector", "--replay", "{store}", "--port", "1"],
    "replay --check": ["replay", "{store}", "--check"],
    "export": ["export", "{store}", "{out}"],
}


@pytest.fixture(scope="module")
def stored(tmp_path_factory) -> bytes:
    """The bytes of a closed store holding five runs (about 2 MB)."""
    path = tmp_path_factory.mktemp("full") / "store.duckdb"
    store = Store(str(path))
    store.start()
    for i in range(5):
        run_id, tables = to_arrow(make_batch(f"r{i}", range(200), n_layers=8, world=16).to_dict())
        store.submit(run_id, tables).result()
    store.flush()
    store.close()
    return path.read_bytes()


@pytest.mark.parametrize("damage", ["cut in half", "not duckdb"])
@pytest.mark.parametrize("command", COMMANDS)
def test_a_damaged_store_gets_one_line(tmp_path: Path, stored: bytes, command, damage) -> None:
    store = tmp_path / "store.duckdb"
    store.write_bytes(stored[: len(stored) // 2] if damage == "cut in half" else b"x" * 10_000)
    argv = [a.format(store=store, out=tmp_path / "out") for a in COMMANDS[command]]
    proc = subprocess.run(
        [sys.executable, "-m", "trainvitals", *argv], capture_output=True, text=True, timeout=120
    )
    out = (proc.stdout + proc.stderr).strip().splitlines()
    assert proc.returncode != 0
    assert len(out) == 1, "\n".join(out)
    assert out[0].startswith("error: ")
    assert f"store '{store}' is damaged (truncated or corrupt: " in out[0]
    assert out[0].endswith(
        f"move it aside (mv {store} {store}.damaged) to start an empty store there"
    )


@pytest.mark.parametrize("command", COMMANDS)
def test_a_store_held_by_a_running_collector_is_not_called_damaged(
    tmp_path: Path, stored: bytes, command
) -> None:
    store = tmp_path / "store.duckdb"
    store.write_bytes(stored)
    # Another process holds the store open for writing, as a running collector does.
    holder = subprocess.Popen(
        [sys.executable, "-c", f"import duckdb, sys; c = duckdb.connect({str(store)!r}); "
         "print('open', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "open"
        argv = [a.format(store=store, out=tmp_path / "out") for a in COMMANDS[command]]
        proc = subprocess.run(
            [sys.executable, "-m", "trainvitals", *argv], capture_output=True, text=True,
            timeout=120,
        )  # fmt: skip
    finally:
        holder.kill()
        holder.wait(30)
    out = (proc.stdout + proc.stderr).strip().splitlines()
    assert proc.returncode != 0
    assert len(out) == 1, "\n".join(out)
    assert f"is held open by process {holder.pid}, most likely a running collector" in out[0]
    assert "is not damaged" in out[0] and "mv " not in out[0]
    assert store.read_bytes() == stored  # nothing moved or written
