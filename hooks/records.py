"""The layout of the one vector each logged step reduces, and its unpacking into records.

Every rank fills the same float64 vector; a SUM all-reduce then yields global values:

    [grad_sumsq | act_sumsq | act_count | param_sumsq | update_sumsq
     | grad_nonfinite | act_nonfinite  (L each)
     | loss*tokens | tokens | rank slots x W*S]

Maxima cannot ride a SUM, so a second, small vector goes through a MAX all-reduce issued
right after the first on the same group:

    [act_max_abs (L) | act_nonfinite_steps (L) | nonfinite_steps]

all three over every step since the previous logged one.

Sums of squares and counts are already weighted by 1/copies (see layers.py), so the sum
over ranks counts every element once. Each rank writes only its own rank slot (the S
values of RANK_SLOT) and leaves the others zero, so the same SUM gathers every rank's
timing, power and fingerprint: O(layers + ranks) numbers, one collective. A value a rank
does not have is NaN in its own slot, and stays NaN after the sum (NaN + 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from trainvitals.schema import BatchBuilder

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
    for name in ("compute_time_s", "data_time_s", *COMMS_FIELDS, *SAMPLED_FIELDS)
    if name not in _INTEGER
)

# What each rank reports about itself. Fingerprints are 52-bit integers, exact in float64.
RANK_SLOT = (
    "step_time_s",  # host wall time between this rank's step boundaries
    "tokens",
    "loss",  # this rank's local loss
    "compute_time_s",  # CPU: the training thread's CPU time; CUDA: event-timed (see monitor)
    "data_time_s",  # previous optimizer step's end -> this step's first forward
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
_PER_STEP = ("loss_x_tokens", "tokens")


@dataclass(frozen=True)
class VectorLayout:
    n_layers: int
    world_size: int
    layer_numel: tuple[int, ...] = ()  # global parameter count of each layer

    @property
    def size(self) -> int:
        return len(_PER_LAYER) * self.n_layers + len(_PER_STEP) + len(RANK_SLOT) * self.world_size

    def per_layer(self, v: np.ndarray, name: str) -> np.ndarray:
        i = _PER_LAYER.index(name)
        return v[i * self.n_layers : (i + 1) * self.n_layers]

    def grad_sumsq(self, v: np.ndarray) -> np.ndarray:
        return self.per_layer(v, "grad_sumsq")

    def act_sumsq(self, v: np.ndarray) -> np.ndarray:
        return self.per_layer(v, "act_sumsq")

    def act_count(self, v: np.ndarray) -> np.ndarray:
        return self.per_layer(v, "act_count")

    def per_step(self, v: np.ndarray, name: str) -> float:
        return float(v[len(_PER_LAYER) * self.n_layers + _PER_STEP.index(name)])

    def rank_slots(self, v: np.ndarray) -> np.ndarray:
        """(world_size, len(RANK_SLOT)) array, columns named by RANK_SLOT."""
        start = len(_PER_LAYER) * self.n_layers + len(_PER_STEP)
        return v[start:].reshape(self.world_size, len(RANK_SLOT))


@dataclass(frozen=True)
class StepMeta:
    """What the host knew when the step's vector was packed."""

    step: int
    lr: float | None
    flops_per_token: float
    peak_flops_per_s: float
    telemetry_dropped: int = 0


def _safe_div(a: float, b: float) -> float:
    return a / b if b else math.nan


def _finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _measured_rms(sumsq: float, numel: float = 1.0) -> float | None:
    """sqrt(sumsq / numel) of a sum of squares the hooks mark negative when they did not
    measure it: None then; NaN or inf when the values held one (a finding, not a gap).
    numel 1: the norm itself."""
    return None if sumsq < 0 else math.sqrt(sumsq / numel)


def _int_or_none(x: float) -> int | None:
    return int(x) if math.isfinite(x) else None


def _step_loss(layout: VectorLayout, v: np.ndarray, ranks: np.ndarray, tokens: float) -> float:
    """The job's loss: token-weighted over the ranks; their plain mean if no rank reported
    tokens (step(tokens=0)), where the weighted mean would be 0/0."""
    if tokens > 0:
        return layout.per_step(v, "loss_x_tokens") / tokens
    return float(np.mean(ranks[:, _SLOT["loss"]]))


