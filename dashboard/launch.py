"""Start the Streamlit dashboard as a child process (`trainvitals dashboard`, the demo)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

APP_PATH = Path(__file__).with_name("app.py")


def dashboard_command(collector_url: str, port: int = 8501, host: str = "127.0.0.1") -> list[str]:
    """The argv that serves the dashboard on host:port, reading the collector at `collector_url`.

    >>> dashboard_command("http://127.0.0.1:8000")[1:4]
    ['-m', 'streamlit', 'run']
    """
    if urlsplit(collector_url).scheme not in ("http", "https"):
        raise ValueError(f"collector_url must be an http(s) URL, got {collector_url!r}")
    if not 1 <= port <= 65535:
        raise ValueError(f"port must be in 1..65535, got {port}")
    return [
        sys.executable,
        "-m",
        "streamlit",
        "run",
        str(APP_PATH),
        "--server.address",
        host,
        "--server.port",
        str(port),
        "--server.headless",
        "true",
        "--browser.gatherUsageStats",
        "false",
        "--",  # what follows goes to app.py, not to streamlit
        "--collector",
        collector_url,
    ]


def run_dashboard(collector_url: str, port: int = 8501, host: str = "127.0.0.1") -> int:
    """Serve the dashboard in the foreground until it exits; return its exit code."""
    proc = subprocess.Popen(dashboard_command(collector_url, port, host))
    try:
        return proc.wait()
    except KeyboardInterrupt:
        # Ctrl-C reached streamlit too (same process group): let it shut down on its own.
        return proc.wait()
