"""Start the Streamlit dashboard as a child process (`trainvitals dashboard`, the demo).

`trainvitals dashboard --store STORE` replays a stored run (a DuckDB file, or a Parquet
export folder): it starts a collector in replay mode (read-only) on a free port and the
dashboard against it, and stops both on Ctrl-C.
"""

from __future__ import annotations

import re
import signal
import socket
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
    check_port(port)
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
        "--client.toolbarMode",  # no "Deploy" button: this is a monitoring page
        "viewer",
        "--",  # what follows goes to app.py, not to streamlit
        "--collector",
        collector_url,
    ]


def run_dashboard(collector_url: str, port: int = 8501, host: str = "127.0.0.1") -> int:
    """Serve the dashboard in the foreground until it exits; return its exit code."""
    _exit_on_sigterm()
    proc = subprocess.Popen(dashboard_command(collector_url, port, host))
    try:
        return proc.wait()
    except KeyboardInterrupt:
        # Ctrl-C reached streamlit too (same process group): let it shut down on its own.
        return proc.wait()
    finally:
        _stop(proc)


def replay_collector_command(store: Path, port: int) -> list[str]:
    """The argv of a collector serving `store` read-only on 127.0.0.1:port."""
    return [
        sys.executable,
        "-m",
        "trainvitals",
        "collector",
        "--store",
        str(store),
        "--replay",
        "--port",
        str(port),
    ]


def check_port(port: int) -> int:
    """`port` if a TCP port can be it; ValueError otherwise."""
    if not 1 <= port <= 65535:
        raise ValueError(f"port must be in 1..65535, got {port}")
    return port


def check_store(store: Path) -> Path:
    """`store` if the replay collector serves it: a DuckDB file, or a Parquet export folder
    (`trainvitals export`, collector/export.py); ValueError saying why not otherwise."""
    from trainvitals.collector.store import is_export

    if store.is_file() or is_export(store):
        return store
    if store.is_dir():
        raise ValueError(
            f"store {store} is a folder but not a trainvitals export: "
            "it has no table folder (steps/, layers/, ...)"
        )
    raise ValueError(f"store {store} does not exist")


def check_not_held(store: Path) -> Path:
    """`store` unless another process (a running collector) holds it open for writing:
    DuckDB lets no other process open it then, not even read-only. ValueError saying what
    to do instead otherwise."""
    import duckdb

    if not store.is_file():
        return store  # an export folder: Parquet files, no lock
    try:
        duckdb.connect(str(store), read_only=True).close()
    except duckdb.Error as e:
        if "Conflicting lock" not in str(e):
            return store  # not a lock: the collector's own checks say what is wrong
        holder = re.search(r"PID (\d+)", str(e))
        who = f"process {holder.group(1)}" if holder else "another process"
        raise ValueError(
            f"store {store} is held open by {who}, most likely a running collector: DuckDB "
            "lets no other process read a store while one writes it. Point the dashboard at "
            "that collector instead (`trainvitals dashboard --collector http://HOST:PORT`), "
            f"or stop it and replay the store, or `trainvitals export {store} FOLDER` once it "
            "has stopped and replay the folder."
        ) from e
    return store


def run_replay(store: Path, port: int = 8501, host: str = "127.0.0.1") -> int:
    """Serve the runs stored in `store` for a post-mortem, until Ctrl-C; return an exit code.

    Raises ValueError for a bad port or a store the collector cannot serve, before
    anything starts; RuntimeError when the collector does not start (a store another
    process holds open for writing, for instance).
    """
    from trainvitals.demo import wait_healthy

    check_port(port)
    check_not_held(check_store(store))
    _exit_on_sigterm()
    collector_port = free_port()
    collector_url = f"http://127.0.0.1:{collector_port}"
    collector = subprocess.Popen(replay_collector_command(store, collector_port))
    try:
        wait_healthy(f"{collector_url}/healthz", collector)
        print(
            f"replaying {store}: collector {collector_url}, dashboard http://{host}:{port}",
            flush=True,
        )
        return run_dashboard(collector_url, port, host)
    finally:
        _stop(collector)


def _exit_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit, so that `finally` stops the children started here.

    Without it a process manager's SIGTERM kills this process alone and leaves streamlit
    (and a replay collector) serving. Ctrl-C needs nothing: it reaches the whole group.
    """
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))


def _stop(proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """Ask a child to stop and wait for it (a no-op once it has exited)."""
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
