"""How much slower an injected straggler made its rank: the check of the straggler fault on
a real run, on any device (bench/gpu_check.sh runs it on CUDA, where the fault's clock uses
CUDA events).

    python bench/straggler_check.py RUN.jsonl --from-step 20 --slowdown 0.5

Reads the run's telemetry file (`trainvitals train --telemetry-file`), compares the median
step time of the ranks rows before the fault's step with that from a few steps after it
(the straggler's baseline settles), and prints the measured slowdown against the asked one
on its last line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

SETTLE_STEPS = 5  # after the fault's step: the baseline's median window fills


def step_times_s(path: str, rank: int) -> dict[int, float]:
    """step -> step_time_s of `rank`'s ranks rows in a JSON-lines telemetry file. Exits
    with a message naming the file and line for a file it cannot read."""
    times = {}
    try:
        with open(path) as f:
            for number, line in enumerate(f, 1):
                try:
                    ranks = json.loads(line).get("ranks") if line.strip() else None
                    if ranks:
                        rows = zip(ranks["step"], ranks["rank"], ranks["step_time_s"], strict=True)
                        times.update({s: t for s, r, t in rows if r == rank and t is not None})
                except (ValueError, AttributeError, KeyError, TypeError) as e:
                    sys.exit(
                        f"{path}, line {number}: not a telemetry batch with ranks columns "
                        f"step, rank and step_time_s ({type(e).__name__}: {e}); pass the file "
                        "`trainvitals train --telemetry-file` wrote"
                    )
    except OSError as e:
        sys.exit(f"cannot read {path}: {e.strerror or e}")
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("telemetry", help="the run's JSON-lines telemetry file")
    p.add_argument("--from-step", type=int, required=True, help="the straggler fault's step")
    p.add_argument("--slowdown", type=float, required=True, help="the fault's slowdown")
    p.add_argument("--rank", type=int, default=0, help="the straggling rank (default 0)")
    args = p.parse_args()
    times = step_times_s(args.telemetry, args.rank)
    # Step 0 and the first steps carry start-up work (allocator, first collectives).
    before = [t for s, t in times.items() if 3 <= s < args.from_step]
    after = [t for s, t in times.items() if s >= args.from_step + SETTLE_STEPS]
    if len(before) < 3 or len(after) < 3:
        held = f"steps {min(times)}-{max(times)}" if times else "none"
        sys.exit(
            f"too few logged steps of rank {args.rank} around step {args.from_step}: "
            f"{len(before)} in steps 3-{args.from_step - 1}, {len(after)} from step "
            f"{args.from_step + SETTLE_STEPS} (3 each needed); the file holds {held}"
        )
    normal_s, slow_s = statistics.median(before), statistics.median(after)
    print(f"rank {args.rank}: median step {normal_s * 1e3:.1f} ms before step {args.from_step}, "
          f"{slow_s * 1e3:.1f} ms from step {args.from_step + SETTLE_STEPS}")  # fmt: skip
    print(f"straggler slowdown: measured {slow_s / normal_s - 1:+.2f}, asked {args.slowdown:+.2f}")


if __name__ == "__main__":
    main()
