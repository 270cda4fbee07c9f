"""`trainvitals demo` as a user runs it: the stack comes up, trains, and Ctrl-C stops it all."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import duckdb
import httpx

from tests.conftest import free_port, wait_until


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_demo_runs_the_stack_and_ctrl_c_stops_everything(tmp_path: Path) -> None:
    store = tmp_path / "demo.duckdb"
    cport, dport = free_port(), free_port()
    demo = subprocess.Popen(
        [sys.executable, "-m", "trainvitals", "demo", "--store", str(store), "--steps", "400",
         "--collector-port", str(cport), "--dashboard-port", str(dport)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    collector = f"http://127.0.0.1:{cport}"
    try:
        wait_until(lambda: _answers(f"http://127.0.0.1:{dport}/_stcore/health"), timeout_s=120)

        def steps_stored() -> int:
            runs = httpx.get(f"{collector}/api/v1/runs", timeout=5).json()
            return runs and (runs[0]["last_step"] or 0) >= 3

        wait_until(steps_stored, timeout_s=120, interval_s=0.5)
        demo.send_signal(signal.SIGINT)  # what Ctrl-C in the terminal sends
        output, _ = demo.communicate(timeout=90)
    finally:
        demo.kill()
    assert demo.returncode == 0, output
    assert f"dashboard  http://127.0.0.1:{dport}" in output and "stopping" in output
    assert not _answers(f"{collector}/healthz")
    assert not _answers(f"http://127.0.0.1:{dport}/_stcore/health")
    # The collector closed its store cleanly: the file opens and holds the steps it accepted.
    con = duckdb.connect(str(store), read_only=True)
    assert con.execute("SELECT count(*) FROM steps").fetchone()[0] >= 4
    con.close()


def test_demo_refuses_a_busy_collector_port_and_trains_nothing(collector, tmp_path: Path) -> None:
    # Another collector holds the port: the demo must not train into it, nor start anything.
    store = tmp_path / "demo" / "demo.duckdb"
    demo = subprocess.run(
        [sys.executable, "-m", "trainvitals", "demo", "--store", str(store), "--steps", "5",
         "--collector-port", str(collector.port), "--no-dashboard", "--exit-when-done"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert demo.returncode == 2, demo.stdout + demo.stderr
    assert demo.stderr.strip() == (
        f"error: port {collector.port} is in use; pick another with --collector-port"
    )
    assert not (store.parent / "train.log").exists()
    assert httpx.get(f"{collector.url}/api/v1/runs", timeout=5).json() == []
