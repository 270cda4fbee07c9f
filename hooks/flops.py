"""Training FLOPs per token and the peak FLOP/s of a device, for MFU.

MFU (model FLOPs utilisation) = achieved model FLOP/s / peak FLOP/s, as defined in PaLM
(Chowdhery et al., 2022, appendix B). Model FLOPs count the matmuls a training step must
do whatever the implementation: activation recomputation and padding do not count.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass

import torch


def flops_per_token(
    n_params: int, n_embedding_params: int, n_layers: int, n_heads: int, head_dim: int, seq_len: int
) -> float:
    """Training FLOPs per token: 6 N + 12 L H Q T (PaLM, appendix B).

    6 N: forward (2 FLOPs per multiply-add) plus backward (twice the forward) over the N
    non-embedding parameters; an embedding lookup is a gather, not a matmul, so the
    embedding table is excluded. An untied output head is a matmul and is included.
    12 L H Q T: the attention scores and the weighted sum of values, forward and backward,
    for L layers, H heads of dimension Q and a context of T tokens. The causal mask's
    skipped half is counted, as PaLM does.
    """
    dense = 6 * (n_params - n_embedding_params)
    attention = 12 * n_layers * n_heads * head_dim * seq_len
    return float(dense + attention)


# What a run's MFU rests on when attach() is given no flops_per_token (hooks/runmeta.py).
# Right for a dense transformer without its attention term; for other models (a CNN, a
# mixture of experts) pass flops_per_token, e.g. counted over one step with
# torch.utils.flop_counter.FlopCounterMode / tokens of that step.
FLOPS_ESTIMATE = "estimate: 6 x non-embedding parameters per token (dense transformer rule)"


@dataclass(frozen=True)
class Peak:
    """Dense (no structured sparsity) tensor peaks of one device, FLOP/s, from its data sheet."""

    bf16: float
    fp8: float | None  # None: the device has no FP8 matrix unit
    board_power_w: float | None = None  # maximum board power (TDP), for energy plans


# Matched by substring of the device name, in this order (GB200 before B200).
PEAKS: dict[str, Peak] = {
    "GB200": Peak(bf16=2.5e15, fp8=5.0e15, board_power_w=1200),  # per Blackwell GPU of a GB200
    "B200": Peak(bf16=2.25e15, fp8=4.5e15, board_power_w=1000),
    "H200": Peak(bf16=989e12, fp8=1979e12, board_power_w=700),
    "H100": Peak(bf16=989e12, fp8=1979e12, board_power_w=700),  # SXM
    "A100": Peak(bf16=312e12, fp8=None, board_power_w=400),  # Ampere has no FP8
    "MI355X": Peak(bf16=2516.6e12, fp8=5033.2e12, board_power_w=1400),
    "MI300X": Peak(bf16=1307.4e12, fp8=2614.9e12, board_power_w=750),
    "TPU v5p": Peak(bf16=459e12, fp8=None),  # v5p multiplies int8 (918 TOPS), not FP8
}


def lookup_peak(device_name: str) -> tuple[str, Peak] | None:
    """(table key, peak) of the first entry whose key is in `device_name`, else None."""
    for key, peak in PEAKS.items():
        if key.lower() in device_name.lower():
            return key, peak
    return None


def measure_cpu_peak_flops(seconds: float = 0.3, n: int = 512) -> float:
    """FLOP/s of float32 matmuls of size n on this process's CPU threads, measured now."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm-up: first call pays for allocation and thread-pool start-up
    count, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        a @ b
        count += 1
    return 2 * n**3 * count / elapsed


def peak_flops(
    device: torch.device, override: float | None = None, precision: str = "bf16"
) -> tuple[float, str]:
    """(peak FLOP/s of one device at `precision` ('bf16' or 'fp8'), where the figure came from)."""
    if override is not None:
        if override <= 0:
            raise ValueError(f"peak_flops_per_s must be positive, got {override}")
        return override, "configured"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        found = lookup_peak(name)
        if found is not None and getattr(found[1], precision) is not None:
            return getattr(found[1], precision), f"table:{found[0]}:{precision}"
        warnings.warn(
            f"no peak FLOP/s known for {name!r}: MFU will be reported as NaN; "
            "pass peak_flops_per_s to attach() to set it",
            stacklevel=2,
        )
        return float("nan"), f"unknown device {name}"
    return measure_cpu_peak_flops(), "measured:cpu-float32-matmul"
