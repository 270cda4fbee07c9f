"""Fleet simulator: the telemetry of an N-rank training job, with injected faults and ground truth.

    spec = FleetSpec(ranks=1024, layers=32, step_time_s=2.0, steps=500,
                     faults=("straggler:rank=3,step=100,slowdown=0.2",))
    for doc in simulate(spec):      # schema batch documents, as the hooks send them
        ...

The first document holds the run's `runs` row; then one document per logged step holds its
steps row, its L layers rows and its N ranks rows (rank 0 of a real job gathers every rank's
values with one all-reduce and sends them together, see hooks/records.py); with
`per_node=True` the ranks rows travel in one document per node instead. Numeric columns are
numpy arrays (what `trainvitals.schema.to_arrow` and `encode_msgpack` take), so a step of a
16,384-rank job costs a few milliseconds to make.

What it models, per logged step:
- timing: each rank's compute time is the job's nominal compute x its device's fixed speed
  (1% spread) x per-step noise (1%) x a slow job-wide drift (1.5% amplitude, 24 h period,
  like a data centre's daily temperature cycle); ranks then wait at the step's
  synchronisation point for the last one to arrive, and every rank's step ends together;
- device: power, cumulative energy, SM clock, temperature, memory, throttle reasons;
- collectives (FSDP: all-gather and reduce-scatter per layer) and node network counters;
- training: loss on a power-law curve with noise, learning rate with linear warm-up and
  cosine decay, global and per-layer gradient norms, activation RMS, parameter norm and
  update RMS (about the learning rate, as with Adam);
- SDC canary fingerprints every `canary_every` steps (one value every healthy rank shares)
  and replica fingerprints per replica group (the ranks of one local rank index across
  nodes, as in HSDP: shard within a node, replicate across nodes).
Steps between logged ones (`log_every` > 1) take their time too, from the same timing
model (noise, slow devices, faults), and a NaN among them shows on the next logged step, in
its non-finite step counters and activation maxima, as the hooks report it.

Faults (`parse_fault`: the trainer's `--inject` language, trainvitals/faultspec.py) change
those values from their step on, and each is recorded as an `events` row `fault:<kind>`
(rank, step, detail JSON): the ground truth detectors are scored against. See FAULTS for
the kinds and their parameters.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from trainvitals import checks, faultspec
from trainvitals.faultspec import Fault, Param
from trainvitals.schema import SCHEMA_VERSION, check_run_id

_WHOLE = Param("whole")  # rank, step
# kind -> its parameters (trainvitals/faultspec.py). Numbers are finite and bounded, so that
# no value overflows: a spike's factor is squared into the gradient norms, and a stall's
# seconds advance the clock that the daily drift takes the sine of.
FAULTS: dict[str, dict[str, Param]] = {
    # the rank computes `slowdown` x longer from `step` on (up to `until`, growing over
    # `ramp` steps, or only every `every` steps: faultspec.STRAGGLER_SCHEDULE)
    "straggler": {
        "rank": _WHOLE, "step": _WHOLE,
        "slowdown": Param("number", low=0, high=10, words="in (0, 10]"),
        **faultspec.STRAGGLER_SCHEDULE,
    },
    # from `step` on the rank's canary and replica fingerprints are wrong and its local
    # gradient norm is `grad_factor` x the others'
    "sdc": {
        "rank": _WHOLE, "step": _WHOLE,
        "grad_factor": Param("number", 30.0, low=1, high=1e6, words="in (1, 1e6]"),
    },
    # the loss jumps to `factor` x its curve at `step` and recovers over a few steps
    "spike": {
        "step": _WHOLE,
        "factor": Param("number", 3.0, low=1, high=1e3, words="in (1, 1000]"),
    },
    # a NaN born in the forward of layer L/2 at `step`: the outputs of that layer and every
    # later one, the loss, gradient norms and those layers' gradients are NaN. On a step
    # that is not logged it shows on the next logged one, in its non-finite step counters
    # and activation maxima, as with the hooks
    "nan": {"step": _WHOLE},
    # `step` takes `seconds` longer (at most a week): on `rank` (its data loading; the
    # others wait for it), or on every rank when no rank is given (a shared filesystem, a
    # checkpoint)
    "stall": {
        "step": _WHOLE, "rank": Param("whole", -1),
        "seconds": Param("number", low=0, high=7 * 86_400, words="in (0, 604800] (a week)"),
    },
    # from `step` on the rank's SM clock is `clock_drop` lower (so it computes slower) and
    # NVML reports `reasons` (default 0x20, software thermal slowdown)
    "throttle": {
        "rank": _WHOLE, "step": _WHOLE,
        "clock_drop": Param("number", 0.3, low=0, high=0.99, words="in (0, 0.99]"),
        "reasons": Param("whole", 0x20, low=0, high=2**32 - 1, words="a bitmask in [1, 2^32)"),
    },
}  # fmt: skip

# Nominal device: an H100 SXM (bf16 dense peak 989 TFLOP/s; 700 W board power).
PEAK_FLOPS_PER_S = 989e12
POWER_W = 680.0
SM_CLOCK_MHZ = 1980.0
TARGET_MFU = 0.4  # sets tokens per step so that achieved MFU is realistic
HIDDEN, VOCAB = 4096, 128_256  # model shape: 12 d^2 parameters per block (Kaplan et al. 2020)
# Fractions of the nominal step: compute, data loading, exposed communication after the
# synchronisation point.
COMPUTE_FRACTION, DATA_FRACTION = 0.85, 0.01
TAIL_FRACTION = 1.0 - COMPUTE_FRACTION - DATA_FRACTION
DRIFT, DAY_S = 0.015, 86_400.0
LOSS_START, LOSS_FLOOR, LOSS_TAU_STEPS, LOSS_POWER = 11.0, 1.8, 100.0, 0.4
PEAK_LR = 3e-4
FINGERPRINT_MASK = (1 << 52) - 1  # fingerprints are 52-bit: exact in a float64


def parse_fault(spec: str) -> Fault:
    """'straggler:rank=3,step=100,slowdown=0.2' -> Fault. ValueError says what is wrong."""
    return faultspec.parse_fault(spec, FAULTS)


def _detail(f: Fault) -> str:
    """A fault's events row detail: its parameters other than rank and step, as JSON."""
    return json.dumps(f.params, sort_keys=True)


