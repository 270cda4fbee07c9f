"""The job under torchrun, one agent per node, and its command line.

On a cluster each node runs its own agent; here every agent is a local process (each a
"node", named, with TRAINVITALS_NODE set so that a fault injected on a node stays there).
Ranks are assigned in node order (torchrun's static rendezvous: global rank = node index x
ranks per node + local rank), which is how an alert's rank names its node.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from trainvitals.trainer.faults import NODE_ENV
from trainvitals.trainer.launch import stop_jobs


class JobError(ValueError):
    """A job command the supervisor cannot relaunch; nothing was started."""


@dataclass
class JobCommand:
    """The job's argv (what follows torchrun's options), and the flags the supervisor
    reads or rewrites: --run-id, --checkpoint-dir, --dp, --resume, --skip-data (the
    reference trainer's; another job must accept them with the same meaning)."""

    argv: list[str]
    skip_data: list[str] = field(default_factory=list)  # windows added by the supervisor

    def value(self, flag: str) -> str | None:
        for i, a in enumerate(self.argv):
            if a == flag and i + 1 < len(self.argv):
                return self.argv[i + 1]
            if a.startswith(flag + "="):
                return a.split("=", 1)[1]
        return None

    def check(self, n_nodes: int) -> None:
        missing = [f for f in ("--run-id", "--checkpoint-dir") if not self.value(f)]
        if missing or "--resume" not in self.argv:
            raise JobError(
                "the job command needs --run-id, --checkpoint-dir and --resume (a relaunch "
                f"goes on from a checkpoint of the same run); missing: {missing or ['--resume']}"
            )
        if int(self.value("--dp") or 1) % n_nodes:
            raise JobError(
                f"--dp {self.value('--dp') or 1} must be a multiple of the {n_nodes} nodes"
            )

    def for_nodes(self, n_nodes: int, of_nodes: int) -> list[str]:
        """argv for a launch on `n_nodes` of the job's `of_nodes`: dp scaled with them."""
        dp = int(self.value("--dp") or 1) // of_nodes * n_nodes
        out, skip = [], False
        for a in self.argv:
            if skip:
                skip = False
            elif a == "--dp":
                skip = True
            elif not a.startswith("--dp="):
                out.append(a)
        out += ["--dp", str(dp)]
        for window in self.skip_data:
            out += ["--skip-data", window]
        return out

    def for_rerun(self, n_nodes: int, of_nodes: int, checkpoint_dir: str, step: int) -> list[str]:
        """argv that re-runs `step` from the checkpoints under `checkpoint_dir`, sending and
        saving nothing (trainer --rerun-step)."""
        argv = _without(
            self.for_nodes(n_nodes, of_nodes),
            ("--checkpoint-dir", "--collector", "--telemetry-file", "--otlp-endpoint",
             "--hooks", "--rerun-step", "--checkpoint-every", "--checkpoint-every-min"),
        )  # fmt: skip
        return [*argv, "--checkpoint-dir", checkpoint_dir, "--hooks", "off",
                "--rerun-step", str(step)]  # fmt: skip


def _without(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """argv less each `--flag value` and `--flag=value` of `flags`."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in flags:
            skip = True
        elif not a.startswith(tuple(f + "=" for f in flags)):
            out.append(a)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Agents:
    """One torchrun agent per node, started together; their output goes to log files."""

    def __init__(
        self, nodes: list[str], nproc_per_node: int, argv: list[str], log_dir: Path, label: str
    ) -> None:
        self.nodes = list(nodes)
        self.logs = [log_dir / f"{label}-{node}.log" for node in nodes]
        port = free_port()
        log_dir.mkdir(parents=True, exist_ok=True)
        self.procs: list[subprocess.Popen] = []
        for i, node in enumerate(nodes):
            cmd = [
                sys.executable, "-m", "torch.distributed.run",
                f"--nnodes={len(nodes)}", f"--node-rank={i}", f"--nproc-per-node={nproc_per_node}",
                "--master-addr=127.0.0.1", f"--master-port={port}", "--max-restarts=0",
                *argv,
            ]  # fmt: skip
            env = {**os.environ, NODE_ENV: node}
            env.setdefault("OMP_NUM_THREADS", "1")
            log = (log_dir / f"{label}-{node}.log").open("ab")
            self.procs.append(
                subprocess.Popen(
                    cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
                )
            )
            log.close()  # the child holds its own descriptor

    def poll(self) -> int | None:
        """None while running; 0 when every agent ended well; else the first failure's code."""
        codes = [p.poll() for p in self.procs]
        failed = [c for c in codes if c not in (None, 0)]
        if failed:
            return failed[0]
        return 0 if all(c == 0 for c in codes) else None

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM each agent (torchrun passes it on to its ranks), then SIGKILL what is
        left after `timeout_s`, the ranks included (launch.stop_jobs)."""
        stop_jobs(self.procs, timeout_s)
