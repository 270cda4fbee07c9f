"""Norms of many tensors at once, as the hooks take them: fused where the device fuses them."""

from __future__ import annotations

import math

import torch


def fused_norms(
    tensors: list[torch.Tensor], ord: float, dtype: torch.dtype | None = None
) -> list[torch.Tensor]:
    """torch._foreach_norm, in input order, called once per dtype: its fused CUDA kernel
    takes tensors of one dtype only (a model under autocast has float32 block outputs and
    a bfloat16 head), and falls back to one kernel per tensor otherwise."""
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    if len(groups) == 1:
        return list(torch._foreach_norm(tensors, ord, dtype=dtype))
    norms: list = [None] * len(tensors)
    for positions in groups.values():
        group = torch._foreach_norm([tensors[i] for i in positions], ord, dtype=dtype)
        for i, norm in zip(positions, group, strict=True):
            norms[i] = norm
    return norms


def max_abs(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's largest |value|, NaN if it holds a NaN. On CUDA the inf-norm, fused: one
    kernel launch per dtype for every tensor, and NaN propagates through it
    (`max_propagate_nan`). Elsewhere `aminmax`, one read each: with the CPU inf-norm, reading
    the tiny model's block outputs took 801 us a step, with `aminmax` 220 us
    (bench/results/hook_breakdown_cpu.txt)."""
    if tensors[0].device.type == "cuda":
        return fused_norms(tensors, math.inf)
    lows, highs = zip(*(torch.aminmax(t) for t in tensors), strict=True)  # NaN propagates
    # Four ops for all of them rather than two more per tensor. Stacking promotes mixed
    # dtypes to the widest, which holds every value exactly.
    return list(torch.maximum(torch.stack(highs), torch.stack(lows).neg()).unbind())


def norm_dtype(tensors: list[torch.Tensor]) -> torch.dtype:
    """float32 norms (bf16 and fp16 tensors accumulate in it anyway); float64 for a float64
    model, which the norm kernels refuse to narrow."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
