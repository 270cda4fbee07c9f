"""The straggler detector's restless window on recorded loaded runs: what it spares and
what it costs.

The recorded clean runs tests/analyzer/data/loaded_clean_{a,b}.csv (4 real CPU ranks,
1,000 steps, 8 busy processes on 2 cores) carry a busy machine's own noise. Into them
`splice_slowdown` (trainvitals/simulate.py) puts, one at a time:
- a busy neighbour's burst: a rank 25% slower for 30 steps, keeping the others waiting
  (no straggler: a busy neighbour on a shared machine);
- a straggler: a rank 15% or 25% slower from its onset to the run's end.
Each is judged by the straggler detector with its defaults (a restless cohort's window is
restless_persist_steps) and with the quiet window always (restless_share=1), side by
side. Latency: steps from the onset to the alert. The last line is the headline.

    python bench/straggler_restless.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

from trainvitals.analyzer.straggler import StragglerDetector, StragglerSettings
from trainvitals.analyzer.views import RankView, StepView
from trainvitals.simulate import splice_slowdown

DATA = Path(__file__).parents[1] / "tests" / "analyzer" / "data"
RUNS = ("loaded_clean_a.csv", "loaded_clean_b.csv")
RANKS = (1, 2)
ONSETS = (150, 300, 500, 700)
BURST_STEPS, BURST_SLOWDOWN = 30, 0.25
STRAGGLER_SLOWDOWNS = (0.15, 0.25)
JUDGES = {
    "restless window": StragglerSettings(),
    "quiet window": StragglerSettings(restless_share=1.0),
}


def alerts(compute_s: np.ndarray, waits_s: np.ndarray, settings: StragglerSettings) -> list:
    detector, out = StragglerDetector(settings), []
    for step, (compute, waits) in enumerate(zip(compute_s, waits_s, strict=True)):
        end_s = float((compute + waits).max())
        ranks = RankView.of(compute_time_s=compute.tolist(), wait_time_s=waits.tolist())
        view = StepView("r", step, float(step), 2.0, 1.0, step_time_s=end_s, ranks=ranks)
        out += [a for a in detector.observe(view) if a.severity != "resolved"]
    return out


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()  # -h; no flags
    bursts_named = dict.fromkeys(JUDGES, 0)
    latencies: dict[str, list[int]] = {j: [] for j in JUDGES}
    missed = dict.fromkeys(JUDGES, 0)
    n_bursts = 0
    for name in RUNS:
        table = np.loadtxt(DATA / name, delimiter=",")
        compute, waits = table[:, :4], table[:, 4:8]
        for rank in RANKS:
            for onset in ONSETS:
                burst = splice_slowdown(compute, waits, rank, onset, onset + BURST_STEPS,
                                        BURST_SLOWDOWN)  # fmt: skip
                n_bursts += 1
                for judge, settings in JUDGES.items():
                    named = [a for a in alerts(*burst, settings) if a.rank == rank]
                    bursts_named[judge] += any(onset <= a.step for a in named)
                for slowdown in STRAGGLER_SLOWDOWNS:
                    slowed = splice_slowdown(compute, waits, rank, onset, len(table), slowdown)
                    line = []
                    for judge, settings in JUDGES.items():
                        hit = [a.step - onset for a in alerts(*slowed, settings)
                               if a.rank == rank and a.step >= onset]  # fmt: skip
                        if hit:
                            latencies[judge].append(hit[0])
                        else:
                            missed[judge] += 1
                        line.append(f"{judge} {hit[0] if hit else 'missed'}")
                    print(
                        f"{name} rank {rank} {slowdown:.0%} from step {onset}: " + ", ".join(line)
                    )
    print()
    for judge in JUDGES:
        lat = latencies[judge]
        print(f"{judge}: 30-step bursts named {bursts_named[judge]}/{n_bursts}; stragglers "
              f"named {len(lat)}/{len(lat) + missed[judge]}, latency median/max "
              f"{statistics.median(lat):.0f}/{max(lat)} steps")  # fmt: skip
    r, q = (latencies[j] for j in JUDGES)
    print(
        f"HEADLINE: busy-neighbour bursts named {bursts_named['restless window']}/{n_bursts} "
        f"(quiet window {bursts_named['quiet window']}/{n_bursts}); straggler latency median "
        f"{statistics.median(r):.0f} steps (quiet window {statistics.median(q):.0f})"
    )


if __name__ == "__main__":
    sys.exit(main())