@dataclass
class FleetSpec:
    """What to simulate. `faults` takes Fault objects or spec strings (see parse_fault)."""

    ranks: int
    layers: int
    step_time_s: float
    steps: int
    seed: int = 0
    log_every: int = 1
    canary_every: int = 50
    faults: tuple = ()
    run_id: str = ""  # "": sim-<seed>
    ranks_per_node: int = 8
    start_unix_s: float = 1.7e9  # fixed, so that a seed fixes every value

    def __post_init__(self) -> None:
        for name in ("ranks", "layers", "steps", "log_every", "ranks_per_node"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"FleetSpec.{name} must be a whole number >= 1")
        if not 0 < self.step_time_s <= DAY_S:  # longer: token counts overflow int64
            raise ValueError(
                f"FleetSpec.step_time_s must be in (0, {DAY_S:g}], got {self.step_time_s}"
            )
        checks.non_negative("FleetSpec.start_unix_s", self.start_unix_s)
        if self.run_id:  # else sim-<seed>, below
            check_run_id(self.run_id)  # the collector would refuse every batch
        if self.canary_every < 0 or self.canary_every % self.log_every:
            raise ValueError(
                "FleetSpec.canary_every must be 0 (off) or a multiple of log_every "
                f"({self.log_every}), got {self.canary_every}"
            )
        self.faults = tuple(parse_fault(f) if isinstance(f, str) else f for f in self.faults)
        for f in self.faults:
            if f.rank >= self.ranks:
                raise ValueError(f"fault {f.kind}: rank {f.rank} >= ranks ({self.ranks})")
            if f.step >= self.steps:  # it would never happen, yet stand as ground truth
                raise ValueError(
                    f"fault {f.kind}: step {f.step} >= steps ({self.steps}); the run's last "
                    f"step is {self.steps - 1}"
                )
        self.run_id = self.run_id or f"sim-{self.seed}"

    @property
    def nodes(self) -> int:
        return math.ceil(self.ranks / self.ranks_per_node)


