"""The dashboard launcher: its argv, and that streamlit really serves with it."""

from __future__ import annotations

import subprocess

import httpx
import pytest

from tests.conftest import wait_until
from trainvitals.dashboard.launch import APP_PATH, dashboard_command

STARTUP_TIMEOUT_S = 60


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


def test_streamlit_serves_with_the_command(unused_url: str, free_tcp_port: int) -> None:
    proc = subprocess.Popen(
        dashboard_command(unused_url, port=free_tcp_port),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )

    def healthy() -> bool:
        assert proc.poll() is None, "streamlit exited"
        try:
            health = httpx.get(f"http://127.0.0.1:{free_tcp_port}/_stcore/health", timeout=1.0)
        except httpx.TransportError:
            return False  # not listening yet
        return health.status_code == 200

    try:
        wait_until(healthy, timeout_s=STARTUP_TIMEOUT_S)
    finally:
        proc.terminate()
        _, stderr = proc.communicate(timeout=30)
    assert b"Traceback" not in stderr
