"""`trainvitals demo`: the whole stack on one machine, no GPU needed.

Starts a collector, the dashboard and a 4-rank CPU training run (dp=2 x tp=2) that reports
to the collector, prints where to look, and on Ctrl-C (or SIGTERM, SIGHUP) stops everything:
the trainer first, the collector last, so that it writes what it has accepted. Its flags
are checked, the trainer's included, before anything starts.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from trainvitals.trainer.launch import stop_jobs


def _spawn(argv: list[str], log_path: Path | None = None) -> subprocess.Popen:
    # A session of its own: the terminal's Ctrl-C reaches only us, and we stop children in order.
    out = open(log_path, "ab") if log_path else None  # noqa: SIM115 - owned by the child
    return subprocess.Popen(
        argv, start_new_session=True, stdout=out, stderr=subprocess.STDOUT if out else None
    )


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the process serving {url} exited with code {proc.returncode}")
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{url} did not answer within {timeout_s:.0f} s")


def check_port_free(flag: str, port: int, host: str = "127.0.0.1") -> None:
    """Raise ValueError naming `flag` unless a server could listen on host:port now.

    A server that cannot bind exits, but only after another process may have answered our
    health check on that port: the demo would then train into someone else's collector.
    """
    if not 1 <= port <= 65535:
        raise ValueError(f"{flag} must be in 1..65535, got {port}")
    with socket.socket() as s:
        # uvicorn and streamlit (tornado) set SO_REUSEADDR too: connections of an earlier
        # server lingering in TIME_WAIT do not keep them from binding, a listener does.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            raise ValueError(f"port {port} is in use; pick another with {flag}") from None


def _wait_trainer(trainer: subprocess.Popen, collector: subprocess.Popen) -> int:
    """The trainer's exit code; RuntimeError if our collector exits first."""
    while (code := trainer.poll()) is None:
        if collector.poll() is not None:
            raise RuntimeError(f"the collector exited with code {collector.returncode}")
        time.sleep(0.5)
    return code


def _summary(collector_url: str) -> str:
    runs = httpx.get(f"{collector_url}/api/v1/runs", timeout=5).json()
    if not runs:
        return "no run reached the collector"
    run = runs[0]
    alerts = httpx.get(f"{collector_url}/api/v1/runs/{run['run_id']}/alerts", timeout=5).json()
    return f"run {run['run_id']}: {run['last_step'] + 1} steps stored, {len(alerts)} alerts"


DP, TP = 2, 2  # the training run's mesh: 4 CPU ranks
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)  # handled as Ctrl-C is
STOP_S = 20.0  # how long each child may take to stop before it is killed


def check_flags(args: argparse.Namespace) -> None:
    """ValueError naming the flag, before anything starts: a demo that would fail half-way
    (a training run refused after the collector came up) starts nothing instead."""
    from trainvitals.trainer.config import TrainConfig

    # The trainer's own check of its flags, as `trainvitals train` makes it.
    TrainConfig(
        steps=args.steps,
        dp=DP,
        tp=TP,
        device="cpu",
        collector=f"http://127.0.0.1:{args.collector_port}",
    )
    if Path(args.store).is_dir():
        raise ValueError(f"--store {args.store} is a folder; name a DuckDB file")
    check_port_free("--collector-port", args.collector_port)
    if not args.no_dashboard:
        if args.dashboard_port == args.collector_port:
            raise ValueError("--dashboard-port must differ from --collector-port")
        check_port_free("--dashboard-port", args.dashboard_port)


def _as_ctrl_c(_signum: int, _frame: object) -> None:
    # The children run in sessions of their own, so a process manager's SIGTERM (or a
    # closed terminal's SIGHUP) reaches us alone: stop them as Ctrl-C does.
    raise KeyboardInterrupt


def run_demo(args: argparse.Namespace) -> int:
    try:
        check_flags(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    store = Path(args.store)
    store.parent.mkdir(parents=True, exist_ok=True)
    logs = store.parent
    collector_url = f"http://127.0.0.1:{args.collector_port}"
    me = [sys.executable, "-m", "trainvitals"]
    # The demo's undelivered telemetry (if any) stays beside its store.
    os.environ.setdefault("TRAINVITALS_SPOOL_DIR", str(store.parent / "spool"))
    procs: list[subprocess.Popen] = []
    trainer = None
    previous = {sig: signal.signal(sig, _as_ctrl_c) for sig in STOP_SIGNALS}
    try:
        collector = _spawn(
            [*me, "collector", "--store", str(store), "--port", str(args.collector_port)],
            logs / "collector.log",
        )
        procs.append(collector)
        wait_healthy(f"{collector_url}/healthz", collector)
        print(f"collector  {collector_url}  (Prometheus: {collector_url}/metrics)", flush=True)
        if not args.no_dashboard:
            dashboard = _spawn(
                [
                    *me,
                    "dashboard",
                    "--collector",
                    collector_url,
                    "--port",
                    str(args.dashboard_port),
                ],
                logs / "dashboard.log",
            )
            procs.append(dashboard)
            wait_healthy(f"http://127.0.0.1:{args.dashboard_port}/_stcore/health", dashboard)
            print(f"dashboard  http://127.0.0.1:{args.dashboard_port}", flush=True)
        ranks = f"{DP * TP} CPU ranks (dp={DP} x tp={TP})"
        print(f"training   {ranks}, {args.steps} steps; logs in {logs}/", flush=True)
        train = [
            "--nproc",
            str(DP * TP),
            "--dp",
            str(DP),
            "--tp",
            str(TP),
            "--steps",
            str(args.steps),
            "--device",  # CPU ranks on any machine, one with fewer than 4 GPUs too
            "cpu",
        ]
        trainer = _spawn(
            [*me, "train", *train, "--collector", collector_url],
            logs / "train.log",
        )
        code = _wait_trainer(trainer, collector)
        if code != 0:
            print(f"training failed (exit code {code}); see {logs}/train.log", file=sys.stderr)
            return code
        time.sleep(1.5)  # the collector writes within a second of the last batch
        print(f"training finished: {_summary(collector_url)}", flush=True)
        if args.exit_when_done:
            return 0
        print("Ctrl-C stops the collector and the dashboard.", flush=True)
        while all(p.poll() is None for p in procs):
            time.sleep(0.5)
        return 1
    except KeyboardInterrupt:
        print("\nstopping...", flush=True)
        return 0
    except RuntimeError as e:
        print(f"error: {e}; see the logs in {logs}/", file=sys.stderr)
        return 1
    finally:
        # A second Ctrl-C or SIGTERM must not cut the stopping short and orphan a child.
        interrupt = signal.signal(signal.SIGINT, signal.SIG_IGN)
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        # The trainer first, then the others in the reverse of their start, each given
        # STOP_S to end (what it started that outlives it is killed: torchrun's ranks).
        for proc in [trainer, *reversed(procs)]:
            if proc is not None:
                stop_jobs([proc], STOP_S)
        signal.signal(signal.SIGINT, interrupt)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