# FleetSpec field -> its flag's help. The flags of `trainvitals simulate` are made from the
# fields (add_arguments), as the trainer's are from TrainConfig (trainer/config.py).
FLAG_HELP = {
    "ranks": "ranks (devices) of the job",
    "layers": "layers the hooks report",
    "step_time_s": "nominal step time, seconds",
    "steps": "optimizer steps",
    "seed": "a seed fixes every value",
    "log_every": "steps between logged steps",
    "canary_every": "steps between SDC canaries (0: none)",
    "faults": "inject a fault, e.g. straggler:rank=3,step=100,slowdown=0.2 (repeatable); "
    f"kinds: {', '.join(FAULTS)}",
    "run_id": "default: sim-<seed>",
    "ranks_per_node": "ranks per node (a node's ranks rows travel together with --per-node)",
    "start_unix_s": "start time, Unix seconds (default: now)",
}
# Flags spelled otherwise than their field (the flag first, then other spellings accepted).
_FLAGS = {"step_time_s": ["--step-time", "--step-time-s"], "faults": ["--fault"]}
# Defaults of the command line where the class has none, or another (0: now).
_CLI_DEFAULTS = {"steps": 1000, "start_unix_s": 0.0}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per FleetSpec field: --log-every for log_every, and so on."""
    for f in dataclasses.fields(FleetSpec):
        flags = _FLAGS.get(f.name, ["--" + f.name.replace("_", "-")])
        text = FLAG_HELP[f.name]
        if f.name == "faults":  # repeatable: --fault A --fault B
            parser.add_argument(
                *flags, action="append", default=[], dest=f.name, metavar="SPEC", help=text
            )
            continue
        default = _CLI_DEFAULTS.get(f.name, f.default)
        kind = {"int": int, "float": float, "str": str}[str(f.type)]
        if default is dataclasses.MISSING:
            parser.add_argument(*flags, type=kind, required=True, dest=f.name, help=text)
            continue
        if f.name not in ("run_id", "start_unix_s"):  # their help says it
            text += f" (default {default!r})"
        parser.add_argument(*flags, type=kind, default=default, dest=f.name, help=text)


def from_args(args: argparse.Namespace) -> FleetSpec:
    """The FleetSpec of parsed flags (ValueError names a bad one); start time 0: now."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(FleetSpec)}
    values["faults"] = tuple(values["faults"])
    values["start_unix_s"] = values["start_unix_s"] or time.time()
    return FleetSpec(**values)


def simulate(spec: FleetSpec, per_node: bool = False) -> Iterator[dict[str, Any]]:
    """Schema batch documents of the run: its runs row first, then each logged step's."""
    fleet = _Fleet(spec)
    yield _doc(spec, runs=fleet.runs_row())
    previous = -1
    for step in range(0, spec.steps, spec.log_every):
        tables = fleet.step(step, previous)
        previous = step
        if step + spec.log_every >= spec.steps:  # the last logged step: a clean end
            end = {"step": [spec.steps], "rank": [-1], "kind": ["run_end"],
                   "detail": ['{"telemetry_dropped": 0}'], "time_unix_s": [fleet.now]}  # fmt: skip
            tables["events"] = _concat_events(tables.get("events"), end)
        if not per_node:
            yield _doc(spec, **tables)
            continue
        ranks = tables.pop("ranks")
        rpn = spec.ranks_per_node
        for node in range(spec.nodes):
            mine = {k: v[node * rpn : (node + 1) * rpn] for k, v in ranks.items()}
            yield _doc(spec, **tables, ranks=mine) if node == 0 else _doc(spec, ranks=mine)


def _doc(spec: FleetSpec, **tables: Any) -> dict[str, Any]:
    return {"schema_version": SCHEMA_VERSION, "run_id": spec.run_id, **tables}


def _concat_events(a: dict | None, b: dict) -> dict:
    return b if a is None else {k: a[k] + b[k] for k in a}


def fingerprints(seed: int, step: int, salt: np.ndarray) -> np.ndarray:
    """52-bit fingerprints, one per `salt` value (splitmix64 finaliser; Steele et al. 2014)."""
    with np.errstate(over="ignore"):
        z = np.uint64(seed * 0x9E3779B97F4A7C15 + step & (2**64 - 1)) + salt.astype(np.uint64)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z & np.uint64(FINGERPRINT_MASK)).astype(np.int64)


