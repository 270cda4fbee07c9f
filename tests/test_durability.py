"""kill -9 of the collector in the middle of a real run: every record ends up stored once."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path

import duckdb
import httpx
import pytest

from tests.conftest import CollectorProcess, kill_job, patience_s, wait_until
from trainvitals.trainer.launch import descendants, torchrun_command

# Starts processes (torchrun, a collector, a browser...) or runs for seconds: `make test` only.
pytestmark = pytest.mark.slow

STEPS = 150


def _last_step(url: str) -> int:
    try:
        runs = httpx.get(f"{url}/api/v1/runs", timeout=30).json()
    except httpx.HTTPError:
        return -1
    return runs[0]["last_step"] if runs and runs[0]["last_step"] is not None else -1


def _signal_job(proc: subprocess.Popen, sig: signal.Signals) -> None:
    """`sig` to torchrun and every process it started."""
    for pid in [proc.pid, *descendants(proc.pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def test_spool_resends_after_kill_9_and_nothing_is_lost_or_doubled(tmp_path: Path) -> None:
    store = tmp_path / "store.duckdb"
    collector = CollectorProcess(store)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRAINVITALS_SPOOL_DIR": str(tmp_path / "spool")}
    trainer = subprocess.Popen(
        torchrun_command(4, ["--dp", "2", "--tp", "2", "--steps", str(STEPS), "--run-id", "k9",
                             "--collector", collector.url]),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip
    try:
        wait_until(lambda: _last_step(collector.url) >= 5, timeout_s=120, interval_s=0.2)
        collector.kill()
        # The run goes on and its batches spool. It then waits, stopped, while the collector
        # restarts: on a loaded machine the restart outlasted the rest of the run, whose
        # last drain found no collector (its batches stayed spooled for the next run).
        spool = tmp_path / "spool"
        wait_until(lambda: list(spool.glob("rank*/*.json")), timeout_s=120, interval_s=0.1)
        _signal_job(trainer, signal.SIGSTOP)
        try:
            collector = CollectorProcess(store, port=collector.port)
        finally:
            _signal_job(trainer, signal.SIGCONT)
        output, _ = trainer.communicate(timeout=patience_s(600))
        assert trainer.returncode == 0, output
    finally:
        kill_job(trainer)
        collector.stop()
    con = duckdb.connect(str(store), read_only=True)
    q = "SELECT count(*), count(DISTINCT ({k})) FROM {t} WHERE run_id = 'k9'"
    assert con.execute(q.format(k="step", t="steps")).fetchone() == (STEPS, STEPS)
    assert con.execute(q.format(k="step, layer", t="layers")).fetchone() == (STEPS * 5,) * 2
    assert con.execute(q.format(k="step, rank", t="ranks")).fetchone() == (STEPS * 4,) * 2
    con.close()
    assert list((tmp_path / "spool").glob("rank*/*.json")) == []
