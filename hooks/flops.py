"""Training FLOPs per token and the peak FLOP/s of a device, for MFU.

MFU (model FLOPs utilisation) = achieved model FLOP/s / peak FLOP/s, as defined in PaLM
(Chowdhery et al., 2022, appendix B). Model FLOPs count the matmuls a training step must
do whatever the implementation: activation recomputation and padding do not count.
"""

from __future__ import annotations

import time
import warnings

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


# Dense (no sparsity) BF16 tensor-core peaks from the vendors' data sheets, FLOP/s.
# The hooks issue completes this table (FP8, more devices); these are what MFU needs now.
PEAK_BF16_FLOPS_PER_S = {
    "A100": 312e12,
    "H100": 989e12,
    "H200": 989e12,
}


def measure_cpu_peak_flops(seconds: float = 0.3, n: int = 512) -> float:
    """FLOP/s of float32 matmuls of size n on this process's CPU threads, measured now."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm-up: first call pays for allocation and thread-pool start-up
    count, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        a @ b
        count += 1
    return 2 * n**3 * count / elapsed


def peak_flops(device: torch.device, override: float | None = None) -> tuple[float, str]:
    """(peak FLOP/s of one device, where the figure came from)."""
    if override is not None:
        if override <= 0:
            raise ValueError(f"peak_flops_per_s must be positive, got {override}")
        return override, "configured"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, value in PEAK_BF16_FLOPS_PER_S.items():
            if key in name:
                return value, f"table:{key}:bf16"
        warnings.warn(
            f"no peak FLOP/s known for {name!r}: MFU will be reported as NaN; "
            "pass peak_flops_per_s to attach() to set it",
            stacklevel=2,
        )
        return float("nan"), f"unknown device {name}"
    return measure_cpu_peak_flops(), "measured:cpu-float32-matmul"
