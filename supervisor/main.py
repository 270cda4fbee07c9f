"""`trainvitals supervise`: its flags, and start-up checks before anything runs."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

from trainvitals import checks

from .agent import Supervisor
from .alerts import CollectorClient
from .fence import FenceList
from .launch import JobCommand
from .policy import Policy


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--nodes", required=True,
        help="names of the job's nodes, comma-separated, in rank order (one agent each)",
    )  # fmt: skip
    p.add_argument("--nproc-per-node", type=int, required=True, help="ranks per node")
    p.add_argument("--collector", required=True, help="collector base URL (alerts, events)")
    p.add_argument("--token", default="", help="the collector's bearer token, if it has one")
    p.add_argument("--policy", default="", metavar="FILE", help="policy TOML (default: observe)")
    p.add_argument(
        "--fence-file", default="", metavar="FILE",
        help="fence list (JSON) the launches exclude, kept across restarts (default: in memory)",
    )  # fmt: skip
    p.add_argument("--log-dir", default="supervisor-logs", help="the agents' output, per launch")
    p.add_argument("--poll-s", type=float, default=2.0, help="seconds between alert polls")
    p.add_argument(
        "--webhook-port", type=int, default=0,
        help="also receive Alertmanager notifications on this port (POST /alerts); 0: off",
    )  # fmt: skip
    p.add_argument("--webhook-host", default="127.0.0.1")
    p.add_argument("--webhook-token", default="", help="bearer token the webhook requires")


def run(args: argparse.Namespace, job_argv: list[str]) -> int | str:
    """Everything is checked before the job starts: a bad policy, fence list, job command
    or webhook setting is one line of error and nothing runs."""
    if not job_argv:
        return "error: give the job's command after --, e.g. -- -m trainvitals.trainer.train ..."
    checks.http_url("--collector", args.collector)
    nodes = [n.strip() for n in args.nodes.split(",") if n.strip()]
    if not nodes or len(set(nodes)) != len(nodes) or args.nproc_per_node < 1:
        return "error: --nodes needs distinct names and --nproc-per-node at least 1"
    policy = Policy.load(args.policy or None)
    fences = FenceList(
        Path(args.fence_file) if args.fence_file else None,
        nodes,
        policy.limits.max_fenced_fraction,
    )
    job = JobCommand(list(job_argv))
    job.check(len(nodes))
    wake = threading.Event()
    server = None
    if args.webhook_port:
        from .webhook import WebhookServer, create_app

        app = create_app(job.value("--run-id"), args.webhook_token, wake)
        server = WebhookServer(app, args.webhook_host, args.webhook_port)
    sup = Supervisor(
        job=job,
        nodes=nodes,
        nproc_per_node=args.nproc_per_node,
        policy=policy,
        collector=CollectorClient(args.collector, job.value("--run-id"), args.token),
        fences=fences,
        log_dir=Path(args.log_dir),
        poll_s=args.poll_s,
        wake=wake,
    )
    # SIGTERM unwinds like Ctrl-C, so the agents (in sessions of their own) are stopped too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return sup.run()
    finally:
        if sup.agents is not None:
            sup.agents.stop()
        if server is not None:
            server.stop()
