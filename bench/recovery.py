"""From fault to resumed training under `trainvitals supervise`, and what it cost.

Starts `trainvitals collector` on 127.0.0.1 (default liveness settings), then per scenario
runs `trainvitals supervise` with two torchrun agents on this host (each a "node", default
4 ranks: dp 4 x tp 2 over both, dp 2 x tp 2 on one), a policy that acts, async DCP
checkpoints every 5 steps and one fault:

    sdc      a faulty unit on node1's local rank 0 (canary every 5 steps): fence node1,
             roll back to before the last agreeing canary, resume on node0 (dp halves)
    crash    node1's local rank 0 dies: the collector's rank_lost names it; fence, resume
    diverge  a data window tips training into an instability: roll back to before the
             onset, skip the data since, resume on both nodes
    spike    data window 24 is random bytes: the step is re-run from the checkpoint before
             it on node0, reproduces (data), is rolled back and its batch skipped

Per scenario, from the run's events (the supervisor's, the trainer's, the fault's ground
truth) and alerts: seconds from the fault to the alert acted on (its step's time; a
liveness alert's deadline), to the supervisor's relaunch, to training resumed (the
relaunched trainer's `restart` event, after its checkpoint load); steps re-done; the
run's goodput as `trainvitals replay` computes it; and every other alert the run raised
(`--steps 150` runs on long enough after a relaunch on fewer nodes for the ranks left
behind to be called silent, which they must not be). The last line is the headline.

    python bench/recovery.py | tee bench/results/recovery.txt
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from ingest import Collector

POLICY = """
[limits]
cooldown_s = 0
[kinds.sdc]
mode = "act"
[kinds.rank_lost]
mode = "act"
[kinds.loss_diverging]
mode = "act"
skip_data = true
"""
FAULTS = {
    "sdc": "sdc:node=node1,rank=0,step={step}",
    "crash": "crash:node=node1,rank=0,step={step}",
    "diverge": "diverge:step={step},growth=2",
    "spike": "spike:step={step},kind=batch",
}
# Only the spike scenario acts on loss spikes: the spike that starts a divergence would be
# re-run first (docs/supervisor.md).
SPIKES = '[kinds.loss_spike]\nmode = "act"\n'


def scenario(collector: Collector, name: str, work: Path, args) -> dict:
    run_id = f"recovery-{name}-{int(time.time())}"
    (work / "policy.toml").write_text(POLICY + (SPIKES if name == "spike" else ""))
    dp = 2 * args.ranks_per_node // args.tp
    steps = args.steps + (15 if name == "diverge" else 0)  # a divergence takes longer to see
    fault_step = args.fault_step + (7 if name == "spike" else 0)  # after 20 steps of history
    argv = [
        sys.executable, "-m", "trainvitals", "supervise", "--nodes", "node0,node1",
        "--nproc-per-node", str(args.ranks_per_node), "--collector", collector.url,
        "--policy", str(work / "policy.toml"), "--log-dir", str(work / f"logs-{name}"),
        "--poll-s", "0.5", "--",
        "-m", "trainvitals.trainer.train", "--dp", str(dp), "--tp", str(args.tp),
        "--steps", str(steps), "--run-id", run_id, "--collector", collector.url,
        "--checkpoint-dir", str(work / f"ckpt-{name}"), "--checkpoint-every", "5",
        "--checkpoint-async", "--resume", "--canary-every", "5",
        "--inject", FAULTS[name].format(step=fault_step),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=args.timeout_s)
    wall_s = time.monotonic() - start
    if proc.returncode != 0:
        sys.exit(f"{name}: supervise failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    base = f"{collector.url}/api/v1/runs/{run_id}"
    events = {}
    for e in httpx.get(f"{base}/events", timeout=10).json():
        events.setdefault(e["kind"], []).append({**e, "detail": json.loads(e["detail"] or "{}")})
    fault_s = min(e["time_unix_s"] for k, v in events.items() if k.startswith("fault:") for e in v)
    rollback = events["action:rollback"][0]
    acted = rollback["detail"]["why"].split(" at step ")  # "<kind> at step <n>"
    raised = [a for a in httpx.get(f"{base}/alerts", timeout=10).json()
              if a["severity"] != "resolved"]  # fmt: skip
    alerts = [a for a in raised if a["kind"] == acted[0] and a["step"] == int(acted[1])]
    # Every other alert raised: the fault's own signs before the one acted on, and anything
    # after the recovery (ranks left behind by a relaunch on fewer nodes, say).
    others = [f"{a['kind']}@{a['step']}" + (f"(rank {a['rank']})" if a["rank"] is not None
              else "") for a in raised if a not in alerts]  # fmt: skip
    restart = max(events["restart"], key=lambda e: e["time_unix_s"])
    return {
        "run_id": run_id,
        "alert_s": alerts[0]["time_unix_s"] - fault_s if alerts else float("nan"),
        "relaunch_s": events["action:relaunch"][0]["time_unix_s"] - fault_s,
        "resumed_s": restart["time_unix_s"] - fault_s,
        "redone_steps": rollback["detail"]["redone_steps"],
        "fenced": [e["detail"]["node"] for e in events.get("action:fence", [])],
        "wall_s": wall_s,
        "others": others,
    }


def goodput_of(store: Path) -> dict[str, dict]:
    """run_id -> goodput, as `trainvitals replay` prints it (the collector stopped)."""
    proc = subprocess.run(
        [sys.executable, "-m", "trainvitals", "replay", str(store)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    out = {}
    for line in proc.stderr.splitlines():
        if line.startswith("goodput {"):
            g = json.loads(line.removeprefix("goodput "))
            out[g["run_id"]] = g
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", action="append", choices=list(FAULTS), default=[])
    parser.add_argument("--ranks-per-node", type=int, default=4)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--fault-step", type=int, default=17)
    parser.add_argument("--timeout-s", type=float, default=1200)
    args = parser.parse_args()
    names = args.scenario or list(FAULTS)
    with tempfile.TemporaryDirectory(prefix="trainvitals-recovery-") as tmp:
        work = Path(tmp)
        collector = Collector(work / "store.duckdb")
        try:
            results = {name: scenario(collector, name, work, args) for name in names}
        finally:
            collector.stop()
        goodput = goodput_of(work / "store.duckdb")
    parts = []
    for name, r in results.items():
        g = goodput.get(r["run_id"], {})
        print(
            f"{name:8s} fault->alert {r['alert_s']:6.1f} s  ->relaunch {r['relaunch_s']:6.1f} s  "
            f"->resumed {r['resumed_s']:6.1f} s  re-done {r['redone_steps']} steps  "
            f"fenced {r['fenced'] or '-'}  goodput {g.get('ratio', float('nan')):.3f}  "
            f"(run {r['wall_s']:.0f} s); other alerts: {', '.join(r['others']) or 'none'}",
            flush=True,
        )
        parts.append(f"{name} {r['resumed_s']:.1f} s goodput {g.get('ratio', float('nan')):.3f}")
    head = f"recovery, 2 nodes x {args.ranks_per_node} ranks, fault->resumed: "
    print(head + "; ".join(parts))


if __name__ == "__main__":
    main()
