"""What alerts blame on real faulty runs, against what they should blame.

    python bench/attribution_check.py [--runs-dir DIR] [--out FILE]

Trains the reference trainer (torchrun, 4 CPU ranks, dp=2 x tp=2, 60 steps, canary every
10) once per fault below, unless DIR already holds that run's telemetry file, runs the
analyzer over it, and prints one line per alert of the fault's kinds: what it names (rank,
layer, the loss) and whether that is what the fault calls for. Then the one-off cost of
reading a runs row's names for 100,000 ranks (`RunInfo.from_runs`).
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

import orjson
import pyarrow as pa

from trainvitals.analyzer import Analyzer
from trainvitals.analyzer.runinfo import RunInfo
from trainvitals.schema import to_arrow
from trainvitals.trainer.launch import torchrun_command

STEPS = 60
# name: (--inject spec, alert kinds judged, what those alerts must blame)
FAULTS = {
    "spike-batch": ("spike:step=30,kind=batch", ("loss_spike",), "no layer"),
    "nan-loss": ("nan:step=40", ("nonfinite",), "the loss"),
    "sdc-unit": ("sdc:rank=1,step=25", ("sdc", "sdc_replica"), "rank 1, not rank 3"),
    "sdc-bitflip": ("sdc:rank=1,step=25,mode=bitflip", ("sdc_replica",), "group 0 only"),
}


def telemetry(runs_dir: Path, name: str, spec: str) -> Path:
    path = runs_dir / f"{name}.jsonl"
    if path.exists():
        return path
    flags = ["--dp", "2", "--tp", "2", "--steps", str(STEPS), "--canary-every", "10"]
    flags += ["--inject", spec, "--telemetry-file", str(path)]
    print(f"  training {name} ...", file=sys.stderr, flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        torchrun_command(4, flags), capture_output=True, text=True, env=env, timeout=900
    )
    if proc.returncode != 0:
        path.unlink(missing_ok=True)
        sys.exit(f"trainer run {name} failed:\n{proc.stderr[-3000:]}")
    return path


def judge(name: str, alert) -> bool:
    """Whether `alert` blames what fault `name` calls for."""
    text = alert.message
    if name == "spike-batch":
        return alert.layer is None and "every layer moved in the same step" in text
    if name == "nan-loss":
        return alert.layer is None and "it started in the loss" in text
    if name == "sdc-unit":
        return alert.rank == 1 and "replica group 1 (" not in text
    return "replica group 0 (" in text and "group 1" not in text  # sdc-bitflip


def named(alert) -> str:
    what = [f"rank {alert.rank}"] if alert.rank is not None else []
    what += [f"layer {alert.layer}"] if alert.layer is not None else []
    return ", ".join(what) or "-"


def check(runs_dir: Path) -> list[str]:
    lines = []
    for name, (spec, kinds, expected) in FAULTS.items():
        analyzer, alerts = Analyzer(), []
        for line in telemetry(runs_dir, name, spec).read_bytes().splitlines():
            alerts += analyzer.observe(*to_arrow(orjson.loads(line)))
        judged = [a for a in alerts if a.kind in kinds]
        if not judged:
            lines.append(f"{name:12} {spec:34} no {'/'.join(kinds)} alert  FAIL")
        for a in judged:
            ok = "ok" if judge(name, a) else "FAIL"
            lines.append(
                f"{name:12} {spec:34} {a.kind:12} step {a.step:3}  fields: {named(a):16} "
                f"expected: {expected:20} {ok}"
            )
            lines.append(f"    {a.message.split('. Data:')[0]}")
    return lines


def runinfo_cost(ranks: int = 100_000) -> str:
    """The engine's cost of a run's names: parsing a runs row once, and comparing it with
    the row it already parsed on every batch after (the collector hands the row over with
    every window)."""
    hosts = json.dumps([f"node-{r // 8:05d}.cluster.example" for r in range(ranks)])
    names = json.dumps(["layers.0"])
    row = pa.table({"tp": [8], "layer_names_json": [names], "hosts_json": [hosts]})
    again = pa.table({"tp": [8], "layer_names_json": [names], "hosts_json": [hosts]})
    t0 = time.perf_counter()
    info = RunInfo.from_runs(row)
    parse_ms = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    repeats = 100
    for _ in range(repeats):
        assert again.equals(row)
    compare_ms = (time.perf_counter() - t0) * 1e3 / repeats
    assert len(info.hosts) == ranks
    return (
        f"RunInfo.from_runs, {ranks:,} hosts ({len(hosts) / 1e6:.1f} MB of hosts_json): "
        f"{parse_ms:.0f} ms once per runs row; {compare_ms:.2f} ms per batch to see the row "
        "unchanged"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--runs-dir", help="where the runs' telemetry files are kept (default: temp)")
    p.add_argument("--out", help="also write the report to this file")
    args = p.parse_args()
    runs_dir = Path(args.runs_dir or tempfile.mkdtemp(prefix="attribution-"))
    runs_dir.mkdir(parents=True, exist_ok=True)
    lines = [
        "$ python bench/attribution_check.py",
        f"real runs: 4 CPU ranks, dp=2 x tp=2, {STEPS} steps, canary every 10",
        *check(runs_dir),
        runinfo_cost(),
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
