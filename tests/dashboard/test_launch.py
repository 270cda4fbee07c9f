"""The dashboard launcher: its argv, and `trainvitals dashboard --store` replaying a store."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import duckdb
import httpx
import pytest

from tests.conftest import wait_until
from trainvitals.collector.export import export_store
from trainvitals.collector.store import Store
from trainvitals.dashboard import launch
from trainvitals.dashboard.launch import APP_PATH, dashboard_command

STARTUP_TIMEOUT_S = 300  # a hang guard: streamlit's start took over 30 s at load 20


def test_command_runs_the_app_and_passes_the_url_after_the_separator() -> None:
    argv = dashboard_command("http://127.0.0.1:9000", port=8600, host="0.0.0.0")
    assert APP_PATH.is_file()
    assert argv[1:5] == ["-m", "streamlit", "run", str(APP_PATH)]
    assert argv[argv.index("--server.port") + 1] == "8600"
    assert argv[argv.index("--server.address") + 1] == "0.0.0.0"
    assert argv[-3:] == ["--", "--collector", "http://127.0.0.1:9000"]


@pytest.mark.parametrize("url, port", [("127.0.0.1:8000", 8501), ("http://h:1", 70000)])
def test_command_rejects_a_bad_url_or_port(url: str, port: int) -> None:
    with pytest.raises(ValueError):
        dashboard_command(url, port=port)


def stored_run(path: Path) -> Path:
    """A store, made as the collector makes them, holding one logged step of run 'r1'."""
    Store(str(path)).close()
    with duckdb.connect(str(path)) as con:
        con.execute(
            "INSERT INTO steps (run_id, step, time_unix_s, loss, grad_norm, tokens, step_time_s,"
            " tokens_per_s, tflops_per_s_per_device, mfu_ratio) "
            "VALUES ('r1', 0, 1.0, 2.5, 1.0, 512, 0.5, 1024.0, 0.1, 0.01)"
        )
    return path


def exported_run(path: Path) -> Path:
    """A Parquet export (`trainvitals export`) of `stored_run`: what `collector --replay` serves."""
    export_store(str(stored_run(path.with_suffix(".duckdb"))), str(path))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("make_store", [stored_run, exported_run], ids=["duckdb", "export"])
def test_replay_serves_a_store_and_ctrl_c_stops_collector_and_dashboard(
    tmp_path: Path, free_tcp_port: int, make_store
) -> None:
    log = tmp_path / "replay.log"
    store = make_store(tmp_path / "run")
    argv = [sys.executable, "-m", "trainvitals", "dashboard", "--store", str(store)]
    with log.open("w") as out:
        proc = subprocess.Popen(
            [*argv, "--port", str(free_tcp_port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, as a terminal's job is
        )
    try:
        found = wait_until(
            lambda: re.search(r"collector (http://\S+),", log.read_text()), STARTUP_TIMEOUT_S
        )
        collector = found.group(1)
        assert httpx.get(f"{collector}/healthz").json()["replay"] is True
        assert [r["run_id"] for r in httpx.get(f"{collector}/api/v1/runs").json()] == ["r1"]
        health = f"http://127.0.0.1:{free_tcp_port}/_stcore/health"
        wait_until(lambda: _answers(health), STARTUP_TIMEOUT_S)
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C sends to the terminal's job
        assert proc.wait(30) == 0
        with pytest.raises(ProcessLookupError):
            os.killpg(proc.pid, 0)  # no process of the group is left: collector included
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert "Traceback" not in log.read_text()


@pytest.mark.slow
def test_replay_checks_its_flags_before_it_starts_anything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_child(*args, **kwargs):
        raise AssertionError(f"started {args[0]} despite a bad flag")

    monkeypatch.setattr(launch.subprocess, "Popen", no_child)
    store = stored_run(tmp_path / "run.duckdb")
    with pytest.raises(ValueError, match="got 99999"):
        launch.run_replay(store, port=99999)
    with pytest.raises(ValueError, match="does not exist"):
        launch.run_replay(tmp_path / "missing.duckdb")
    with pytest.raises(ValueError, match="not a trainvitals export"):
        launch.run_replay(tmp_path)  # a folder, but no table folder in it
    assert launch.check_store(exported_run(tmp_path / "exp")) == tmp_path / "exp"


@pytest.mark.slow
def test_sigterm_to_the_command_stops_the_streamlit_it_started(
    unused_url: str, free_tcp_port: int
) -> None:
    argv = [sys.executable, "-m", "trainvitals", "dashboard", "--collector", unused_url]
    proc = subprocess.Popen(
        [*argv, "--port", str(free_tcp_port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,  # so that the test can clean up whatever is left
    )
    health = f"http://127.0.0.1:{free_tcp_port}/_stcore/health"
    try:
        wait_until(lambda: _answers(health), STARTUP_TIMEOUT_S)
        proc.terminate()  # a process manager's SIGTERM, to the command alone
        proc.wait(30)
        wait_until(lambda: not _answers(health), timeout_s=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert b"Traceback" not in proc.stderr.read()


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1.0).status_code == 200
    except httpx.TransportError:
        return False  # not listening yet


def test_a_store_a_running_collector_holds_says_what_to_do_instead(collector) -> None:
    from trainvitals.dashboard.launch import check_not_held

    with pytest.raises(ValueError, match="held open by process") as held:
        check_not_held(collector.store)
    assert "trainvitals dashboard --collector" in str(held.value)
    replay = subprocess.run(
        [sys.executable, "-m", "trainvitals", "replay", str(collector.store)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert replay.returncode != 0
    assert "held open by process" in replay.stderr and "is not damaged" in replay.stderr
    collector.stop()
    assert check_not_held(collector.store) == collector.store
