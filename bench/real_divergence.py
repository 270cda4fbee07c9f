"""Divergences of the reference trainer itself, slow and fast, scored against its own
clean run.

bench/loss_curves.py scores the loss detectors on curves a script draws. Here the curves
are real: 4 CPU ranks (dp 2 x tp 2) train the same model on the same data, once clean and
once per `--inject diverge:step=150,growth=G` (from step 150 the learning rate grows G x a
step, up to 10,000x: an optimiser tipping into instability, slowly for G near 1). The
runs share a seed, so until step 150 their losses are the same, and afterwards the clean
run's loss is what the diverging run's would have been. Two more diverge from step 400 of
700 (`late-*`, against a clean 700-step run: the schedule depends on the length), where
the loss has long stopped falling fast.

The onset of a divergence is not its fault's step: a learning rate growing 1-2% a step
first trains about as well, and the loss climbs only once the rate crosses what the model
tolerates. Each run reports, from a 9-step median of the losses:
- the first step after which its loss stays over the clean run's by 5% and by 10% (what
  the user loses; a run that merely trains slower gets there too, without a climb);
- the first step after which its loss stays 5% over its own lowest level since the fault
  ("climbs"), and whether it ever stays 10% over it: a divergence a detector that sees
  only this run can be asked to flag;
- the first loss alert after the fault, and the first that says the run diverges
  (`loss_diverging`, or `nonfinite` once the loss overflows): their latency from the
  fault and from the climb.
A run that climbs 10% and has no divergence alert is missed (a `loss_spike` says that a
step went wrong, not that the run keeps going wrong). Any loss alert in the clean run, or
before the fault, is false. Loaded runs train beside 8 busy processes on 2 cores (the
analyzer judges the logged losses, so the load changes only the timing; it is there to
show that).

    python bench/real_divergence.py [--only NAME,...] [--real-dir DIR] [--out FILE]

The telemetry files are kept in --real-dir and reused. The last line is the headline.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import orjson
from detect import RealRun, train  # bench/, run as a script

from trainvitals.analyzer import Analyzer
from trainvitals.analyzer.alerts import Alert
from trainvitals.schema import to_arrow

LOSS_KINDS = ("loss_spike", "loss_diverging", "nonfinite")
DIVERGENCE_KINDS = ("loss_diverging", "nonfinite")
SMOOTH_STEPS = 9  # the median that tells a climb from one noisy step
WITHIN_STEPS = 50  # the target: flagged within this many steps of the onset


@dataclass(frozen=True)
class Case:
    run: RealRun
    fault_step: int | None  # None: a clean run
    clean: str  # the clean run of the same length (the same schedule) it is measured against


def _case(growth: float | None, loaded: bool = False, steps: int = 450, at: int = 150) -> Case:
    """A run of `steps` steps whose learning rate grows `growth` x a step from `at`."""
    injects = () if growth is None else (f"diverge:step={at},growth={growth}",)
    run = RealRun(injects, steps, loaded, extra=("--seed", "11"))
    return Case(run, None if growth is None else at, "clean" if steps == 450 else f"clean{steps}")


RUNS = {"clean": _case(None), "loaded-clean": _case(None, loaded=True)}
for g in (1.01, 1.02, 1.05, 1.1, 1.3):
    RUNS[f"growth{g}"] = _case(g)
RUNS["loaded-growth1.02"] = _case(1.02, loaded=True)
RUNS["loaded-growth1.1"] = _case(1.1, loaded=True)
# Long after the first fall: 700 steps, from step 400, where the loss has flattened.
RUNS["clean700"] = _case(None, steps=700)
for g in (1.02, 1.05):
    RUNS[f"late-growth{g}"] = _case(g, steps=700, at=400)


def read(path: Path) -> tuple[dict[int, float], list[Alert]]:
    """The run's logged loss per step, and every alert the analyzer raises on it."""
    analyzer, losses, alerts = Analyzer(), {}, []
    for line in path.read_bytes().splitlines():
        run_id, tables = to_arrow(orjson.loads(line))
        if "steps" in tables:
            cols = tables["steps"].select(["step", "loss"]).to_pydict()
            losses.update(zip(cols["step"], cols["loss"], strict=True))
        alerts += analyzer.observe(run_id, tables)
    return losses, alerts


def smoothed(losses: dict[int, float], steps: np.ndarray) -> np.ndarray:
    """A centred SMOOTH_STEPS-step median of the losses at `steps` (NaN where missing)."""
    x = np.array([losses.get(int(s), np.nan) for s in steps], dtype="float64")
    half = SMOOTH_STEPS // 2
    padded = np.pad(x, half, constant_values=np.nan)
    windows = np.lib.stride_tricks.sliding_window_view(padded, SMOOTH_STEPS)
    with np.errstate(all="ignore"):
        return np.nanmedian(windows, axis=1)


