"""Cost of the hooks on the CPU reference run: 4 ranks, dp=2 x tp=2, hooks off and on.

Runs the reference trainer under torchrun with `--hooks off` and with the hooks on (at the
default interval, every step, and every 10 steps), interleaved and repeated so that the
machine's noise falls on every configuration alike. Each run prints its steady step time
(steps after the warm-up); the figure is the ratio of medians. Prints it on its last line.

    python bench/trainer_overhead.py --repeats 3 --steps 60
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess

from trainvitals.trainer.launch import torchrun_command

CONFIGS = {"off": ["--hooks", "off"], "every step": ["--log-every", "1"],
           "every 10 steps": ["--log-every", "10"]}  # fmt: skip


def steady_ms(extra: list[str], steps: int) -> float:
    argv = torchrun_command(4, ["--dp", "2", "--tp", "2", "--steps", str(steps), *extra])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(argv, capture_output=True, text=True, env=env, check=True).stdout
    return float(re.search(r"steady step time: ([\d.]+) ms", out).group(1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=60)
    args = p.parse_args()
    times: dict[str, list[float]] = {name: [] for name in CONFIGS}
    for repeat in range(args.repeats):
        order = list(CONFIGS) if repeat % 2 == 0 else list(reversed(CONFIGS))
        for name in order:
            times[name].append(steady_ms(CONFIGS[name], args.steps))
            print(f"repeat {repeat}: hooks {name}: {times[name][-1]:.2f} ms/step", flush=True)
    base = statistics.median(times["off"])
    for name in ("every step", "every 10 steps"):
        ratio = statistics.median(times[name]) / base - 1
        print(f"hooks logging {name}: {100 * ratio:+.2f}% step time vs off ({base:.2f} ms/step)")
    default = statistics.median(times["every step"]) / base - 1
    print(
        f"hook overhead on the CPU reference run (4 ranks, dp=2 x tp=2, default interval): "
        f"{100 * default:+.2f}%"
    )


if __name__ == "__main__":
    main()
