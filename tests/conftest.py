"""Shared fixtures: real servers on 127.0.0.1 and one real 4-rank training run per session."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from trainvitals.trainer import launch
from trainvitals.trainer.launch import torchrun_command

REPO = Path(__file__).resolve().parent.parent


def pytest_configure(config) -> None:
    # Undelivered telemetry of test runs spools here, not into the user's ~/.cache.
    os.environ.setdefault("TRAINVITALS_SPOOL_DIR", tempfile.mkdtemp(prefix="trainvitals-spool-"))


# Fixtures that start processes (a collector, a torchrun job): a test using one is `slow`.
PROCESS_FIXTURES = frozenset({"collector", "trained_run", "collector_with_run", "faulty_telemetry"})


def pytest_collection_modifyitems(config, items) -> None:
    """Tests that use a process-starting fixture are marked `slow` (`make test-fast` leaves
    them out; others carry the mark themselves). GPU tests run where a CUDA device is
    present and are skipped, visibly, elsewhere."""
    import torch

    for item in items:
        if PROCESS_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Every limit a test puts on time is a hang guard, never the thing tested: it is sized for
# 2 cores at load 20 and multiplied by TRAINVITALS_TEST_SLOWDOWN on a slower box (a
# sanitizer build, an emulated CPU).
SLOWDOWN = float(os.environ.get("TRAINVITALS_TEST_SLOWDOWN", "1"))


def patience_s(seconds: float) -> float:
    """A hang guard of `seconds` on a loaded 2-core machine, scaled for this one."""
    return seconds * SLOWDOWN


def wait_until(predicate, timeout_s: float = 60.0, interval_s: float = 0.1):
    """Poll `predicate` until it returns something truthy; fail the test on time-out
    (`timeout_s`, scaled by patience_s: a guard against a hang, not a speed limit)."""
    limit_s = patience_s(timeout_s)
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        result = predicate()
        if result:
            return result
        time.sleep(interval_s)
    pytest.fail(f"condition not met within {limit_s} s")


def kill_job(proc: subprocess.Popen, timeout_s: float = 30) -> None:
    """Kill a launched job and every process it started, workers in sessions of their own
    included, and reap it."""
    launch.kill_job(proc)
    proc.wait(patience_s(timeout_s))


def run_trainer(args: list[str], nproc: int, timeout_s: float = 600) -> subprocess.CompletedProcess:
    """Run the reference trainer: torchrun for several ranks, a plain process for one."""
    if nproc > 1:
        argv = torchrun_command(nproc, args)
    else:
        argv = [sys.executable, "-m", "trainvitals.trainer.train", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    limit_s = patience_s(timeout_s)
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=limit_s, env=env)
    assert proc.returncode == 0, f"trainer failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


class CollectorProcess:
    """`trainvitals collector` in a subprocess, on a free port of 127.0.0.1."""

    def __init__(self, store: Path | None, *extra: str, port: int | None = None) -> None:
        """store None: no --store flag (`extra` names the store, e.g. --replay STORE)."""
        self.store = store
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        store_flag = [] if store is None else ["--store", str(store)]
        argv = ["collector", *store_flag, "--port", str(self.port), *extra]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "trainvitals", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        wait_until(self._healthy, timeout_s=120)

    def _healthy(self) -> bool:
        if self.proc.poll() is not None:
            pytest.fail(f"collector exited: {self.proc.stdout.read()}")
        try:
            return httpx.get(f"{self.url}/healthz", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(patience_s(60))

    def kill(self) -> None:
        """kill -9: no shutdown hook runs, nothing is flushed."""
        self.proc.kill()
        self.proc.wait(patience_s(60))


@pytest.fixture
def collector(tmp_path: Path) -> Iterator[CollectorProcess]:
    c = CollectorProcess(tmp_path / "store.duckdb")
    yield c
    c.stop()


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory) -> Iterator[dict]:
    """A finished 4-rank (dp=2 x tp=2) run of 12 steps, reported to a live collector."""
    store = tmp_path_factory.mktemp("run") / "store.duckdb"
    c = CollectorProcess(store)
    steps = 12
    run_trainer(
        ["--dp", "2", "--tp", "2", "--steps", str(steps), "--run-id", "e2e", "--collector", c.url],
        nproc=4,
    )
    wait_until(lambda: _stored_steps(c.url, "e2e") == steps)
    run = {"url": c.url, "run_id": "e2e", "steps": steps, "n_layers": 5, "world_size": 4}
    run["collector"] = c
    yield run
    run["collector"].stop()  # a test may have restarted it


def _stored_steps(url: str, run_id: str) -> int:
    runs = httpx.get(f"{url}/api/v1/runs", timeout=60).json()  # a loaded collector
    return next(((r["last_step"] or 0) + 1 for r in runs if r["run_id"] == run_id), 0)


@pytest.fixture
def collector_with_run(trained_run: dict) -> str:
    """Base URL of a live collector holding one finished 4-rank run."""
    return trained_run["url"]


FAULTS = ["--inject", "straggler:rank=1,step=15,slowdown=0.4", "--inject", "sdc:rank=2,step=30"]


@pytest.fixture(scope="session")
def faulty_telemetry(tmp_path_factory) -> Path:
    """Telemetry file of a real 4-rank, 60-step run with a straggler (rank 1, step 15) and
    an SDC unit (rank 2, step 30), canary every 10 steps."""
    out = tmp_path_factory.mktemp("faulty") / "faulty.jsonl"
    run_trainer(["--dp", "2", "--tp", "2", "--steps", "60", "--canary-every", "10", *FAULTS,
                 "--telemetry-file", str(out)], nproc=4)  # fmt: skip
    return out
