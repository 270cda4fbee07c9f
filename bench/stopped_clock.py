"""The stopped clock (hooks/stopped.py) on the reference trainer: its noise, how much of a
real stop it sees, and what it costs.

Runs the reference trainer on 4 CPU ranks (torchrun, gloo, dp 4, every step logged, to a
telemetry file) in turn:
- clean, on the machine as it is;
- clean, with `--busy` busy processes (default 8: 4x the cores of a 2-core machine);
- with rank 1 stopped (SIGSTOP / SIGCONT) `ms` of every 100 ms from `--stop-after-s`
  seconds after it started, for each of `--stops`;
- where cgroup v1 is writable (root): rank 1 frozen by the cgroup freezer 30 ms of every
  100 ms (what `docker pause` uses), and rank 1 held to 10% of a CPU by a CFS quota (a
  container's CPU limit), which the kernel counts as run-queue wait: not a stop, so the
  clock should not see it.
Per run and rank: the median over the logged steps after the warm-up (for a fault run,
over its second half, after the fault began) of stopped_time_s over step_time_s: the
share of the step the clock saw stopped. Then the clock's own CPU (its schedstat over
`--cost-s` seconds) and what it costs a one-thread training loop beside it. `--cost-only
--run-pairs N`: the cost alone, and N pairs of whole 4-rank runs with the clock on and
off. Last line: the headline.

    python bench/stopped_clock.py
    python bench/stopped_clock.py --steps 300 --stops 12,25,50 --busy 8
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import orjson
from external_faults import (  # bench/, run as a script
    Fault,
    cgroup_writable,
    cpu_quota,
    frozen,
    rank_pids,
    sigstops,
)

from trainvitals.hooks.stopped import StoppedClock
from trainvitals.schema import to_arrow
from trainvitals.trainer.launch import kill_job, torchrun_command

RANKS, STOPPED_RANK, WARMUP_STEPS = 4, 1, 20


def train(
    out: Path, steps: int, fault: Fault | None, fault_after_s: float, clock_s: float = 0.01
) -> None:
    args = ["--dp", str(RANKS), "--device", "cpu", "--steps", str(steps), "--log-every", "1",
            "--telemetry-file", str(out), "--stopped-interval-s", str(clock_s)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    job = subprocess.Popen(torchrun_command(RANKS, args), env=env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    stop, thread = threading.Event(), None
    try:
        if fault is not None:
            pid = wait_rank_pid(job.pid, STOPPED_RANK)
            time.sleep(fault_after_s)
            thread = threading.Thread(target=fault, args=(pid, stop))
            thread.start()
        if job.wait(timeout=1800) != 0:
            raise RuntimeError(f"trainer exit code {job.returncode}")
    finally:
        stop.set()
        if thread is not None:
            thread.join()
        kill_job(job)  # its ranks too: each in a session of its own


def wait_rank_pid(root: int, rank: int, timeout_s: float = 120) -> int:
    """The pid of `rank` among the descendants of `root`, once it has started."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pid = rank_pids(root).get(rank)
        if pid is not None:
            return pid
        time.sleep(0.2)
    raise RuntimeError(f"rank {rank} of job {root} did not start in {timeout_s} s")


def shares(path: Path, from_step: int) -> dict[int, float]:
    """rank -> median over its logged steps from `from_step` of stopped / step time."""
    per_rank: dict[int, list[float]] = {}
    for line in path.read_bytes().splitlines():
        _run, tables = to_arrow(orjson.loads(line))
        ranks = tables.get("ranks")
        if ranks is None or "stopped_time_s" not in ranks.column_names:
            continue
        r = ranks.to_pydict()
        for rank, step, stopped, wall in zip(r["rank"], r["step"], r["stopped_time_s"],
                                             r["step_time_s"], strict=True):  # fmt: skip
            if step >= from_step and stopped is not None and wall:
                per_rank.setdefault(rank, []).append(stopped / wall)
    return {rank: statistics.median(v) for rank, v in sorted(per_rank.items())}