def append_step(
    builder: BatchBuilder, layout: VectorLayout, v: np.ndarray, v_max: np.ndarray, meta: StepMeta
) -> None:
    """Turn one reduced vector (and its MAX companion) into a steps row, L layers rows and W
    ranks rows."""
    ranks = layout.rank_slots(v)
    tokens = layout.per_step(v, "tokens")
    # In a synchronous job the step ends when the slowest rank ends.
    step_time_s = float(ranks[:, _SLOT["step_time_s"]].max())
    tokens_per_s = _safe_div(tokens, step_time_s)
    tflops_per_device = tokens_per_s * meta.flops_per_token / layout.world_size / 1e12
    grad_sumsq = layout.grad_sumsq(v)
    grad_nonfinite = layout.per_layer(v, "grad_nonfinite")
    act_nonfinite = layout.per_layer(v, "act_nonfinite")
    power = ranks[:, _SLOT["power_w"]]
    energy = ranks[:, _SLOT["energy_j"]]
    # The release of the step's synchronisation point is the last rank's arrival: every
    # other rank waits that long for it (clocks of different hosts agree to NTP accuracy).
    # It also dates the step, however late the export thread gets to it.
    release = float(ranks[:, _SLOT["arrival_unix_s"]].max())
    builder.append(
        "steps",
        step=meta.step,
        time_unix_s=release,
        loss=_step_loss(layout, v, ranks, tokens),
        grad_norm=math.sqrt(grad_sumsq.sum()),
        lr=meta.lr,
        tokens=round(tokens),
        step_time_s=step_time_s,
        tokens_per_s=tokens_per_s,
        tflops_per_s_per_device=tflops_per_device,
        mfu_ratio=tflops_per_device * 1e12 / meta.peak_flops_per_s,
        # Job totals over the ranks that report power; None when none does.
        power_w=float(np.nansum(power)) if np.isfinite(power).any() else None,
        energy_j=float(np.nansum(energy)) if np.isfinite(energy).any() else None,
        nonfinite_count=round(grad_nonfinite.sum() + act_nonfinite.sum()),
        nonfinite_steps=round(v_max[-1]),
        telemetry_dropped=meta.telemetry_dropped,
    )
    act_rms = np.sqrt(layout.act_sumsq(v) / np.maximum(layout.act_count(v), 1e-300))
    param_norm = np.sqrt(layout.per_layer(v, "param_sumsq"))
    update_sumsq = layout.per_layer(v, "update_sumsq")  # negative: not measured
    for layer in range(layout.n_layers):
        builder.append(
            "layers",
            step=meta.step,
            layer=layer,
            grad_norm=math.sqrt(grad_sumsq[layer]),
            act_rms=float(act_rms[layer]),
            act_max_abs=float(v_max[layer]),
            act_nonfinite_steps=round(v_max[layout.n_layers + layer]),
            param_norm=float(param_norm[layer]),
            # The change made by the optimizer step just before this step; None when
            # none was measured (a run's first logged step, which no optimizer step
            # precedes), NaN or inf when the step wrote non-finite weights.
            update_rms=_measured_rms(float(update_sumsq[layer]), layout.layer_numel[layer]),
            nonfinite_count=round(grad_nonfinite[layer]),
            act_nonfinite_count=round(act_nonfinite[layer]),
        )
    for rank in range(layout.world_size):
        slot = {name: float(x) for name, x in zip(RANK_SLOT, ranks[rank], strict=True)}
        builder.append(
            "ranks",
            step=meta.step,
            rank=rank,
            step_time_s=slot["step_time_s"],
            tokens_per_s=_safe_div(slot["tokens"], slot["step_time_s"]),
            loss=slot["loss"],
            grad_norm_local=_measured_rms(slot["grad_sumsq_local"]),
            wait_time_s=release - slot["arrival_unix_s"],
            **{name: _finite_or_none(slot[name]) for name in _AS_IS},
            **{name: _int_or_none(slot[name]) for name in _INTEGER},
        )
