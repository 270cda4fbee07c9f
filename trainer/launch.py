"""`trainvitals train`: run the reference trainer, through torchrun when it has several ranks."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

from .config import TrainConfig


def torchrun_command(nproc: int, train_args: list[str]) -> list[str]:
    """argv that runs the trainer on `nproc` local ranks (torchrun picks a free port)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "trainvitals.trainer.train",
        *train_args,
    ]


def descendants(pid: int) -> list[int]:
    """Every live process below `pid`, read from /proc. torchrun starts each worker in a
    session of its own, so signalling its process group leaves the workers behind, and a
    worker whose agent is gone is no longer below it: look before the agent ends."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue  # /proc/self, /proc/meminfo...
        fields = _stat_fields(int(entry.name))
        if fields:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def started_ticks(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot), None if there is none: with
    the pid, what tells a process from a later one that reuses its pid."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields else None


def _stat_fields(pid: int) -> list[str]:
    """/proc/PID/stat's fields after "pid (comm)": state, ppid, ...; [] if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError):
        return []  # not a process, or it ended meanwhile
    return stat[stat.rindex(")") + 2 :].split()


def kill_processes(processes: list[tuple[int, int | None]]) -> None:
    """SIGKILL each (pid, started_ticks) that is still that process."""
    for pid, started in processes:
        if started is not None and started_ticks(pid) == started:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def stop_jobs(procs: list[subprocess.Popen], timeout_s: float) -> None:
    """Stop jobs each started in a session of its own: SIGTERM each one's process group,
    SIGKILL the group of one still running after `timeout_s`, then SIGKILL what they
    started that outlived them. torchrun starts each rank in a session of its own, which
    the group does not reach, and a rank stuck in a collective does not run its SIGTERM
    handler: left alive, it would hold its devices and ports against a relaunch."""
    running = [p for p in procs if p.poll() is None]
    below = [(pid, started_ticks(pid)) for p in running for pid in descendants(p.pid)]
    for p in running:
        _signal_group(p, signal.SIGTERM)
    for p in running:
        try:
            p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            _signal_group(p, signal.SIGKILL)
            p.wait(timeout_s)
    kill_processes(below)


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # the group is gone already
        os.killpg(p.pid, sig)  # its own session: what it started, but not torchrun's ranks


def kill_job(proc: subprocess.Popen) -> None:
    """SIGKILL a launched job and every process below it, workers in sessions of their
    own included (the caller reaps `proc`)."""
    kill_processes([(pid, started_ticks(pid)) for pid in [proc.pid, *descendants(proc.pid)]])


def run(cfg: TrainConfig, nproc: int, train_args: list[str]) -> int:
    if nproc != cfg.world_size:
        print(f"error: --nproc {nproc} must equal dp x tp = {cfg.world_size}", file=sys.stderr)
        return 2
    if cfg.resume:  # refused here, once, rather than by every rank after torchrun started
        from .checkpoint import read_meta  # imports torch, which the CLI defers otherwise

        try:
            read_meta(Path(cfg.checkpoint_dir), cfg.checkpoint_meta())
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    if nproc == 1:
        from .train import main

        main(train_args)
        return 0
    # One BLAS thread per rank unless told otherwise (torchrun's own default, set here so it
    # does not print a banner about it).
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    return subprocess.call(torchrun_command(nproc, train_args), env=env)