def step_time_s(path: Path, from_step: int) -> float:
    """The run's median step time over its logged steps from `from_step`."""
    times = []
    for line in path.read_bytes().splitlines():
        _run, tables = to_arrow(orjson.loads(line))
        steps = tables.get("steps")
        if steps is not None and "step_time_s" in steps.column_names:
            s = steps.to_pydict()
            times += [t for n, t in zip(s["step"], s["step_time_s"], strict=True)
                      if n >= from_step and t]  # fmt: skip
    return statistics.median(times)


def whole_run_cost(pairs: int, steps: int, tmp: Path) -> float:
    """The trainer's median step time with the clock over without it, run after run (each
    pair in a random order); the median of the pairs' ratios."""
    import random

    ratios = []
    for i in range(pairs):
        times = {}
        for clock_s in random.sample([0.01, 0.0], 2):
            out = tmp / f"cost{i}_{clock_s}.jsonl"
            train(out, steps, None, 0.0, clock_s)
            times[clock_s] = step_time_s(out, WARMUP_STEPS)
        ratios.append(times[0.01] / times[0.0])
        on_ms, off_ms = 1e3 * times[0.01], 1e3 * times[0.0]
        print(f"  pair {i}: step {on_ms:.1f} ms with the clock, {off_ms:.1f} ms without "
              f"({100 * (ratios[-1] - 1):+.2f}%)", flush=True)  # fmt: skip
    return statistics.median(ratios)


def clock_cost(seconds: float) -> float:
    """The clock thread's CPU per second of wall time (its own schedstat), as a share of
    one core."""
    clock = StoppedClock()
    assert clock._thread is not None, "no schedstat here"
    time.sleep(seconds)
    on_cpu_ns = Path(f"/proc/self/task/{clock._thread.native_id}/schedstat").read_text()
    clock.close()
    return int(on_cpu_ns.split()[0]) / 1e9 / seconds


