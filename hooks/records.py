"""The layout of the one vector each logged step reduces, and its unpacking into records.

Every rank fills the same float64 vector; a SUM all-reduce then yields global values:

    [grad_sumsq x L | act_sumsq x L | act_count x L | loss*tokens | tokens | rank slots x W*3]

Sums of squares and counts are already weighted by 1/copies (see layers.py), so the sum
over ranks counts every element once. Each rank writes only its own rank slot
(step_time_s, tokens, loss) and leaves the others zero, so the same SUM gathers every
rank's timing: O(layers + ranks) numbers, one collective.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from trainvitals.schema import BatchBuilder

RANK_SLOT = ("step_time_s", "tokens", "loss")


@dataclass(frozen=True)
class VectorLayout:
    n_layers: int
    world_size: int

    @property
    def size(self) -> int:
        return 3 * self.n_layers + 2 + len(RANK_SLOT) * self.world_size

    def grad_sumsq(self, v: np.ndarray) -> np.ndarray:
        return v[: self.n_layers]

    def act_sumsq(self, v: np.ndarray) -> np.ndarray:
        return v[self.n_layers : 2 * self.n_layers]

    def act_count(self, v: np.ndarray) -> np.ndarray:
        return v[2 * self.n_layers : 3 * self.n_layers]

    def loss_and_tokens(self, v: np.ndarray) -> tuple[float, float]:
        base = 3 * self.n_layers
        return float(v[base]), float(v[base + 1])

    def rank_slots(self, v: np.ndarray) -> np.ndarray:
        """(world_size, 3) array of step_time_s, tokens, loss per rank."""
        return v[3 * self.n_layers + 2 :].reshape(self.world_size, len(RANK_SLOT))


@dataclass(frozen=True)
class StepMeta:
    """What the host knew when the step's vector was packed."""

    step: int
    lr: float | None
    flops_per_token: float
    peak_flops_per_s: float


def _safe_div(a: float, b: float) -> float:
    return a / b if b else math.nan


def append_step(builder: BatchBuilder, layout: VectorLayout, v: np.ndarray, meta: StepMeta) -> None:
    """Turn one reduced vector into a steps row, L layers rows and W ranks rows."""
    ranks = layout.rank_slots(v)
    loss_x_tokens, tokens = layout.loss_and_tokens(v)
    # In a synchronous job the step ends when the slowest rank ends.
    step_time_s = float(ranks[:, 0].max())
    tokens_per_s = _safe_div(tokens, step_time_s)
    tflops_per_device = tokens_per_s * meta.flops_per_token / layout.world_size / 1e12
    grad_sumsq = layout.grad_sumsq(v)
    builder.append(
        "steps",
        step=meta.step,
        time_unix_s=time.time(),
        loss=_safe_div(loss_x_tokens, tokens),
        grad_norm=math.sqrt(grad_sumsq.sum()),
        lr=meta.lr,
        tokens=round(tokens),
        step_time_s=step_time_s,
        tokens_per_s=tokens_per_s,
        tflops_per_s_per_device=tflops_per_device,
        mfu_ratio=tflops_per_device * 1e12 / meta.peak_flops_per_s,
    )
    act_rms = np.sqrt(layout.act_sumsq(v) / np.maximum(layout.act_count(v), 1e-300))
    for layer in range(layout.n_layers):
        builder.append(
            "layers",
            step=meta.step,
            layer=layer,
            grad_norm=math.sqrt(grad_sumsq[layer]),
            act_rms=float(act_rms[layer]),
        )
    for rank in range(layout.world_size):
        step_time, rank_tokens, loss = (float(x) for x in ranks[rank])
        builder.append(
            "ranks",
            step=meta.step,
            rank=rank,
            step_time_s=step_time,
            tokens_per_s=_safe_div(rank_tokens, step_time),
            loss=loss,
        )
