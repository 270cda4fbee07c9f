"""Pauses between steps on real runs: is a long checkpoint save or evaluation a hang?

A synchronous checkpoint save of a large model, or an evaluation, stops steps for minutes
with every rank between steps. The liveness watchdog's hang threshold is 10 typical steps,
at least 30 s, so an undeclared pause that long raises `hang` ("the whole job paused"); a
pause the loop declares (`monitor.pause("checkpoint")`, hooks.md) is allowed
`liveness.pause_s` (30 min). Here the bench starts `trainvitals collector` on 127.0.0.1
(default settings), runs the reference trainer on 4 CPU ranks (torchrun, gloo, dp 4)
against it with the trainer's `pause` scenario, and reads the run's alerts once it ends.

Scenarios and what is expected of them (the pause after step --pause-step, --pause-s long):
- declared_checkpoint, declared_eval: every rank pauses, declared: no alert;
- undeclared: the same pause undeclared (`phase=none`): one `hang` naming nobody, "the
  whole job paused ... data_wait", resolved when steps go on (and a `stall` naming nobody
  once steps come, the gap being over 60 s): what every such pause raised before pauses
  could be declared, the reference trainer's own saves included;
- declared_then_hang: a declared pause, then rank 1 hangs --hang-after steps later: a `hang`
  naming rank 1 within 60 s of the hang (the issue's target), the pause's time not counted
  against it and not delaying it;
- declared_then_hung_save: a declared save, then --hang-after steps later a second declared
  save that never ends (a file system gone): one `hang` naming nobody, within
  `liveness.pause_intervals` (3) times the first save's length, at least
  `liveness.pause_floor_s` (300 s), of the second save's start, not after `pause_s` (30 min).
With --load, BUSY_PER_CORE busy processes per core run beside every scenario. Each line
says what was expected, what came and whether it matched; the alerts follow, indented. The
headline is the last line.

    python bench/pauses.py | tee bench/results/pauses.txt
    python bench/pauses.py --load --only undeclared,declared_checkpoint
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from detect import BUSY_PER_CORE, busy_machine  # bench/, run as a script
from ingest import Collector
from liveness import get

from trainvitals.analyzer.liveness import LivenessSettings
from trainvitals.trainer.launch import kill_job, torchrun_command

RANKS = 4


@dataclass(frozen=True)
class Scenario:
    faults: tuple[str, ...]
    expect: str
    judge: Callable[[list[dict], dict], bool]  # (alert rows, the run's fault events) -> met
    hangs: bool = False  # ends in a hang: stop the job once it is named


def _no_alert(alerts: list[dict], _events: dict) -> bool:
    return not alerts


def _whole_job_hang(alerts: list[dict], _events: dict) -> bool:
    opened = [a for a in alerts if a["severity"] != "resolved"]
    hangs = [a for a in opened if a["kind"] == "hang"]
    stalls = [a for a in opened if a["kind"] == "stall"]  # right too: a gap over 60 s
    return (
        len(hangs) == 1
        and len(hangs) + len(stalls) == len(opened)
        and all(a["rank"] is None for a in opened)
        and "the whole job paused" in hangs[0]["message"]
        and "data_wait" in hangs[0]["message"]
        and any(a["kind"] == "hang" and a["severity"] == "resolved" for a in alerts)
    )


def _hang_of_rank_1(alerts: list[dict], events: dict) -> bool:
    opened = [a for a in alerts if a["severity"] != "resolved"]
    hung_s = events.get("fault:hang")
    return (
        [(a["kind"], a["rank"]) for a in opened] == [("hang", 1)]
        and hung_s is not None
        and opened[0]["seen_unix_s"] - hung_s <= 60.0
    )


def _hung_save(within_s: float) -> Callable[[list[dict], dict], bool]:
    def judge(alerts: list[dict], events: dict) -> bool:
        opened = [a for a in alerts if a["severity"] != "resolved"]
        began_s = events.get("fault:pause")  # the last pause's: the hung save
        return (
            [(a["kind"], a["rank"]) for a in opened] == [("hang", None)]
            and "3x the longest this run came back from" in opened[0]["message"]
            and began_s is not None
            and opened[0]["seen_unix_s"] - began_s <= within_s
        )

    return judge


def scenarios(args) -> dict[str, Scenario]:
    pause = f"pause:step={args.pause_step},seconds={args.pause_s:g}"
    hang = f"hang:rank=1,step={args.pause_step + args.hang_after}"
    hung_save = f"pause:step={args.pause_step + args.hang_after},seconds=3600,phase=checkpoint"
    # The collector's defaults, and 30 s for heartbeats and polling.
    live = LivenessSettings()
    within_s = max(live.pause_intervals * args.pause_s, live.pause_floor_s) + 30.0
    return {
        "declared_checkpoint": Scenario((f"{pause},phase=checkpoint",), "no alert", _no_alert),
        "declared_eval": Scenario((f"{pause},phase=eval",), "no alert", _no_alert),
        "undeclared": Scenario(
            (f"{pause},phase=none",),
            "one hang naming nobody (the whole job paused in data_wait), resolved; maybe a stall",
            _whole_job_hang,
        ),
        "declared_then_hang": Scenario(
            (f"{pause},phase=checkpoint", hang),
            f"one hang naming rank 1 within 60 s of its hang at step "
            f"{args.pause_step + args.hang_after}",
            _hang_of_rank_1,
            hangs=True,
        ),
        "declared_then_hung_save": Scenario(
            (f"{pause},phase=checkpoint", hung_save),
            f"one hang naming nobody, the declared save 3x the first's length, within "
            f"{within_s:g} s of the second save's start (not pause_s, 1800 s)",
            _hung_save(within_s),
            hangs=True,
        ),
    }


def run(collector: Collector, name: str, s: Scenario, args) -> tuple[bool, list[str]]:
    """Train with the scenario's faults, polling the alerts (the time each was first read)."""
    run_id = f"pauses-{name}-{int(time.time())}"
    train = ["--dp", str(RANKS), "--steps", str(args.steps), "--log-every", "10",
             "--collector", collector.url, "--run-id", run_id,
             *(f"--inject={f}" for f in s.faults)]  # fmt: skip
    base = f"{collector.url}/api/v1/runs/{run_id}"
    seen: dict[tuple, dict] = {}
    with busy_machine(args.load):
        load = os.getloadavg()[0]
        trainer = subprocess.Popen(
            torchrun_command(RANKS, train), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + args.timeout_s
        while time.monotonic() < deadline:
            time.sleep(0.5)
            for a in get(f"{base}/alerts"):
                seen.setdefault(
                    (a["kind"], a["step"], a["severity"]), {**a, "seen_unix_s": time.time()}
                )
            if trainer.poll() is not None or (s.hangs and any(k[0] == "hang" for k in seen)):
                break
        if trainer.poll() is None:
            kill_job(trainer)  # its ranks too: each in a session of its own
        trainer.wait(60)
        time.sleep(3)  # the last steps' analysis (1 s behind the writer)
        for a in get(f"{base}/alerts"):
            seen.setdefault(
                (a["kind"], a["step"], a["severity"]), {**a, "seen_unix_s": time.time()}
            )
    events: dict[str, float] = {}  # each fault kind's last time
    for e in get(f"{base}/events"):
        if e["kind"].startswith("fault:"):
            events[e["kind"]] = max(events.get(e["kind"], 0.0), e["time_unix_s"])
    alerts = sorted(seen.values(), key=lambda a: a["seen_unix_s"])
    met = s.judge(alerts, events)
    pause_s = events.get("fault:pause")
    lines = [
        f"{name}: expected {s.expect}; got {len(alerts)} alert row(s): "
        f"{'MET' if met else 'NOT MET'} (1-min load {load:.1f} at the start, trainer exit "
        f"{trainer.returncode})"
    ]
    hung_s = events.get("fault:hang")
    for a in alerts:
        rel = f"{a['seen_unix_s'] - pause_s:+.1f} s after the pause began" if pause_s else ""
        if hung_s is not None:
            rel += f", {a['seen_unix_s'] - hung_s:+.1f} s after the hang"
        lines.append(f"  {a['kind']} {a['severity']} step {a['step']} rank {a['rank']}, read {rel}")
        lines.append(f"    {a['message'][:300]}")
    return met, lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--pause-step", type=int, default=150)
    p.add_argument("--pause-s", type=float, default=75.0, help="longer than the 30 s floor")
    p.add_argument("--hang-after", type=int, default=20, help="declared_then_hang: steps")
    busy = f"{BUSY_PER_CORE} busy processes per core beside"
    p.add_argument("--load", action="store_true", help=busy)
    p.add_argument("--only", default="", help="comma-separated scenario names")
    p.add_argument("--timeout-s", type=float, default=600)
    args = p.parse_args()
    chosen = scenarios(args)
    if args.only:
        names = args.only.split(",")
        unknown = sorted(set(names) - set(chosen))
        if unknown:
            p.error(f"unknown scenario(s) {unknown}; known: {sorted(chosen)}")
        chosen = {n: chosen[n] for n in names}
    print(f"# {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the start; "
          f"{RANKS} CPU ranks (dp {RANKS}), pause of {args.pause_s:g} s after step "
          f"{args.pause_step}{', ' + busy if args.load else ''}",
          flush=True)  # fmt: skip
    met = 0
    with tempfile.TemporaryDirectory() as tmp:
        collector = Collector(Path(tmp) / "pauses.duckdb")
        try:
            for name, s in chosen.items():
                ok, lines = run(collector, name, s, args)
                met += ok
                print("\n".join(lines), flush=True)
        finally:
            collector.stop()
    print(f"pauses between steps on real runs: {met}/{len(chosen)} scenarios as expected")


if __name__ == "__main__":
    main()
