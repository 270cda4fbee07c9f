"""Replay speed: how much faster than real time `trainvitals replay` goes through a stored run.

Builds a DuckDB store holding one long simulated run (trainvitals/simulate.py: every
logged step with its steps row, a row per layer and a row per rank, a few injected
faults), then times `analyzer.replay.replay_store` over it: every detector, every step.
Speed = simulated run duration (last step's time - first step's) / replay wall time.

    python bench/replay_speed.py                     # 100,000 steps, 64 ranks, 32 layers
    python bench/replay_speed.py --steps 20000 --ranks 1024

The last line is the headline. Building the store is not timed.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa

from trainvitals.analyzer import Analyzer
from trainvitals.analyzer.replay import replay_store
from trainvitals.schema import DTYPES, STORE_TABLES, TABLES, ddl
from trainvitals.simulate import FleetSpec, simulate

BUILD_CHUNK = 2000  # logged steps per insert while building the store


def arrow_tables(docs: list[dict]) -> dict[str, pa.Table]:
    """Schema batch documents -> one Arrow table per table, by concatenating columns.

    The simulator's documents are schema-shaped already; this skips schema.to_arrow's
    per-value validation (2 ms a step at 64 ranks), which would dominate the build.
    """
    out = {}
    for name, spec in TABLES.items():
        parts = [d[name] for d in docs if name in d]
        if not parts:
            continue
        sizes = [len(next(iter(p.values()))) for p in parts]
        arrays = {"run_id": pa.array([docs[0]["run_id"]] * sum(sizes), pa.string())}
        for f in spec.fields:
            chunks = [
                np.full(n, None, object) if p.get(f.name) is None else np.asarray(p[f.name])
                for p, n in zip(parts, sizes, strict=True)
            ]
            values = np.concatenate(chunks) if len(chunks) > 1 else chunks[0]
            arrays[f.name] = pa.array(
                values, pa.type_for_alias(DTYPES[f.dtype][1]), from_pandas=True
            )
        out[name] = pa.table(arrays)
    return out


def build_store(path: Path, spec: FleetSpec) -> None:
    con = duckdb.connect(str(path))
    for table in STORE_TABLES.values():
        con.execute(ddl(table))
    buf: list[dict] = []

    def flush() -> None:
        for name, table in arrow_tables(buf).items():
            con.register("incoming", table)
            con.execute(f"INSERT INTO {name} SELECT * FROM incoming")
            con.unregister("incoming")
        buf.clear()

    for doc in simulate(spec):
        buf.append(doc)
        if len(buf) >= BUILD_CHUNK:
            flush()
    if buf:
        flush()
    con.close()


LINES: list[str] = []


def say(line: str) -> None:
    print(line, flush=True)
    LINES.append(line)


def live_cost(ranks: int, layers: int, steps: int) -> float:
    """Seconds the Analyzer spends per logged step of a `ranks`-rank job, batches of one
    step each as the collector's live driver may feed it (conversion not timed)."""
    spec = FleetSpec(
        ranks=ranks,
        layers=layers,
        step_time_s=10.0,
        steps=steps,
        canary_every=10,
        faults=(f"straggler:rank=7,step={steps // 2},slowdown=0.2",),
    )
    batches = [arrow_tables([doc]) for doc in simulate(spec)]
    analyzer = Analyzer()
    start = time.perf_counter()
    for tables in batches:
        analyzer.observe(spec.run_id, tables)
    return (time.perf_counter() - start) / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=100_000)
    p.add_argument("--ranks", type=int, default=64)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--step-time-s", type=float, default=2.0, help="nominal step time")
    p.add_argument("--log-every", type=int, default=1, help="steps between logged steps")
    p.add_argument("--store", default="", help="reuse (or keep) the store at this path")
    p.add_argument(
        "--out",
        default=str(Path(__file__).parent / "results" / "replay_speed.txt"),
        help="also write the output here ('': don't)",
    )
    p.add_argument(
        "--live-ranks",
        type=int,
        default=16384,
        help="also time the analyzer per step of a job this large (0: skip)",
    )
    args = p.parse_args()
    say(" ".join(["$ python bench/replay_speed.py", *sys.argv[1:]]))
    faults = (
        f"straggler:rank=3,step={args.steps // 5},slowdown=0.2",
        f"sdc:rank=5,step={args.steps // 3}",
        f"spike:step={args.steps // 2}",
        f"stall:step={2 * args.steps // 3},seconds=300",
    )
    spec = FleetSpec(
        ranks=args.ranks,
        layers=args.layers,
        step_time_s=args.step_time_s,
        steps=args.steps,
        log_every=args.log_every,
        canary_every=50 * args.log_every,
        faults=faults,
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.store) if args.store else Path(tmp) / "long.duckdb"
        if not path.exists():
            start = time.perf_counter()
            build_store(path, spec)
            say(f"built {path.name}: {time.perf_counter() - start:.0f} s (not timed below)")
        con = duckdb.connect(str(path), read_only=True)
        ((logged, t0, t1),) = con.sql(
            "SELECT count(*), min(time_unix_s), max(time_unix_s) FROM steps"
        ).fetchall()
        ((rank_rows,),) = con.sql("SELECT count(*) FROM ranks").fetchall()
        start, cpu = time.perf_counter(), time.process_time()
        alerts = list(replay_store(con))
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        con.close()
    run_s = t1 - t0
    if args.live_ranks:
        per_step = live_cost(args.live_ranks, args.layers, 100)
        say(
            f"live: {1e3 * per_step:.1f} ms of analysis per logged step of {args.live_ranks:,} "
            f"ranks and {args.layers} layers (all detectors, 100 steps)"
        )
    say(
        f"run: {args.steps:,} steps ({logged:,} logged), {args.ranks} ranks, {args.layers} "
        f"layers, {rank_rows:,} rank rows, {run_s / 3600:.1f} h of training"
    )
    say(
        f"replay: {wall:.1f} s ({cpu:.1f} s CPU), {logged / wall:,.0f} logged steps/s, "
        f"{1e3 * wall / logged:.2f} ms per logged step, {len(alerts)} alerts: "
        f"{sorted({a.kind for a in alerts})}"
    )
    say(
        f"replay speed: {run_s / wall:,.0f}x real time "
        f"({args.steps:,} steps x {args.step_time_s} s, {args.ranks} ranks, {args.layers} "
        f"layers, every {args.log_every} step(s) logged)"
    )

    if args.out:
        Path(args.out).write_text("\n".join(LINES) + "\n")


if __name__ == "__main__":
    main()
