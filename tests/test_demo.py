"""`trainvitals demo` as a user runs it: the stack comes up, trains, and Ctrl-C stops it all."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import duckdb
import httpx
import pytest

from tests.conftest import free_port, patience_s, wait_until

# Starts processes (torchrun, a collector, a browser...) or runs for seconds: `make test` only.
pytestmark = pytest.mark.slow


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _as_from_a_terminal() -> None:
    """Ctrl-C's default, as a terminal's shell gives it: a test run started in the
    background of a script (`cmd &`, no job control) ignores SIGINT, and so would the demo
    (Python then leaves it ignored). Seen once, from how a CI run was launched."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_demo_runs_the_stack_and_ctrl_c_stops_everything(tmp_path: Path) -> None:
    store = tmp_path / "demo.duckdb"
    cport, dport = free_port(), free_port()
    demo = subprocess.Popen(
        [sys.executable, "-m", "trainvitals", "demo", "--store", str(store), "--steps", "400",
         "--collector-port", str(cport), "--dashboard-port", str(dport)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        preexec_fn=_as_from_a_terminal,
    )  # fmt: skip
    collector = f"http://127.0.0.1:{cport}"
    try:
        wait_until(lambda: _answers(f"http://127.0.0.1:{dport}/_stcore/health"), timeout_s=300)

        def steps_stored() -> int:
            runs = httpx.get(f"{collector}/api/v1/runs", timeout=60).json()  # a loaded machine
            return runs and (runs[0]["last_step"] or 0) >= 3

        wait_until(steps_stored, timeout_s=300, interval_s=0.5)
        demo.send_signal(signal.SIGINT)  # what Ctrl-C in the terminal sends
        output, _ = demo.communicate(timeout=patience_s(300))  # a hang guard
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


def _running(marker: str) -> list[str]:
    """Command lines of the live processes whose command line holds `marker`."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:  # it exited meanwhile
            continue
        if marker in cmdline:
            found.append(cmdline)
    return found


def test_sigterm_stops_the_demo_and_every_child_as_ctrl_c_does(tmp_path: Path) -> None:
    """A process manager's SIGTERM reaches the demo alone (its children run in sessions of
    their own): it must stop the collector, `trainvitals train`, torchrun and the ranks."""
    store = tmp_path / "demo.duckdb"
    cport = free_port()
    collector = f"http://127.0.0.1:{cport}"
    demo = subprocess.Popen(
        [sys.executable, "-m", "trainvitals", "demo", "--store", str(store), "--steps", "400",
         "--collector-port", str(cport), "--no-dashboard"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:

        def training() -> bool:
            if not _answers(f"{collector}/healthz"):
                return False
            runs = httpx.get(f"{collector}/api/v1/runs", timeout=60).json()  # a loaded machine
            return bool(runs) and (runs[0]["last_step"] or 0) >= 1

        wait_until(training, timeout_s=300, interval_s=0.5)
        # trainvitals train, torchrun and 4 ranks name the collector's URL
        assert len(_running(collector)) >= 6, _running(collector)
        demo.send_signal(signal.SIGTERM)
        output, _ = demo.communicate(timeout=patience_s(300))  # a hang guard
    finally:
        demo.kill()
    assert demo.returncode == 0 and "stopping" in output, output
    assert not _answers(f"{collector}/healthz")
    wait_until(lambda: not _running(collector) and not _running(str(store)), timeout_s=120)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--steps", "0"], "error: TrainConfig.steps must be >= 1, got 0"),
        (["--steps", "-5"], "error: TrainConfig.steps must be >= 1, got -5"),
        (
            ["--dashboard-port", "{cport}"],
            "error: --dashboard-port must differ from --collector-port",
        ),
    ],
)
def test_demo_checks_its_flags_before_starting_anything(
    tmp_path: Path, flags: list[str], message: str
) -> None:
    store = tmp_path / "demo" / "demo.duckdb"
    cport = str(free_port())
    demo = subprocess.run(
        [sys.executable, "-m", "trainvitals", "demo", "--store", str(store),
         "--collector-port", cport, *(f.format(cport=cport) for f in flags)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert demo.returncode == 2 and demo.stdout == ""
    assert demo.stderr.strip() == message
    assert not store.parent.exists()  # nothing started, nothing written
