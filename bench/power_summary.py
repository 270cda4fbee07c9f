"""Power of the runs in a store, per phase: what bench/gpu_power_run.sh's figures come from.

    python bench/power_summary.py STORE --phase-steps 100   # --baseline RUN --faulty RUN

Per run and phase of `--phase-steps` steps: the median device power (NVML, over ranks and
logged steps) and the median step time; per run: its energy (the job's, at its last step)
and its tokens per joule (a logged step's tokens stand for every step: the runs train a
fixed batch). The last line compares the faulty run's energy with the
baseline's for the same tokens.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import duckdb


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("store", type=Path)
    parser.add_argument("--phase-steps", type=int, default=100)
    parser.add_argument("--baseline", default="gpu-baseline")
    parser.add_argument("--faulty", default="gpu-faulty")
    args = parser.parse_args()
    if not args.store.is_file():
        parser.error(f"{args.store}: no such store")
    if args.phase_steps < 1:
        parser.error("--phase-steps must be at least 1")
    db = duckdb.connect(str(args.store), read_only=True)
    phases = db.execute(
        "SELECT run_id, step // ? AS phase, median(power_w), median(step_time_s) "
        "FROM ranks GROUP BY ALL ORDER BY ALL",
        [args.phase_steps],
    ).fetchall()
    for run_id, phase, power_w, step_s in phases:
        first = phase * args.phase_steps
        print(f"{run_id} steps {first}-{first + args.phase_steps - 1}: median power "
              f"{power_w:.0f} W, median step {1e3 * step_s:.1f} ms")  # fmt: skip
    totals = dict(
        (run_id, (energy_j, tokens))
        for run_id, energy_j, tokens in db.execute(
            "SELECT run_id, arg_max(energy_j, step), avg(tokens) * (max(step) + 1) "
            "FROM steps GROUP BY run_id"
        ).fetchall()
    )
    for run_id, (energy_j, tokens) in sorted(totals.items()):
        print(f"{run_id}: {energy_j / 1e3:.2f} kJ, {tokens:,.0f} tokens, "
              f"{tokens / energy_j:.0f} tokens per joule")  # fmt: skip
    if args.baseline in totals and args.faulty in totals:
        base_j, faulty_j = totals[args.baseline][0], totals[args.faulty][0]
        print(f"energy of {args.faulty} against {args.baseline}: {faulty_j / 1e3:.2f} kJ vs "
              f"{base_j / 1e3:.2f} kJ ({100 * (faulty_j / base_j - 1):+.0f}%)")  # fmt: skip


if __name__ == "__main__":
    main()