def loop_slowdown(pairs: int, steps: int) -> float:
    """A training loop's time with the clock running over its time without, on one thread
    (torch.set_num_threads(1)): `pairs` pairs of blocks of `steps` steps, each pair in a
    random order; the median of the pairs' ratios."""
    import random

    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(256, 256) for _ in range(8)))
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(64, 256)

    def block() -> float:
        start = time.perf_counter()
        for _ in range(steps):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        return time.perf_counter() - start

    block()  # warm-up
    ratios = []
    for _ in range(pairs):
        times = {}
        for on in random.sample([False, True], 2):
            clock = StoppedClock() if on else None
            times[on] = block()
            if clock is not None:
                clock.close()
        ratios.append(times[True] / times[False])
    return statistics.median(ratios)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300, help="steps of each run")
    p.add_argument("--stops", default="12,25,50", help="ms stopped of every 100 ms, per run")
    p.add_argument("--busy", type=int, default=8, help="busy processes of the loaded run")
    p.add_argument("--stop-after-s", type=float, default=15.0,
                   help="seconds after rank 1 started that its fault begins")  # fmt: skip
    p.add_argument("--cost-s", type=float, default=20.0, help="seconds the cost is measured")
    p.add_argument("--cost-only", action="store_true", help="measure the clock's cost only")
    p.add_argument("--no-cgroups", action="store_true",
                   help="skip the freezer and CPU-quota runs (cgroup v1, as root)")  # fmt: skip
    p.add_argument("--pairs", type=int, default=30, help="block pairs of the loop's slowdown")
    p.add_argument("--run-pairs", type=int, default=0,
                   help="with --cost-only: also this many pairs of whole 4-rank runs, the "
                   "clock on and off (their median step time)")  # fmt: skip
    args = p.parse_args()
    if args.cost_only:
        cost, slower = clock_cost(args.cost_s), loop_slowdown(args.pairs, 200)
        runs = ""
        if args.run_pairs:
            with tempfile.TemporaryDirectory() as tmp:
                ratio = whole_run_cost(args.run_pairs, args.steps, Path(tmp))
            runs = (f"; 4-rank runs {100 * (ratio - 1):+.2f}% step time (median of "
                    f"{args.run_pairs} pairs, {args.steps} steps each)")  # fmt: skip
        print(
            f"stopped clock: cost {100 * cost:.2f}% of a core ({args.cost_s:.0f} s); a "
            f"training loop {100 * (slower - 1):+.2f}% with it (median of {args.pairs} pairs)"
            + runs
        )
        return
    stops = [int(ms) for ms in args.stops.split(",") if ms]
    load = os.getloadavg()[0]
    print(f"stopped clock on 4 CPU ranks (gloo, dp 4), {args.steps} steps each, every step "
          f"logged; {os.cpu_count()} cores; 1-min load {load:.1f}", flush=True)  # fmt: skip
    noise: dict[str, float] = {}
    seen: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, busy in (("clean", 0), ("clean, loaded", args.busy)):
            hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                    for _ in range(busy)]  # fmt: skip
            try:
                out = Path(tmp) / f"{name.replace(', ', '_')}.jsonl"
                train(out, args.steps, None, 0.0)
            finally:
                for hog in hogs:
                    hog.kill()
                    hog.wait()
            got = shares(out, WARMUP_STEPS)
            noise[name] = max(got.values())
            spread = max(got.values()) - min(got.values())
            print(f"{name} ({busy} busy processes): stopped share of a step per rank "
                  + ", ".join(f"{r}: {100 * v:.2f}%" for r, v in got.items())
                  + f"; rank to rank {100 * spread:.2f}%", flush=True)  # fmt: skip
        faults = [(f"stopped {ms} ms of every 100 ms (SIGSTOP)", sigstops(ms)) for ms in stops]
        for controller, what, fault in (
            ("freezer", "frozen 30 ms of every 100 ms (cgroup freezer)", frozen(30)),
            ("cpu", "held to 10% of a CPU (CFS quota: run-queue wait, not a stop)", cpu_quota(10)),
        ):  # fmt: skip
            if not args.no_cgroups and cgroup_writable(controller):
                faults.append((what, fault))
            else:
                print(f"skipped: rank {STOPPED_RANK} {what}: cgroup v1 {controller} not writable")
        for i, (what, fault) in enumerate(faults):
            out = Path(tmp) / f"fault{i}.jsonl"
            train(out, args.steps, fault, args.stop_after_s)
            got = shares(out, args.steps // 2)  # the fault began before mid-run
            seen[what] = got[STOPPED_RANK]
            others = [v for r, v in got.items() if r != STOPPED_RANK]
            print(f"rank {STOPPED_RANK} {what}: seen {100 * got[STOPPED_RANK]:.1f}% of its "
                  "steps stopped (second half of the run); the others "
                  + ", ".join(f"{100 * v:.2f}%" for v in others), flush=True)  # fmt: skip
    cost, slower = clock_cost(args.cost_s), loop_slowdown(args.pairs, 200)
    print(
        f"the clock's own CPU: {100 * cost:.2f}% of one core ({args.cost_s:.0f} s); a "
        f"one-thread training loop {100 * (slower - 1):+.2f}% slower with it running "
        f"(median of {args.pairs} pairs of blocks)"
    )
    print("stopped clock: noise " + ", ".join(f"{k} {100 * v:.1f}%" for k, v in noise.items())
          + " of a step at most; seen " + ", ".join(f"{100 * v:.0f}%" for v in seen.values())
          + f" of the step for the {len(seen)} faults in turn; cost {100 * cost:.2f}% of a "
          f"core, a training loop {100 * (slower - 1):+.2f}%")  # fmt: skip


if __name__ == "__main__":
    main()
