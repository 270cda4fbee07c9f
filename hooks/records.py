"""The layout of the vectors each logged step reduces, and their unpacking into columns.

Every rank fills the same float64 vector; a SUM all-reduce then yields global values:

    [grad_sumsq | act_sumsq | act_count | param_sumsq | update_sumsq
     | grad_nonfinite | act_nonfinite  (L each)
     | loss*tokens | tokens | loss | power_w | power ranks | energy_j | energy ranks
     | telemetry_dropped]

Maxima cannot ride a SUM, so a second, small vector goes through a MAX all-reduce issued
right after the first on the same group:

    [act_max_abs (L) | act_nonfinite_steps (L) | nonfinite_steps | step_time_s
     | arrival_unix_s]

the first three over every step since the previous logged one. Neither vector has a slot
per rank: 9L + 11 numbers whatever the world size.

Sums of squares and counts are already weighted by 1/copies (see layers.py), so the sum
over ranks counts every element once.

What each rank reports about itself (RANK_SLOT: timing, power, fingerprints) travels
within its node only: the node's leader gathers its ranks' slots over a group of the
node's ranks, (local ranks x S) numbers, and exports them as ranks rows (monitor.py). A
value a rank does not have is NaN in its slot and a null in its row. Rows are built as
numpy columns (wire.ColumnBatch): no Python object per rank or per layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .wire import ColumnBatch

# Per-step collective traffic, from hooks/comms.py.
COMMS_FIELDS = tuple(
    f"{kind}_{what}"
    for kind in ("all_gather", "reduce_scatter", "all_reduce")
    for what in ("count", "bytes", "time_s")
)
# Read from the background sampler (hooks/power.py): power, clocks, node counters.
SAMPLED_FIELDS = (
    "power_w",
    "energy_j",
    "sm_clock_mhz",
    "temperature_c",
    "throttle_reasons",
    "memory_used_bytes",
    "net_rx_bytes_per_s",
    "net_tx_bytes_per_s",
    "ib_rx_bytes_per_s",
    "ib_tx_bytes_per_s",
    "nvlink_rx_bytes_per_s",
    "nvlink_tx_bytes_per_s",
)
# Slot values that become ranks columns as they are (NaN: not reported, stored as null).
_INTEGER = ("canary_fingerprint", "replica_fingerprint", "replica_group", "throttle_reasons")
_AS_IS = tuple(
    name
    for name in ("compute_time_s", "data_time_s", "stopped_time_s", *COMMS_FIELDS, *SAMPLED_FIELDS)
    if name not in _INTEGER
)

# What each rank reports about itself. Fingerprints are 52-bit integers, exact in float64.
RANK_SLOT = (
    "step_time_s",  # host wall time between this rank's step boundaries
    "tokens",
    "loss",  # this rank's local loss
    "compute_time_s",  # CPU: the training thread's CPU time; CUDA: event-timed (see monitor)
    "data_time_s",  # previous optimizer step's end -> this step's first forward
    "stopped_time_s",  # CPU ranks: time the process was stopped (stopped.py)
    "arrival_unix_s",  # when the rank reached the step boundary (the hooks' collective)
    "grad_sumsq_local",  # this rank's own gradients before the data-parallel reduction
    "canary_fingerprint",  # NaN on steps without a canary
    "replica_fingerprint",  # NaN on steps without one, or when the rank has no replicas
    "replica_group",
    *COMMS_FIELDS,
    *SAMPLED_FIELDS,
)
_SLOT = {name: i for i, name in enumerate(RANK_SLOT)}


_PER_LAYER = (
    "grad_sumsq",
    "act_sumsq",
    "act_count",
    "param_sumsq",
    "update_sumsq",
    "grad_nonfinite",  # gradient tensors holding a NaN/inf at the logged step
    "act_nonfinite",  # non-finite block-output values of the logged step
)
# Summed over the ranks. power_ranks / energy_ranks count the ranks that measured it (a
# rank without a reading adds 0 to both), so that no reading at all is told from 0 W.
PER_STEP = (
    "loss_x_tokens",
    "tokens",
    "loss",  # the ranks' local losses: their mean when no rank reported tokens
    "power_w",
    "power_ranks",
    "energy_j",
    "energy_ranks",
    "telemetry_dropped",  # what each rank dropped so far (its queue, its exporter)
)
# Maxima over the ranks (after the per-layer maxima).
MAX_PER_STEP = ("nonfinite_steps", "step_time_s", "arrival_unix_s")


@dataclass(frozen=True)
class VectorLayout:
    n_layers: int
    layer_numel: tuple[int, ...] = ()  # global parameter count of each layer

    @property
    def size(self) -> int:
        """Length of the SUM vector: independent of the world size."""
        return len(_PER_LAYER) * self.n_layers + len(PER_STEP)

    @property
    def max_size(self) -> int:
        """Length of the MAX vector."""
        return 2 * self.n_layers + len(MAX_PER_STEP)

    def per_layer(self, v: np.ndarray, name: str) -> np.ndarray:
        i = _PER_LAYER.index(name)
        return v[i * self.n_layers : (i + 1) * self.n_layers]

    def per_step(self, v: np.ndarray, name: str) -> float:
        return float(v[len(_PER_LAYER) * self.n_layers + PER_STEP.index(name)])

    def max_per_step(self, v_max: np.ndarray, name: str) -> float:
        return float(v_max[2 * self.n_layers + MAX_PER_STEP.index(name)])


@dataclass(frozen=True)
class StepMeta:
    """What the host knew when the step's vectors were packed."""

    step: int
    lr: float | None
    flops_per_token: float
    peak_flops_per_s: float


