"""How fast a crash and a hang are named, on real runs of the reference trainer.

Starts `trainvitals collector` on 127.0.0.1 (a subprocess, default liveness settings), then
for each fault runs the trainer on `--ranks` CPU ranks (torchrun, gloo) against it with
`--inject crash:rank=R,step=S` or `hang:rank=R,step=S`, and polls the run's alerts every
0.2 s. Latency: from the fault's ground truth (the `fault:*` event the faulting rank sends
just before it dies or stops; the detectors never read it) to the moment the alert could
be read from the collector. Also printed: whom the alert names, and its own time (the
watchdog's deadline). Targets (issue 17): a crash named within 30 s, a hang within 60 s.
Prints the headline last.

    python bench/liveness.py | tee bench/results/liveness.txt
    python bench/liveness.py --where forward --tp 2   # stopped mid-forward, dp 2 x tp 2
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
from ingest import Collector

from trainvitals.trainer.launch import kill_job, torchrun_command

TARGET_S = {"crash": 30.0, "hang": 60.0}
ALERT = {"crash": "rank_lost", "hang": "hang"}


def get(url: str) -> list[dict]:
    try:
        r = httpx.get(url, timeout=5)
    except httpx.HTTPError:
        return []
    return r.json() if r.status_code == 200 else []


def scenario(collector: Collector, fault: str, rank: int, args) -> tuple[float, int | None]:
    """(seconds from the fault to its alert, the rank the alert names)."""
    run_id = f"liveness-{fault}-{int(time.time())}"
    spec = f"{fault}:rank={rank},step={args.fault_step},where={args.where}"
    train = ["--dp", str(args.ranks // args.tp), "--tp", str(args.tp), "--steps",
             str(args.steps), "--log-every", "10", "--collector", collector.url, "--run-id",
             run_id, "--inject", spec]  # fmt: skip
    trainer = subprocess.Popen(
        torchrun_command(args.ranks, train),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        start_new_session=True,
    )
    base = f"{collector.url}/api/v1/runs/{run_id}"
    deadline = time.monotonic() + args.timeout_s
    alert, seen_s = None, None
    try:
        while time.monotonic() < deadline and alert is None:
            time.sleep(0.2)
            found = [a for a in get(f"{base}/alerts") if a["kind"] == ALERT[fault]]
            if found:
                alert, seen_s = found[0], time.time()
    finally:
        if trainer.poll() is None:
            kill_job(trainer)  # its ranks too: each in a session of its own
        trainer.wait(60)
    truth = [e for e in get(f"{base}/events") if e["kind"] == f"fault:{fault}"]
    if alert is None or not truth:
        print(f"{fault}: no {ALERT[fault]} alert within {args.timeout_s:.0f} s", flush=True)
        return float("inf"), None
    fault_s = min(e["time_unix_s"] for e in truth)
    latency_s = seen_s - fault_s
    print(
        f"{fault} of rank {rank} at step {args.fault_step}: {ALERT[fault]} naming rank "
        f"{alert['rank']} read {latency_s:.1f} s after the fault (the alert's own time "
        f"{alert['time_unix_s'] - fault_s:+.1f} s; target {TARGET_S[fault]:.0f} s)\n"
        f"  {alert['message']}",
        flush=True,
    )
    return latency_s, alert["rank"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--fault-step", type=int, default=150)
    p.add_argument("--crash-rank", type=int, default=2)
    p.add_argument("--hang-rank", type=int, default=1)
    p.add_argument("--timeout-s", type=float, default=300)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (dp = ranks / tp)")
    p.add_argument(
        "--where", choices=("step", "forward", "backward"), default="step",
        help="where the rank stops: between steps, or inside its forward or backward",
    )  # fmt: skip
    args = p.parse_args()
    if args.tp < 1 or args.ranks % args.tp:
        p.error(f"--tp {args.tp} must be >= 1 and divide --ranks {args.ranks}")
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        collector = Collector(Path(tmp) / "liveness.duckdb")
        try:
            crash_s, crash_named = scenario(collector, "crash", args.crash_rank, args)
            hang_s, hang_named = scenario(collector, "hang", args.hang_rank, args)
        finally:
            collector.stop()
    print(
        f"liveness on {args.ranks} CPU ranks (gloo, dp {args.ranks // args.tp} x tp {args.tp}, "
        f"stopped {'between steps' if args.where == 'step' else 'mid-' + args.where}): crash of "
        f"rank {args.crash_rank} named "
        f"(rank {crash_named}) in {crash_s:.1f} s (target 30 s), hang of rank "
        f"{args.hang_rank} named (rank {hang_named}) in {hang_s:.1f} s (target 60 s)"
    )


if __name__ == "__main__":
    main()
