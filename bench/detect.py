"""Detector quality on labeled scenarios: recall, precision, latency, culprit named.

Two sources of labeled runs, both fed through the Analyzer the collector runs:
- simulated fleets (trainvitals/simulate.py): 32 ranks on 4 nodes, 8 layers, 2 s steps,
  every step logged, canaries every 50 steps; 1% device-speed spread, 1% step noise, a
  daily drift, learning-rate warm-up then cosine decay, a loss falling from 11 to 2, and
  on top (here) one-off 50% compute hiccups on a random rank in 5% of the steps. Each
  faulty run carries one transient fault (a loss spike, a stall, a NaN) early and one
  persistent fault (a straggler, an SDC unit, a throttled GPU, a rank that holds the
  job up for one step in 10-50) later; clean runs carry
  the same noise and no fault. Two spike variants are made here from the simulator's
  output: a spike led by one layer (its gradient norm and activations blow up two steps
  before the loss jumps) and a spike made by one rank (its local loss jumps, as when a
  rank's data or arithmetic goes wrong; large enough to move the job's mean loss);
- real trainer runs (torchrun on CPU, 4 ranks dp=2 x tp=2, canary every 10 steps) with
  faults injected by trainer/faults.py, and clean runs of 60 to 1,000 steps (REAL_RUNS),
  logged every step, and some logged every 10 (a few of those at dp=4).
  Most train while the bench itself loads the machine to 4x its cores with busy
  processes, killed after each run; a few (a 15% straggler on 4 and on 8 ranks, a clean
  run of each size) add no load. Their telemetry files are kept in --real-dir and reused; delete
  them to train again. The real runs take about an hour on 2 cores (the 1,000-step runs
  logged every 10 steps, 4-8 minutes each, are most of it; `--only` picks some).

False alerts are reported per 10,000 clean steps, for every kind, separately for the
simulated, the loaded real and the quiet real runs. The last line is the headline.
`--only` trains and scores some real runs alone, without the simulated fleets (on a
machine of any size: the load follows its core count), `--real-steps` shortens them.

Scoring: a fault is found by a detector when an alert of its kind comes within the
fault's window (EXPECT; a straggler named in a restless cohort, whose message says so, 30
steps more: restless_persist_steps - persist_steps; in a run logged every k steps, a
straggler's window is at least min_logged_steps x k); latency is in logged steps. An
alert is explained when it falls
in a fault's window of its own kind or of a known knock-on effect (KNOCK_ON: a throttled
GPU also makes a straggler); precision is explained alerts / all alerts of the kind. Every
alert of a clean run is false.

    python bench/detect.py --scenarios 40 --steps 2000      # writes bench/results/detect.txt
    python bench/detect.py --only quiet-8rank-straggler15,clean-long-0 --real-dir DIR
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import orjson
import pyarrow.compute as pc

from trainvitals.analyzer import Analyzer
from trainvitals.analyzer.alerts import Alert
from trainvitals.analyzer.config import AnalyzerConfig
from trainvitals.analyzer.straggler import StragglerSettings
from trainvitals.schema import to_arrow
from trainvitals.simulate import FleetSpec, simulate
from trainvitals.trainer.launch import torchrun_command

REPO = Path(__file__).resolve().parent.parent
SIM_CANARY_EVERY = 50
REAL_CANARY_EVERY = 10
# fault kind -> [(alert kind, window in steps, culprit the alert should name)]; "canary":
# the scenario's canary interval. A detector is scored only where its signal exists.
EXPECT = {
    "straggler": [("straggler", 30, "rank")],
    # A rank that holds the job up for single steps (hiccups): named once they cost the
    # job 3% of a 500-step window, the third at the earliest.
    "intermittent": [("intermittent_straggler", 150, "rank")],
    "sdc": [
        ("sdc", "canary", "rank"),
        ("sdc_replica", "canary", "rank"),
        ("sdc_outlier", 30, "rank"),
    ],
    "spike": [("loss_spike", 5, "truth")],
    "stall": [("stall", 1, "truth")],
    "throttle": [("throttle", 30, "rank")],
    "nan": [("nonfinite", 1, None)],
}
# Alerts that a fault causes besides its own, within KNOCK_ON_STEPS: not false alerts.
KNOCK_ON = {
    "straggler": {"throughput_drop"},
    "intermittent": {"throughput_drop"},
    "throttle": {"straggler", "throughput_drop"},
    "sdc": {"loss_spike", "loss_diverging", "nonfinite"},
    "spike": {"loss_diverging"},
    "nan": {"loss_spike", "loss_diverging"},
    "stall": set(),
}
KNOCK_ON_STEPS = 2000
DEFAULT_OUT = REPO / "bench" / "results" / "detect.txt"


@dataclass(frozen=True)
class Truth:
    kind: str  # a key of EXPECT
    step: int
    rank: int | None = None
    layer: int | None = None
    label: str = ""  # variant and size, for the listing
    size: float = 0.0  # spike variants made here: the factor on the job's loss


@dataclass
class Scenario:
    name: str
    source: str  # "sim" or "real"
    faults: list[Truth]
    steps: int
    canary_every: int
    signals: set[str] = field(default_factory=set)  # alert kinds whose signal exists
    anonymous: set[str] = field(default_factory=set)  # kinds that cannot name a culprit here
    alerts: list = field(default_factory=list)
    log_every: int = 1  # steps between logged steps


# ---------------------------------------------------------------------------- simulated


def sim_faults(rng: random.Random, steps: int, ranks: int, layers: int) -> tuple[list, list]:
    """(simulator fault specs, truths): one transient fault early, one persistent later."""
    specs, truths = [], []
    t_step = rng.randrange(300, steps // 2 - 100)
    transient = rng.choice(["spike", "spike_layer", "spike_rank", "stall", "stall_rank", "nan"])
    factor = rng.choice([1.5, 2.0, 3.0, 5.0])
    if transient == "spike":
        specs.append(f"spike:step={t_step},factor={factor}")
        truths.append(Truth("spike", t_step, label=f"shared {factor}x"))
    elif transient == "spike_layer":
        layer = rng.randrange(layers)
        specs.append(f"spike:step={t_step},factor={factor}")
        truths.append(Truth("spike", t_step, layer=layer, label=f"layer {layer} led, {factor}x"))
    elif transient == "spike_rank":
        rank = rng.randrange(ranks)
        label = f"rank {rank}'s loss, {factor}x"
        truths.append(Truth("spike", t_step, rank=rank, label=label, size=factor))
    elif transient.startswith("stall"):
        seconds = rng.choice([120, 300, 900])
        rank = rng.randrange(ranks) if transient == "stall_rank" else -1
        # No rank: the whole job stalls (the fault language takes no rank -1).
        on_rank = f",rank={rank}" if rank >= 0 else ""
        specs.append(f"stall:step={t_step},seconds={seconds}{on_rank}")
        truths.append(
            Truth(
                "stall",
                t_step,
                rank=rank if rank >= 0 else None,
                label=f"{seconds} s" + (f" on rank {rank}" if rank >= 0 else ""),
            )
        )
    else:
        specs.append(f"nan:step={t_step}")
        truths.append(Truth("nan", t_step))
    p_step = rng.randrange(steps // 2, steps - 300)
    rank = rng.randrange(ranks)
    persistent = rng.choice(["straggler", "sdc", "throttle", "intermittent"])
    if persistent == "straggler":
        slowdown = rng.choice([0.1, 0.2, 0.5])
        specs.append(f"straggler:rank={rank},step={p_step},slowdown={slowdown}")
        truths.append(Truth("straggler", p_step, rank, label=f"{slowdown:.0%} slower"))
    elif persistent == "intermittent":
        # One step in `every` computing (1 + slowdown)x as long: 10-20% of the job's time.
        slowdown, every = rng.choice([(2, 10), (4, 25), (9, 50)])
        specs.append(f"straggler:rank={rank},step={p_step},slowdown={slowdown},every={every}")
        label = f"{1 + slowdown}x its compute one step in {every}"
        truths.append(Truth("intermittent", p_step, rank, label=label))
    elif persistent == "sdc":
        grad = rng.choice([1.5, 3.0, 30.0])
        specs.append(f"sdc:rank={rank},step={p_step},grad_factor={grad}")
        truths.append(Truth("sdc", p_step, rank, label=f"local grad norm {grad}x"))
    else:
        drop, reasons = rng.choice([0.1, 0.2, 0.3]), rng.choice([0x4, 0x8, 0x20, 0x40])
        specs.append(f"throttle:rank={rank},step={p_step},clock_drop={drop},reasons={reasons}")
        truths.append(Truth("throttle", p_step, rank, label=f"clock -{drop:.0%}, 0x{reasons:x}"))
    return specs, truths


def perturb(doc: dict, truths: list[Truth], rng: np.random.Generator, ranks: int) -> None:
    """Hiccups on every run; the layer-led and rank-made spike variants (in place)."""
    if "ranks" not in doc:
        return
    r, step = doc["ranks"], int(doc["steps"]["step"][0])
    if rng.random() < 0.05:  # a one-off 50% hiccup: the others wait for it
        r["compute_time_s"] = r["compute_time_s"].copy()
        r["compute_time_s"][rng.integers(ranks)] *= 1.5
        arrival = r["data_time_s"] + r["compute_time_s"]
        r["wait_time_s"] = arrival.max() - arrival
    for t in truths:
        if t.kind != "spike":
            continue
        if t.layer is not None and t.step - 2 <= step <= t.step:
            doc["layers"]["grad_norm"] = doc["layers"]["grad_norm"].copy()
            doc["layers"]["grad_norm"][t.layer] *= 8
            doc["layers"]["act_max_abs"] = doc["layers"]["act_max_abs"].copy()
            doc["layers"]["act_max_abs"][t.layer] *= 4
        if t.rank is not None and t.step <= step < t.step + 3:
            # The job's mean loss rises by `factor` through this one rank's local loss.
            rise = (t.size - 1) * 0.5 ** (step - t.step)
            loss = r["loss"].copy()
            loss[t.rank] += rise * ranks * float(doc["steps"]["loss"][0])
            r["loss"] = loss
            doc["steps"]["loss"] = np.array([loss.mean()])


def run_sim(
    spec: FleetSpec, truths: list[Truth], seed: int, config: AnalyzerConfig, chunk: int = 250
) -> list:
    """Alerts of one simulated run, fed to the Analyzer in chunks of logged steps."""
    # bench/ is on sys.path when run as a script; it needs DuckDB, which real runs do not.
    from replay_speed import arrow_tables

    analyzer, alerts, buf = Analyzer(config=config), [], []
    rng = np.random.default_rng(seed)
    for doc in simulate(spec):
        perturb(doc, truths, rng, spec.ranks)
        buf.append(doc)
        if len(buf) == chunk:
            alerts += analyzer.observe(spec.run_id, arrow_tables(buf))
            buf.clear()
    if buf:
        alerts += analyzer.observe(spec.run_id, arrow_tables(buf))
    return alerts


def sim_scenarios(args: argparse.Namespace) -> list[Scenario]:
    rng = random.Random(args.seed)
    out = []
    for i in range(2 * args.scenarios):
        clean = i % 2 == 1
        specs, truths = ([], []) if clean else sim_faults(rng, args.steps, args.ranks, 8)
        spec = FleetSpec(
            ranks=args.ranks,
            layers=8,
            step_time_s=2.0,
            steps=args.steps,
            seed=1000 + i,
            canary_every=SIM_CANARY_EVERY,
            faults=tuple(specs),
            run_id=f"sim-{i}",
        )
        sc = Scenario(spec.run_id, "sim", truths, args.steps, SIM_CANARY_EVERY)
        sc.signals = {k for v in EXPECT.values() for k, _, _ in v}
        sc.alerts = run_sim(spec, truths, seed=i, config=args.config)
        out.append(sc)
        what = ", ".join(f"{t.kind} {t.label}" for t in truths) or "clean"
        print(
            f"  {sc.name}: {what} -> {len(sc.alerts)} alerts",
            file=sys.stderr,
            flush=True,
        )
    return out


# ---------------------------------------------------------------------------- real runs


@dataclass(frozen=True)
class RealRun:
    """One reference-trainer run: its faults, length, ranks, and whether the bench loads
    the machine while it trains."""

    injects: tuple[str, ...] = ()
    steps: int = 60
    loaded: bool = True
    nproc: int = 4
    extra: tuple[str, ...] = ()
    tp: int = 2  # 2: 4 ranks are 2 x 2 and 8 ranks 4 x 2

    @property
    def layout(self) -> list[str]:
        return ["--dp", str(self.nproc // self.tp), "--tp", str(self.tp)]

    @property
    def log_every(self) -> int:
        flags = list(self.extra)
        return int(flags[flags.index("--log-every") + 1]) if "--log-every" in flags else 1


def clean_every10(seed: int, tp: int = 2) -> RealRun:
    """A clean loaded run of LONG_STEPS steps, logged every 10."""
    return RealRun(steps=LONG_STEPS, extra=("--seed", str(seed), "--log-every", "10"), tp=tp)


# The machine's load while a loaded run trains: BUSY_PER_CORE busy processes per core,
# started before the run and killed after it. 4 per core is the issue's "load of 4x its
# cores". What each runs (`--load`): "spin", a pure-Python loop (the scheduler's load
# alone, the shape the straggler detector was tuned beside); "torch", another user's
# training job: single-threaded 768x768 matmuls and 64 MB copies, which also take the
# caches and the memory bandwidth the ranks use.
BUSY_PER_CORE = 4
NEIGHBOURS = {
    "spin": "while True: pass",
    "torch": (
        "import torch\ntorch.set_num_threads(1)\na = torch.randn(768, 768)\n"
        "src = torch.randn(16 * 2**20)\ndst = torch.empty_like(src)\n"
        "while True:\n    a @ a\n    dst.copy_(src)"
    ),
}
LONG_STEPS = 1000  # clean loaded runs: a false straggler must not appear in 1,000 steps
REAL_RUNS = {
    "straggler40-sdc": RealRun(("straggler:rank=1,step=15,slowdown=0.4", "sdc:rank=2,step=30")),
    "straggler15": RealRun(("straggler:rank=3,step=20,slowdown=0.15",), steps=100),
    "straggler15-r1": RealRun(("straggler:rank=1,step=30,slowdown=0.15",), steps=100),
    "sdc": RealRun(("sdc:rank=1,step=25,fraction=0.001",)),
    "spike-batch": RealRun(("spike:step=30,kind=batch",)),
    "spike-lr-nan": RealRun(("spike:step=25,kind=lr", "nan:step=50")),
    "clean-lr": RealRun(extra=("--seed", "2", "--lr", "6e-3")),
    # Late enough for the cohort's bursts of the first 250 steps to make it restless.
    "straggler15-late": RealRun(("straggler:rank=2,step=250,slowdown=0.15",), steps=350),
    "clean-long-0": RealRun(steps=LONG_STEPS, extra=("--seed", "3")),
    "clean-long-1": RealRun(steps=LONG_STEPS, extra=("--seed", "4")),
    # Logged every 10 steps, as many users log: a window of min_logged_steps logged steps
    # is 60 training steps, and a busy neighbour's slowdown fills fewer logged steps in a row.
    "clean-long-every10-0": clean_every10(seed=7),
    "clean-long-every10-1": clean_every10(seed=8),
    # dp=4 (every collective timed there); the last two were trained after min_logged_steps
    # was chosen on the others.
    **{f"clean-long-dp4-every10-{i}": clean_every10(seed=9 + i, tp=1) for i in range(6)},
    "straggler15-every10": RealRun(
        ("straggler:rank=3,step=100,slowdown=0.15",), steps=300, extra=("--log-every", "10")
    ),
    # No load added by the bench (other work on the machine goes on).
    "quiet-straggler15": RealRun(("straggler:rank=2,step=20,slowdown=0.15",), 100, False),
    "quiet-straggler15-every10": RealRun(
        ("straggler:rank=2,step=50,slowdown=0.15",), 200, False, extra=("--log-every", "10")
    ),
    "quiet-clean": RealRun(steps=200, loaded=False, extra=("--seed", "5")),
    "quiet-8rank-straggler15": RealRun(
        ("straggler:rank=5,step=10,slowdown=0.15",), steps=60, loaded=False, nproc=8
    ),
    "quiet-8rank-clean": RealRun(steps=200, loaded=False, nproc=8, extra=("--seed", "6")),
}


@contextmanager
def busy_machine(loaded: bool, load: str = "spin") -> Iterator[None]:
    """BUSY_PER_CORE busy processes per core, each running NEIGHBOURS[load], while the
    block runs (none if not loaded)."""
    procs = []
    if loaded:
        busy = [sys.executable, "-c", NEIGHBOURS[load]]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        procs = [
            subprocess.Popen(busy, env=env) for _ in range(BUSY_PER_CORE * (os.cpu_count() or 1))
        ]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def train(name: str, run: RealRun, path: Path, load: str = "spin") -> str:
    """Run the trainer into the telemetry file `path`; a note on the machine's load."""
    # CPU and gloo on any machine: the figures are CPU runs' (a GPU would be picked by "auto").
    flags = [*run.layout, "--device", "cpu", "--steps", str(run.steps), "--canary-every",
             str(REAL_CANARY_EVERY), "--telemetry-file", str(path), *run.extra]  # fmt: skip
    for spec in run.injects:
        flags += ["--inject", spec]
    print(f"  training {name} ({run.steps} steps) ...", file=sys.stderr, flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with busy_machine(run.loaded, load):
        started = time.monotonic()
        proc = subprocess.run(
            torchrun_command(run.nproc, flags), capture_output=True, text=True, env=env,
            timeout=1800,
        )  # fmt: skip
        load = os.getloadavg()[0]
    if proc.returncode != 0:
        path.unlink(missing_ok=True)
        raise RuntimeError(f"trainer run {name} failed:\n{proc.stderr[-3000:]}")
    return (
        f"trained in {time.monotonic() - started:.0f} s, 1-min load average {load:.1f} at its end"
    )


def chosen_runs(only: str | None, steps: int | None) -> dict[str, RealRun]:
    """REAL_RUNS, or those named in `only` (comma-separated), at `steps` steps if given.
    SystemExit naming the runs there are for a name that is not one."""
    names = only.split(",") if only else list(REAL_RUNS)
    unknown = [n for n in names if n not in REAL_RUNS]
    if unknown:
        sys.exit(f"--only: no real run {unknown[0]!r} (runs: {', '.join(REAL_RUNS)})")
    runs = {n: REAL_RUNS[n] for n in names}
    if steps is None:
        return runs
    from trainvitals.trainer.faults import parse_fault  # imports torch: only when asked

    # A fault must leave the window of its longest-waiting detector (EXPECT: 30 steps).
    late = [f for n in names for f in runs[n].injects if parse_fault(f).step > steps - 30]
    if steps < 60 or late:
        sys.exit(f"--real-steps {steps}: must be >= 60 and leave 30 steps after each fault"
                 f"{f' ({late[0]})' if late else ''}")  # fmt: skip
    return {n: replace(r, steps=steps) for n, r in runs.items()}


def real_scenarios(args: argparse.Namespace) -> list[Scenario]:
    out_dir = Path(args.real_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    out = []
    for name, run in chosen_runs(args.only, args.real_steps).items():
        # Another length is another run: never reuse a file of the default length for it.
        stem = name if args.real_steps is None else f"{name}-{run.steps}"
        path = out_dir / f"{stem}.jsonl"
        note = train(name, run, path, args.load) if not path.exists() else f"reused {path}"
        analyzer = Analyzer(config=args.config)
        alerts, events, signals, anonymous = [], [], set(), set()
        for line in path.read_bytes().splitlines():
            run_id, tables = to_arrow(orjson.loads(line))
            alerts += analyzer.observe(run_id, tables)
            events += tables["events"].to_pylist() if "events" in tables else []
            have, cannot = _signals(tables, tp=run.tp)
            signals |= have
            anonymous |= cannot
        truths = []
        for e in events:
            if e["kind"].startswith("fault:"):
                kind = e["kind"].removeprefix("fault:")
                detail = json.loads(e["detail"])
                truths.append(
                    Truth(
                        kind,
                        e["step"],
                        e["rank"] if e["rank"] >= 0 else None,
                        label=",".join(f"{k}={v}" for k, v in detail.items()),
                    )
                )
        sc = Scenario(
            name,
            "real-loaded" if run.loaded else "real-quiet",
            truths,
            run.steps,
            REAL_CANARY_EVERY,
            signals=signals,
            anonymous=anonymous,
            alerts=alerts,
            log_every=run.log_every,
        )
        out.append(sc)
        print(f"  {name}: {len(alerts)} alerts ({note})", file=sys.stderr, flush=True)
    return out


def _signals(tables: dict, tp: int) -> tuple[set[str], set[str]]:
    """(alert kinds whose input this telemetry carries, kinds that cannot name a culprit).

    A real CPU run has no GPU clock; the peer-outlier test needs 3 data-parallel peers and
    a replica vote a group of 3 (dp=2 x tp=2 has pairs).
    """
    have, anonymous = set(EXPECT_ALWAYS), set()
    ranks = tables.get("ranks")
    if ranks is None or not ranks.num_rows:
        return have, anonymous
    for kind, column in (
        ("sdc_replica", "replica_fingerprint"),
        ("sdc", "canary_fingerprint"),
        ("sdc_outlier", "grad_norm_local"),
        ("throttle", "sm_clock_mhz"),
        ("straggler", "wait_time_s"),
    ):
        if ranks.column(column).null_count < ranks.num_rows:
            have.add(kind)
    first = ranks.filter(pc.equal(ranks["step"], ranks["step"][0]))
    if first.num_rows // tp < 3:
        have.discard("sdc_outlier")
    groups = Counter(g for g in first.column("replica_group").to_pylist() if g is not None)
    if groups and min(groups.values()) < 3:
        anonymous.add("sdc_replica")
    return have, anonymous


EXPECT_ALWAYS = {"loss_spike", "nonfinite", "stall"}


# ---------------------------------------------------------------------------- scoring


@dataclass
class Score:
    faults: int = 0
    found: int = 0
    culprits: int = 0  # faults whose culprit the detector should name
    named: int = 0
    latencies: list = field(default_factory=list)
    alerts: int = 0
    explained: int = 0


def extra_steps(alert: Alert, log_every: int) -> int:
    """Steps an alert may come later than its fault's window: a straggler is judged over
    persist_steps, or where logging is sparse over min_logged_steps logged steps, which
    take longer; in a restless cohort (a shared machine), whose message says so, over
    restless_persist_steps."""
    if alert.kind != "straggler":
        return 0
    s = StragglerSettings()
    restless = "a restless cohort" in alert.message
    window = s.restless_persist_steps if restless else s.persist_steps
    return max(window, s.min_logged_steps * log_every) - s.persist_steps


def score(scenarios: list[Scenario]) -> tuple[dict, Counter, Counter, list]:
    scores: dict[str, Score] = defaultdict(Score)
    false_clean, unexplained_faulty, misses = Counter(), Counter(), []
    for sc in scenarios:
        explained = set()
        raised = [a for a in sc.alerts if not a.resolves]  # a resolve row ends an episode
        for t in sc.faults:
            for kind, within, culprit in EXPECT[t.kind]:
                if kind not in sc.signals:
                    continue
                window = sc.canary_every if within == "canary" else within
                s = scores[kind]
                s.faults += 1
                late = t.step + window
                hits = [
                    a for a in raised
                    if a.kind == kind and t.step <= a.step <= late + extra_steps(a, sc.log_every)
                ]  # fmt: skip
                want = None if kind in sc.anonymous else culprit_of(t, culprit)
                s.culprits += want is not None
                if not hits:
                    misses.append(f"{sc.name}: {kind} missed {t.kind} at step {t.step} ({t.label})")
                    continue
                s.found += 1
                s.latencies.append(hits[0].step - t.step)
                if want is not None and getattr(hits[0], want[0]) == want[1]:
                    s.named += 1
                elif want is not None:
                    misses.append(
                        f"{sc.name}: {kind} named rank {hits[0].rank} layer "
                        f"{hits[0].layer} for {t.kind} {t.label} ({want})"
                    )
            for a in raised:
                own = {k for k, _, _ in EXPECT[t.kind]}
                if a.kind in own | KNOCK_ON[t.kind] and t.step <= a.step <= t.step + KNOCK_ON_STEPS:
                    explained.add(id(a))
        for a in raised:
            scores[a.kind].alerts += 1
            scores[a.kind].explained += id(a) in explained
            if id(a) not in explained:
                (unexplained_faulty if sc.faults else false_clean)[a.kind] += 1
                if not sc.faults:
                    misses.append(f"{sc.name}: FALSE {a.kind} at step {a.step}: {a.message[:160]}")
    return scores, false_clean, unexplained_faulty, misses


def culprit_of(t: Truth, culprit: str | None) -> tuple[str, int] | None:
    """(Alert field, value) the detector should name for this fault, or None."""
    if culprit == "rank" or (culprit == "truth" and t.rank is not None):
        return ("rank", t.rank) if t.rank is not None else None
    if culprit == "truth" and t.layer is not None:
        return ("layer", t.layer)
    return None


# Every kind an alert may have: each gets its false-alert rate, zero or not.
ALL_KINDS = sorted(
    {k for v in EXPECT.values() for k, _, _ in v}
    | set().union(*KNOCK_ON.values())
    | {"rank_lost", "hang", "intermittent_straggler"}
)


@dataclass
class Summary:
    clean_steps: int = 0
    false_alerts: int = 0
    straggler: Score | None = None

    def rate(self) -> float:
        return self.false_alerts / self.clean_steps * 1e4 if self.clean_steps else math.nan


def report(title: str, scenarios: list[Scenario], lines: list[str]) -> Summary:
    if not scenarios:
        return Summary()
    scores, false_clean, unexplained, misses = score(scenarios)
    n_faulty = sum(1 for s in scenarios if s.faults)
    clean_steps = sum(s.steps for s in scenarios if not s.faults)
    lines.append(
        f"== {title}: {n_faulty} faulty runs ({sum(len(s.faults) for s in scenarios)} "
        f"faults), {len(scenarios) - n_faulty} clean runs ({clean_steps:,} steps)"
    )
    for kind in sorted(scores, key=lambda k: (-scores[k].faults, k)):
        s = scores[kind]
        if not s.faults:
            continue
        recall = s.found / s.faults
        precision = f"{s.explained / s.alerts:6.1%}" if s.alerts else "   n/a"
        lat = f"{statistics.median(s.latencies):.0f} / {max(s.latencies)}" if s.latencies else "n/a"
        culprit = f"{s.named}/{s.culprits}" if s.culprits else "n/a"
        lines.append(
            f"{kind:14s} faults {s.faults:3d}  recall {recall:6.1%}  precision "
            f"{precision}  latency median/max {lat} steps  culprit named {culprit}"
        )
    others = {k: v.alerts for k, v in scores.items() if not v.faults and v.alerts}
    if others:
        lines.append(f"other alerts (knock-on effects of faults): {others}")
    if unexplained:
        lines.append(f"unexplained alerts in faulty runs: {dict(unexplained)}")
    n_false = sum(false_clean.values())
    summary = Summary(clean_steps, n_false, scores.get("straggler"))
    lines.append(
        f"false alerts on clean runs, all detectors: {n_false} in {clean_steps:,} "
        f"steps = {summary.rate():.2f} per 10,000 steps"
    )
    if clean_steps:
        per_kind = ", ".join(
            f"{k} {false_clean[k] / clean_steps * 1e4:.2f}"
            for k in sorted(set(ALL_KINDS) | set(false_clean))
        )
        lines.append(f"  per kind, per 10,000 clean steps: {per_kind}")
    for m in misses[:30]:
        lines.append(f"  note: {m}")
    return summary


def headline(sim: Summary, loaded: Summary, quiet: Summary) -> str:
    """The last line: false alerts per 10,000 simulated and real steps; straggler recall,
    latency and culprit on real runs."""
    real = Summary(loaded.clean_steps + quiet.clean_steps, loaded.false_alerts + quiet.false_alerts)
    found, faults, named, culprits, latencies = 0, 0, 0, 0, []
    for s in (loaded.straggler, quiet.straggler):
        if s is not None:
            found, faults, named, culprits = (
                found + s.found,
                faults + s.faults,
                named + s.named,
                culprits + s.culprits,
            )
            latencies += s.latencies
    lat = f"{statistics.median(latencies):.0f}/{max(latencies)}" if latencies else "n/a"
    simulated = ""
    if sim.clean_steps:
        simulated = f"simulated {sim.rate():.2f} ({sim.clean_steps:,} clean steps), "
    if not (real.clean_steps or faults):
        return f"HEADLINE: false alerts per 10,000 steps: {simulated.removesuffix(', ')}"
    return (
        f"HEADLINE: false alerts per 10,000 steps: {simulated}real {real.rate():.2f} "
        f"({real.clean_steps:,} clean steps, {loaded.clean_steps:,} of them on a machine "
        f"loaded to {BUSY_PER_CORE}x its cores); real stragglers found {found}/{faults}, "
        f"named {named}/{culprits}, latency median/max {lat} steps"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--scenarios", type=int, default=40, help="faulty and clean sims, each")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--ranks", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-real", action="store_true", help="skip the real trainer runs")
    p.add_argument(
        "--only",
        help="these real runs alone, comma-separated, no simulated fleets (runs: "
        + ", ".join(REAL_RUNS)
        + ")",
    )
    p.add_argument("--real-steps", type=int, help="steps of each real run (default: its own)")
    p.add_argument(
        "--load", choices=sorted(NEIGHBOURS), default="spin",
        help="what the busy processes of a loaded run do (default spin: a Python loop; "
        "torch: matmuls and memory copies, as another training job)",
    )  # fmt: skip
    p.add_argument(
        "--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
        help="a detector setting other than its default (repeatable), to try one",
    )  # fmt: skip
    p.add_argument(
        "--real-dir",
        default=str(Path(tempfile.gettempdir()) / "trainvitals-detect"),
        help="telemetry files of the real runs (made once, then reused)",
    )
    p.add_argument(
        "--out",
        help="where to write the report (default bench/results/detect.txt; with --only none)",
    )
    args = p.parse_args()
    try:  # before any run trains: a bad setting is named at once
        args.config = AnalyzerConfig.load(overrides=args.set)
    except ValueError as e:
        p.error(str(e))
    if args.only and args.no_real:
        p.error("--only names real runs: it cannot go with --no-real")
    out = args.out if args.out is not None else "" if args.only else str(DEFAULT_OUT)
    sims = sim_scenarios(args) if args.scenarios and not args.only else []
    cpus, load = os.cpu_count(), os.getloadavg()[0]
    reals = [] if args.no_real else real_scenarios(args)
    lines = [
        "$ python bench/detect.py " + " ".join(sys.argv[1:]),
        f"# {cpus} cores, 1-min load average {load:.1f} at the start (before the bench's own)",
    ]
    sim = report(f"simulated fleets ({args.ranks} ranks, {args.steps} steps of 2 s each)", sims,
                 lines)  # fmt: skip
    loaded = report(
        f"real 4-rank trainer runs (dp=2 x tp=2, or dp=4 where named, CPU), {BUSY_PER_CORE} "
        f"busy processes per core ({args.load}) started by the bench",
        [s for s in reals if s.source == "real-loaded"],
        lines,
    )
    quiet = report(
        "real trainer runs (4 ranks dp=2 x tp=2, 8 ranks dp=4 x tp=2, CPU), no load added",
        [s for s in reals if s.source == "real-quiet"],
        lines,
    )
    lines.append(headline(sim, loaded, quiet))
    text = "\n".join(lines)
    print(text)
    if out:
        Path(out).write_text(text + "\n")


if __name__ == "__main__":
    main()