def _safe_div(a: float, b: float) -> float:
    return a / b if b else math.nan


def _measured_rms(sumsq: float, numel: float = 1.0) -> float | None:
    """sqrt(sumsq / numel) of a sum of squares the hooks mark negative when they did not
    measure it: None then; NaN or inf when the values held one (a finding, not a gap).
    numel 1: the norm itself."""
    return None if sumsq < 0 else math.sqrt(sumsq / numel)


def release_unix_s(layout: VectorLayout, v_max: np.ndarray) -> float:
    """The release of the step's synchronisation point: the last rank's arrival. Every
    other rank waits that long for it (clocks of different hosts agree to NTP accuracy)."""
    return layout.max_per_step(v_max, "arrival_unix_s")


def add_step(
    batch: ColumnBatch,
    layout: VectorLayout,
    v: np.ndarray,
    v_max: np.ndarray,
    meta: StepMeta,
    world_size: int,
) -> None:
    """The steps row and the L layers rows of one reduced vector (and its MAX companion)."""
    tokens = layout.per_step(v, "tokens")
    # In a synchronous job the step ends when the slowest rank ends.
    step_time_s = layout.max_per_step(v_max, "step_time_s")
    tokens_per_s = _safe_div(tokens, step_time_s)
    tflops_per_device = tokens_per_s * meta.flops_per_token / world_size / 1e12
    grad_sumsq = layout.per_layer(v, "grad_sumsq")
    grad_nonfinite = layout.per_layer(v, "grad_nonfinite")
    act_nonfinite = layout.per_layer(v, "act_nonfinite")
    # The job's loss: token-weighted over the ranks; their plain mean if no rank reported
    # tokens (step(tokens=0)), where the weighted mean would be 0/0.
    loss = (
        layout.per_step(v, "loss_x_tokens") / tokens
        if tokens > 0
        else layout.per_step(v, "loss") / world_size
    )
    power_ranks, energy_ranks = (
        layout.per_step(v, "power_ranks"),
        layout.per_step(v, "energy_ranks"),
    )
    batch.append(
        "steps",
        step=meta.step,
        # It also dates the step, however late the export thread gets to it.
        time_unix_s=release_unix_s(layout, v_max),
        loss=loss,
        grad_norm=math.sqrt(grad_sumsq.sum()),
        lr=meta.lr,
        tokens=round(tokens),
        step_time_s=step_time_s,
        tokens_per_s=tokens_per_s,
        tflops_per_s_per_device=tflops_per_device,
        mfu_ratio=tflops_per_device * 1e12 / meta.peak_flops_per_s,
        # Job totals over the ranks that report power; None when none does.
        power_w=layout.per_step(v, "power_w") if power_ranks else None,
        energy_j=layout.per_step(v, "energy_j") if energy_ranks else None,
        nonfinite_count=round(grad_nonfinite.sum() + act_nonfinite.sum()),
        nonfinite_steps=round(layout.max_per_step(v_max, "nonfinite_steps")),
        telemetry_dropped=round(layout.per_step(v, "telemetry_dropped")),
    )
    n = layout.n_layers
    act_rms = np.sqrt(
        layout.per_layer(v, "act_sumsq") / np.maximum(layout.per_layer(v, "act_count"), 1e-300)
    )
    # The change made by the optimizer step just before this step; null when none was
    # measured (negative: a run's first logged step, which no optimizer step precedes),
    # NaN or inf when the step wrote non-finite weights.
    update_sumsq = layout.per_layer(v, "update_sumsq")
    numel = np.asarray(layout.layer_numel, dtype=np.float64) if layout.layer_numel else 1.0
    measured = ~(update_sumsq < 0)  # NaN is measured
    with np.errstate(invalid="ignore"):
        update_rms = np.sqrt(np.where(measured, update_sumsq, 0.0) / numel)
    batch.add(
        "layers",
        {
            "step": (np.full(n, meta.step, dtype=np.int64), None),
            "layer": (np.arange(n, dtype=np.int64), None),
            "grad_norm": (np.sqrt(grad_sumsq), None),
            "act_rms": (act_rms, None),
            "act_max_abs": (v_max[:n].copy(), None),
            "act_nonfinite_steps": (np.rint(v_max[n : 2 * n]).astype(np.int64), None),
            "param_norm": (np.sqrt(layout.per_layer(v, "param_sumsq")), None),
            "update_rms": (update_rms, None if measured.all() else measured),
            "nonfinite_count": (np.rint(grad_nonfinite).astype(np.int64), None),
            "act_nonfinite_count": (np.rint(act_nonfinite).astype(np.int64), None),
        },
        n,
    )