def stays_over(ratio: np.ndarray, steps: np.ndarray, by: float) -> int | None:
    """The first step from which `ratio` (diverging / clean) stays over 1 + `by` to the
    run's end (or to its first non-finite loss); None if it never does."""
    finite = np.isfinite(ratio)
    end = int(np.argmin(finite)) if not finite.all() else len(ratio)
    over = ratio[:end] > 1 + by
    if not len(over) or not over[-1]:
        return None
    below = np.flatnonzero(~over)
    return int(steps[below[-1] + 1]) if len(below) else int(steps[0])


def judge(name: str, losses: dict[int, float], alerts: list[Alert], clean: dict[int, float]):
    """Lines of the report, whether the run climbed (its loss stayed 10% over its own
    lowest since the fault), the first alert's latency from the climb's start (None:
    none), false alerts."""
    raised = [a for a in alerts if a.kind in LOSS_KINDS and a.severity != "resolved"]
    case = RUNS[name]
    if case.fault_step is None:
        lines = [f"{name}: clean, {len(raised)} loss alerts (every one false)"]
        lines += [f"    FALSE {a.kind} at step {a.step}: {a.message[:150]}" for a in raised]
        return lines, False, None, len(raised)
    fault = case.fault_step
    false = [a for a in raised if a.step < fault]
    after = [a for a in raised if a.step >= fault]
    steps = np.arange(fault, case.run.steps)
    own = smoothed(losses, steps)
    with np.errstate(all="ignore"):
        ratio = own / smoothed(clean, steps)
        climb = own / np.fmin.accumulate(np.where(np.isfinite(own), own, np.inf))
    lost5, lost10 = stays_over(ratio, steps, 0.05), stays_over(ratio, steps, 0.10)
    climb5, climbed = stays_over(climb, steps, 0.05), stays_over(climb, steps, 0.10) is not None
    peak = float(np.nanmax(ratio)) if np.isfinite(ratio).any() else float("nan")
    lines = [
        f"{name}: over the clean run's loss by 5% from step {lost5}, by 10% from {lost10} "
        f"(at most {peak:.3g}x); climbs 5% over its own lowest from step {climb5}"
        + ("" if climbed else ", never stays 10% over it (no climb to flag)")
    ]
    latency = None
    diverging = [a for a in after if a.kind in DIVERGENCE_KINDS]
    for what, hits in (("first alert", after), ("first divergence alert", diverging)):
        if not hits:
            continue
        first = hits[0]
        since = "n/a" if climb5 is None else f"{first.step - climb5:+d}"
        lines.append(
            f"    {what}: {first.kind} at step {first.step} (fault "
            f"+{first.step - fault}, climb {since}): {first.message[:150]}"
        )
        if what == "first divergence alert" and climb5 is not None:
            latency = first.step - climb5
    if not diverging:
        lines.append("    no divergence alert after the fault" + (" (MISSED)" if climbed else ""))
    lines += [f"    FALSE {a.kind} at step {a.step}: {a.message[:150]}" for a in false]
    return lines, climbed, latency, len(false)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", help=f"comma-separated among {','.join(RUNS)}")
    p.add_argument(
        "--real-dir", default=str(Path(tempfile.gettempdir()) / "trainvitals-divergence"),
        help="telemetry files of the runs (made once, then reused)",
    )  # fmt: skip
    p.add_argument("--out", help="also write the report here")
    args = p.parse_args()
    names = args.only.split(",") if args.only else list(RUNS)
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        p.error(f"--only: no run {unknown[0]!r} (runs: {', '.join(RUNS)})")
    out_dir = Path(args.real_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = [
        "$ python bench/real_divergence.py " + " ".join(sys.argv[1:]),
        f"# {os.cpu_count()} cores, 1-min load average {os.getloadavg()[0]:.1f} at the start",
    ]

    def telemetry(name: str) -> tuple[Path, str]:
        path = out_dir / f"{name}.jsonl"
        made = train(name, RUNS[name].run, path) if not path.exists() else f"reused {path}"
        return path, made

    cleans: dict[str, dict[int, float]] = {}  # every divergence is measured against one
    latencies: list[int] = []
    diverged = missed = false = 0
    for name in names:
        clean = RUNS[name].clean
        if clean not in cleans:
            clean_path, clean_note = telemetry(clean)
            cleans[clean] = read(clean_path)[0]
            lines.append(f"# the clean run {clean}: {clean_note}")
        path, note = telemetry(name)
        losses, alerts = read(path)
        report, climbed, latency, f = judge(name, losses, alerts, cleans[clean])
        lines += [f"{report[0]} ({note})", *report[1:]]
        false += f
        if climbed:
            diverged += 1
            if latency is None:
                missed += 1
            else:
                latencies.append(latency)
    within = sum(1 for x in latencies if x <= WITHIN_STEPS)
    median = f"{statistics.median(latencies):.0f}" if latencies else "n/a"
    worst = f"{max(latencies)}" if latencies else "n/a"
    lines.append(
        f"real divergences (runs whose loss climbed 10%): {diverged - missed}/{diverged} "
        f"flagged, {within} within {WITHIN_STEPS} steps of the climb's start, latency from "
        f"it median {median}, worst {worst} steps; {false} false loss alerts"
    )
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