class _Fleet:
    """The job's state between logged steps, and the arithmetic of one logged step."""

    def __init__(self, spec: FleetSpec) -> None:
        self.spec = spec
        n, n_layers = spec.ranks, spec.layers
        self.rng = rng = np.random.default_rng(spec.seed)
        # Noise of the steps that are not logged, drawn apart: a run's logged values do not
        # depend on how many steps lie between them.
        self.unlogged_rng = np.random.default_rng([spec.seed, 1])
        self.speed = rng.normal(1.0, 0.01, n).clip(0.96, 1.04)  # each device's own pace
        self.power_base = rng.normal(POWER_W, 12.0, n)
        self.temp_base = rng.normal(62.0, 2.5, n)
        self.memory = rng.normal(62e9, 0.5e9, n)
        self.energy = np.zeros(n)
        self.rank = np.arange(n, dtype=np.int64)
        self.node = self.rank // spec.ranks_per_node
        self.group = self.rank % min(spec.ranks_per_node, n)
        # Per-layer shapes: embedding and output layers differ from the blocks.
        depth = np.linspace(0.0, 1.0, n_layers)
        self.grad_share = np.sqrt(rng.dirichlet(np.full(n_layers, 20.0)))
        self.act_base = 1.0 + 0.5 * depth
        self.param_base = np.sqrt(12 * HIDDEN * HIDDEN) * 0.02 * (1 + 0.2 * depth)
        self.n_params = n_layers * 12 * HIDDEN * HIDDEN + 2 * VOCAB * HIDDEN
        # 6 N D training FLOPs without embeddings or attention (Kaplan et al. 2020, sec. 2.1).
        self.flops_per_token = 6.0 * (self.n_params - VOCAB * HIDDEN)
        tokens = TARGET_MFU * PEAK_FLOPS_PER_S * n * spec.step_time_s / self.flops_per_token
        self.tokens_per_step = max(n, round(tokens))
        self.warmup = max(1, min(2000, spec.steps // 20))
        self.now = spec.start_unix_s
        self.by_kind = {k: [f for f in spec.faults if f.kind == k] for k in FAULTS}

    def runs_row(self) -> dict[str, list]:
        s = self.spec
        names = [f"layers.{i}" for i in range(s.layers)]
        hosts = [f"node{node:05d}" for node in self.node.tolist()]
        config = {"dim": HIDDEN, "n_layers": s.layers, "vocab_size": VOCAB}
        row = {
            "started_unix_s": s.start_unix_s,
            "model": "simulated",
            "model_config_json": json.dumps(config),
            "n_params": self.n_params,
            "n_layers": s.layers,
            "layer_names_json": json.dumps(names),
            "world_size": s.ranks,
            "dp": s.ranks,  # every rank a data-parallel peer: the simulated job has no tp
            "tp": 1,
            "device_type": "cuda",
            "device_name": "NVIDIA H100 80GB HBM3 (simulated)",
            "hosts_json": json.dumps(hosts),
            "flops_per_token": self.flops_per_token,
            "peak_flops_per_s": PEAK_FLOPS_PER_S,
            "peak_flops_source": "table:H100",
            "power_source": "nvml",
            "power_unavailable": "",
            "token_target": self.tokens_per_step * s.steps,
        }
        return {k: [v] for k, v in row.items()}

    def lr(self, step: int) -> float:
        """Linear warm-up, then cosine decay to 10% of the peak."""
        if step < self.warmup:
            return PEAK_LR * (step + 1) / self.warmup
        progress = (step - self.warmup) / max(1, self.spec.steps - self.warmup)
        return PEAK_LR * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))

    def _active(self, kind: str, step: int) -> list[Fault]:
        return [f for f in self.by_kind[kind] if step >= f.step]

    def _at(self, kind: str, step: int) -> list[Fault]:
        return [f for f in self.by_kind[kind] if f.step == step]

    def _slow_down(self, compute: np.ndarray, step: int) -> None:
        """Stretch each rank's compute time by the straggler and throttle faults active."""
        for f in self._active("straggler", step):
            compute[f.rank] *= 1 + faultspec.straggler_slowdown(f, step)
        for f in self._active("throttle", step):
            compute[f.rank] /= 1 - f.params["clock_drop"]  # work per clock cycle is fixed

    def _unlogged_time_s(self, step: int, drift: float) -> float:
        """Wall time of a step that is not logged: the same timing as a logged step's
        (noise, slow devices, stragglers, throttling; every rank waits for the last), so
        that a run's wall time is the sum of its steps' times whatever `log_every` is.
        Costs two draws per rank: about 2 ms a step at 16,384 ranks."""
        s, rng, n = self.spec, self.unlogged_rng, self.spec.ranks
        compute = s.step_time_s * COMPUTE_FRACTION * drift / self.speed * rng.lognormal(0, 0.01, n)
        self._slow_down(compute, step)
        data = s.step_time_s * DATA_FRACTION * rng.lognormal(0.0, 0.3, n)
        return float((data + compute).max()) + s.step_time_s * TAIL_FRACTION

    def step(self, step: int, previous: int) -> dict[str, dict]:
        """Tables of logged step `step`; `previous` is the logged step before it (-1: none)."""
        s, rng, n = self.spec, self.rng, self.spec.ranks
        # Every draw happens on every step, faults or not: one seed gives the same noise with
        # and without a fault, so a faulty run differs from its clean twin by the fault only.
        noise = rng.lognormal(0.0, 0.01, n)
        data_noise = rng.lognormal(0.0, 0.3, n)
        end_jitter = np.abs(rng.normal(0.0, 1e-4, n))
        clock_noise = np.abs(rng.normal(0.0, 8.0, n))
        power_noise = rng.normal(0.0, 5.0, n)
        temp_noise = rng.normal(0.0, 0.3, n)
        mem_noise = rng.normal(0.0, 5e7, n)
        local_loss_noise = rng.normal(0.0, 0.03, n)
        local_grad_noise = rng.normal(0.0, 0.03, n)
        comm_noise = rng.lognormal(0.0, 0.05, (3, n))
        layer_noise = rng.lognormal(0.0, 0.05, (3, s.layers))
        act_peak = rng.uniform(15.0, 40.0, s.layers)
        loss_noise, grad_noise = rng.normal(0.0, 0.01), rng.lognormal(0.0, 0.05)

        # Timing: compute, then wait at the synchronisation point for the last rank.
        drift = 1 + DRIFT * math.sin(2 * math.pi * (self.now - s.start_unix_s) / DAY_S)
        compute = s.step_time_s * COMPUTE_FRACTION * drift / self.speed * noise
        clock = SM_CLOCK_MHZ - clock_noise
        reasons = np.zeros(n, dtype=np.int64)
        power_factor = np.ones(n)
        temp_extra = np.zeros(n)
        self._slow_down(compute, step)
        for f in self._active("throttle", step):
            drop = f.params["clock_drop"]
            clock[f.rank] *= 1 - drop
            reasons[f.rank] |= int(f.params["reasons"])
            power_factor[f.rank] = 1 - drop / 2
            temp_extra[f.rank] = 12.0
        data = s.step_time_s * DATA_FRACTION * data_noise
        stalled = 0.0
        for f in self._at("stall", step):
            if f.rank < 0:
                data += f.params["seconds"]
            else:
                data[f.rank] += f.params["seconds"]
        # Stalls on steps that are not logged still pass time.
        for f in self.by_kind["stall"]:
            if previous < f.step < step:
                stalled += f.params["seconds"]
        arrival = data + compute
        release = arrival.max()
        wait = release - arrival
        rank_step_time = release + s.step_time_s * TAIL_FRACTION + end_jitter
        step_time = float(rank_step_time.max())
        unlogged = sum(self._unlogged_time_s(u, drift) for u in range(previous + 1, step))
        elapsed = unlogged + step_time + stalled
        self.now += elapsed
        busy = compute / (compute + wait)
        power = (self.power_base * (0.85 + 0.15 * busy) + power_noise) * power_factor
        self.energy += power * elapsed
        tokens_per_s = self.tokens_per_step / step_time
        tflops = tokens_per_s * self.flops_per_token / n / 1e12

        # Training curves.
        lr = self.lr(step)
        curve = LOSS_FLOOR + (LOSS_START - LOSS_FLOOR) * (1 + step / LOSS_TAU_STEPS) ** -LOSS_POWER
        spike = 1.0 + sum(
            (f.params["factor"] - 1) * math.exp(-(step - f.step) / 3.0)
            for f in self._active("spike", step)
        )
        local_loss = curve * spike * (1 + loss_noise) * (1 + local_loss_noise)
        grad_scale = (0.3 + 2.0 * math.exp(-step / self.warmup)) * grad_noise * spike**2
        layer_grad = grad_scale * self.grad_share * layer_noise[0]
        layer_nonfinite = np.zeros(s.layers, dtype=np.int64)
        act_nonfinite = np.zeros(s.layers, dtype=np.int64)
        growth = math.log1p(step / 1000)
        act_rms = self.act_base * (1 + 0.1 * growth) * layer_noise[1]
        act_max_abs = act_rms * act_peak
        broken = slice(s.layers // 2, None)  # the layers a NaN fault reaches
        nan = bool(self._at("nan", step))
        if nan:
            local_loss[:] = math.nan
            layer_grad[broken] = math.nan
            layer_nonfinite[broken] = 12 * HIDDEN * HIDDEN
            act_rms[broken] = math.nan
            act_nonfinite[broken] = self.tokens_per_step * HIDDEN  # every value of the output
        # The hooks count the steps since the previous logged one (this one included) that
        # held a non-finite value, and keep each layer's largest |activation| over them (NaN
        # once one was NaN): a NaN on a step that is not logged shows on the next logged one.
        bad_steps = len({f.step for f in self.by_kind["nan"] if previous < f.step <= step})
        act_bad_steps = np.zeros(s.layers, dtype=np.int64)
        if bad_steps:
            act_bad_steps[broken] = bad_steps
            act_max_abs[broken] = math.nan
        grad_norm = float(np.sqrt(np.sum(layer_grad**2)))
        grad_local = grad_norm * (1.3 + local_grad_noise)
        for f in self._active("sdc", step):
            grad_local[f.rank] *= f.params["grad_factor"]

        steps = {
            "step": np.array([step], dtype=np.int64),
            "time_unix_s": np.array([self.now]),
            "loss": np.array([float(local_loss.mean())]),
            "grad_norm": np.array([grad_norm]),
            "lr": np.array([lr]),
            "tokens": np.array([self.tokens_per_step], dtype=np.int64),
            "step_time_s": np.array([step_time]),
            "tokens_per_s": np.array([tokens_per_s]),
            "tflops_per_s_per_device": np.array([tflops]),
            "mfu_ratio": np.array([tflops * 1e12 / PEAK_FLOPS_PER_S]),
            "power_w": np.array([power.sum()]),
            "energy_j": np.array([self.energy.sum()]),
            # As the hooks count: gradient tensors and activation values (hooks/records.py).
            "nonfinite_count": np.array([layer_nonfinite.sum() + act_nonfinite.sum()]),
            "nonfinite_steps": np.array([bad_steps], dtype=np.int64),
            "telemetry_dropped": np.zeros(1, dtype=np.int64),
        }
        layers = {
            "step": np.full(s.layers, step, dtype=np.int64),
            "layer": np.arange(s.layers, dtype=np.int64),
            "grad_norm": layer_grad,
            "act_rms": act_rms,
            "act_max_abs": act_max_abs,
            "param_norm": self.param_base * (1 + 0.05 * growth),
            "nonfinite_count": layer_nonfinite,
            "act_nonfinite_count": act_nonfinite,
            "act_nonfinite_steps": act_bad_steps,
        }
        if previous >= 0:  # no optimizer step precedes the first logged step: null
            layers["update_rms"] = lr * (0.8 + 0.2 * layer_noise[2])

        # Collectives (FSDP: all-gather in forward and backward, reduce-scatter of gradients)
        # move about the whole model through every rank once each, in bf16.
        layer_bytes = 2.0 * self.n_params
        tokens_rank = self.tokens_per_step / n
        nodes_bytes_per_s = 3 * layer_bytes / step_time
        ranks = {
            "step": np.full(n, step, dtype=np.int64),
            "rank": self.rank,
            "step_time_s": rank_step_time,
            "tokens_per_s": tokens_rank / rank_step_time,
            "loss": local_loss,
            "grad_norm_local": grad_local,
            "compute_time_s": compute,
            "data_time_s": data,
            "wait_time_s": wait,
            "power_w": power,
            "energy_j": self.energy.copy(),
            "sm_clock_mhz": clock,
            "temperature_c": self.temp_base + 0.03 * (power - POWER_W) + temp_extra + temp_noise,
            "all_gather_count": np.full(n, 2.0 * s.layers),
            "all_gather_bytes": 2 * layer_bytes * comm_noise[0],
            "all_gather_time_s": 0.25 * s.step_time_s * comm_noise[0],
            "reduce_scatter_count": np.full(n, float(s.layers)),
            "reduce_scatter_bytes": layer_bytes * comm_noise[1],
            "reduce_scatter_time_s": 0.15 * s.step_time_s * comm_noise[1],
            "all_reduce_count": np.full(n, 2.0),
            "all_reduce_bytes": np.full(n, 16.0),
            "all_reduce_time_s": wait + 1e-4 * comm_noise[2],  # the sync point includes the wait
            "net_rx_bytes_per_s": 2e8 * comm_noise[2],
            "net_tx_bytes_per_s": 1e8 * comm_noise[2],
            "ib_rx_bytes_per_s": nodes_bytes_per_s * comm_noise[0],
            "ib_tx_bytes_per_s": nodes_bytes_per_s * comm_noise[1],
            "nvlink_rx_bytes_per_s": 4 * nodes_bytes_per_s * comm_noise[0],
            "nvlink_tx_bytes_per_s": 4 * nodes_bytes_per_s * comm_noise[1],
            "throttle_reasons": reasons,
            "memory_used_bytes": self.memory + mem_noise,
        }
        if nan:
            ranks["grad_norm_local"] = np.full(n, math.nan)
        if s.canary_every and step % s.canary_every == 0:
            ranks.update(self._fingerprints(step))
        tables = {"steps": steps, "layers": layers, "ranks": ranks}
        events = [f for f in s.faults if previous < f.step <= step]
        if events:
            tables["events"] = {
                "step": [f.step for f in events],
                "rank": [f.rank for f in events],
                "kind": [f"fault:{f.kind}" for f in events],
                "detail": [_detail(f) for f in events],
                "time_unix_s": [self.now] * len(events),
            }
        return tables

    def _fingerprints(self, step: int) -> dict[str, np.ndarray]:
        seed = self.spec.seed
        canary = fingerprints(seed, step, np.zeros(self.spec.ranks, dtype=np.int64))
        replica = fingerprints(seed, step, self.group + 1)
        for f in self._active("sdc", step):
            # A faulty unit flips low bits of what it computes; any flip changes a checksum.
            canary[f.rank] ^= 1 + f.rank % 7
            replica[f.rank] ^= 1 + f.rank % 5
        return {
            "canary_fingerprint": canary,
            "replica_fingerprint": replica,
            "replica_group": self.group,
        }


def splice_slowdown(
    compute_s: np.ndarray, waits_s: np.ndarray, rank: int, first: int, end: int, slowdown: float
) -> tuple[np.ndarray, np.ndarray]:
    """A recorded run's per-rank compute times and waits (steps x ranks) where `rank`
    computes `slowdown` longer in steps [first, end): it reaches the step's end later by
    as much, the step ends when the last rank arrives, and every rank waits for it. Lets a
    straggler be scored on a real run's own noise (bench/straggler_restless.py)."""
    compute_s, waits_s = compute_s.copy(), waits_s.copy()
    for compute, waits in zip(compute_s[first:end], waits_s[first:end], strict=True):
        arrival_s = compute.max() + waits.max() - waits  # relative to the step's start
        extra_s = compute[rank] * slowdown
        compute[rank] += extra_s
        arrival_s[rank] += extra_s
        waits[:] = arrival_s.max() - arrival_s
    return compute_s, waits_s