def add_ranks(
    batch: ColumnBatch, step: int, ranks: np.ndarray, slots: np.ndarray, release_unix_s: float
) -> None:
    """The ranks rows of one node: `slots` (len(ranks), len(RANK_SLOT)) as gathered from the
    node's ranks, columns named by RANK_SLOT; `ranks` their global ranks."""
    n = len(ranks)
    col = {name: slots[:, i] for name, i in _SLOT.items()}
    step_time_s = col["step_time_s"]
    with np.errstate(divide="ignore", invalid="ignore"):
        tokens_per_s = np.where(step_time_s != 0, col["tokens"] / step_time_s, np.nan)
        grad_sumsq = col["grad_sumsq_local"]
        grad_measured = ~(grad_sumsq < 0)
        grad_norm_local = np.sqrt(np.where(grad_measured, grad_sumsq, 0.0))
    columns = {
        "step": (np.full(n, step, dtype=np.int64), None),
        "rank": (np.asarray(ranks, dtype=np.int64), None),
        "step_time_s": (step_time_s, None),
        "tokens_per_s": (tokens_per_s, None),
        "loss": (col["loss"], None),
        "grad_norm_local": (grad_norm_local, None if grad_measured.all() else grad_measured),
        "wait_time_s": (release_unix_s - col["arrival_unix_s"], None),
    }
    for name in _AS_IS:  # NaN: not reported, a null
        values = col[name]
        finite = np.isfinite(values)
        columns[name] = (values, None if finite.all() else finite)
    for name in _INTEGER:
        values = col[name]
        finite = np.isfinite(values)
        ints = np.where(finite, values, 0.0).astype(np.int64)
        columns[name] = (ints, None if finite.all() else finite)
    batch.add("ranks", columns, n)
