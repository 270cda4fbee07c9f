"""Training FLOPs per token and the peak FLOP/s of a device, for MFU.

MFU (model FLOPs utilisation) = achieved model FLOP/s / peak FLOP/s, as defined in PaLM
(Chowdhery et al., 2022, appendix B). Model FLOPs count the matmuls a training step must
do whatever the implementation: activation recomputation and padding do not count.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode
from torch.utils.flop_counter import FlopCounterMode, flop_registry


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


# What a run's MFU rests on when attach() is given no flops_per_token, until its first
# step is counted (StepFlops), or when that count fails (hooks/runmeta.py). Right for a
# dense transformer without its attention term.
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


class StepFlops:
    """One training step's FLOPs, counted once by torch's FlopCounterMode, for a model
    attach() was given no flops_per_token for (a CNN, a mixture of experts: the 6 N rule
    is a dense transformer's).

    The count runs from the model's first forward with gradients on (an evaluation under
    no_grad before training is no training step) to the next monitor.step: the step's
    forward and backward, every micro-batch of it; the optimizer step comes after
    monitor.step. FlopCounterMode reads tensor shapes only: it launches no kernel and
    waits for none, so the count syncs nothing, but every op of that one step goes
    through Python (one slow step). Then the hook is removed: later steps pay nothing.

    What it counts is torch's flop_registry: matmuls, convolutions, attention (2 FLOPs
    per multiply-add), the model FLOPs of PaLM's MFU; elementwise work is not counted.
    A count that fails (a formula raising on an op's shapes, another dispatch mode still
    open at the step's end, a forward run compiled: torch.compile sees no hook to enter
    it from) leaves `error` set and the estimate in place.
    """

    def __init__(self, model: nn.Module) -> None:
        self.error: str | None = None
        self._counter: FlopCounterMode | None = None
        self._failed: list[str] = []
        self._hook = model.register_forward_pre_hook(self._begin)

    def _begin(self, module: nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling():
            self.error = "the forward ran compiled (torch.compile): nothing was counted"
            return
        if self._counter is not None or not torch.is_grad_enabled():
            return
        self._hook.remove()
        self.error = None
        registry = {op: self._guarded(op, formula) for op, formula in _formulas().items()}
        counter = FlopCounterMode(display=False, custom_mapping=registry)
        try:
            counter.__enter__()
        except Exception as e:  # telemetry never breaks training
            self.error = f"FlopCounterMode did not start: {type(e).__name__}: {e}"
            return
        self._counter = counter

    def _guarded(self, op: Any, formula: Callable[..., int]) -> Callable[..., int]:
        """`formula`, but an error in it fails the count rather than the user's forward."""

        def count(*args: Any, **kwargs: Any) -> int:
            try:
                return formula(*args, **kwargs)
            except Exception as e:  # any formula's: the forward it runs in is the user's
                self._failed.append(f"{op}: {type(e).__name__}: {e}")
                return 0

        count._get_raw = True  # type: ignore[attr-defined]  # already shape-wrapped
        return count

    def finish(self) -> int | None:
        """End the count: the FLOPs of the step, or None (`error` says why). Idempotent."""
        self._hook.remove()
        counter, self._counter = self._counter, None
        if counter is None:
            self.error = self.error or "no forward with gradients ran before the step's end"
            return None
        if _get_current_dispatch_mode() is not counter.mode:
            # Leaving would pop the other mode, not ours: the user's code opened one.
            self.error = "another torch dispatch mode was still open at the step's end"
            return None
        counter.__exit__(None, None, None)
        if self._failed:
            self.error = f"a FLOP formula failed ({self._failed[0]})"
            return None
        return counter.get_total_flops()


def _formulas() -> dict[Any, Callable[..., int]]:
    """torch's FLOP formulas, plus the CPU attention kernel's: torch (2.13) has them for
    the CUDA kernels only, and the CPU one takes the same shapes first (query, key, value;
    its backward grad_out first), so the count is the same."""
    aten = torch.ops.aten
    formulas = dict(flop_registry)
    for cpu, cuda in [
        ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention"),
        (
            "_scaled_dot_product_flash_attention_for_cpu_backward",
            "_scaled_dot_product_flash_attention_backward",
        ),
    ]:
        if hasattr(aten, cpu) and getattr(aten, cuda) in formulas:
            formulas.setdefault(getattr(aten, cpu), formulas[getattr(aten, cuda)])
    return formulas


# Why a tensor-parallel run keeps the estimate: FlopCounterMode sees a DTensor op at its
# global shapes (a sharded matmul whole) but an op on a rank's local shard (attention over
# its heads) as that rank's share; one rank's count is neither the model's nor its own
# (dp=2 x tp=2 counted 794,624 FLOPs per token of the reference model, one process 851,968).
TP_NOT_COUNTED = "tensor parallelism (one rank's FlopCounterMode count is not the model's)"


def counted_source(flops: int, tokens: int, step: int) -> str:
    """runs.flops_source of a counted run: how, over what."""
    return (
        f"counted: torch FlopCounterMode over step {step}'s forward and backward, "
        f"{flops:.4g} FLOPs / {tokens} tokens"
    )


def estimate_source(why_not_counted: str | None) -> str:
    """runs.flops_source of a run left with the 6 N estimate, and why it was not counted."""
    return FLOPS_ESTIMATE + (f"; not counted: {why_not_counted}" if why_not_counted else "")
