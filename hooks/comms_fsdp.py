"""FSDP2's collectives, counted: every FSDPModule gets a counting wrapper around the comm it
had (`set_custom_all_gather` / `set_custom_reduce_scatter`), which delegates to it; the
reduce-scatter's input, this rank's own gradients, also gives the local gradient norm.
See comms.py for what is counted and how it is timed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .collectives import _in_collective, _issue

if TYPE_CHECKING:
    from .comms import CommsMeter

try:  # FSDP2's comm interface (checked on torch 2.11 and 2.13)
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
        _get_gradient_divide_factors,
    )
except ImportError:  # pragma: no cover - older torch: FSDP traffic is reported as NaN
    FSDPModule = AllGather = ReduceScatter = _get_gradient_divide_factors = None


if AllGather is not None:

    class _CountingAllGather(AllGather):
        """FSDP's all-gather, counted. Bytes: the gathered output (padded flat shards)."""

        def __init__(self, inner: AllGather, meter: CommsMeter, timing: str) -> None:
            self.inner, self._meter, self._timing = inner, meter, timing

        def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            return self.inner.allocate(size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            def call() -> Any:
                return self.inner(
                    output_tensor=output_tensor,
                    input_tensor=input_tensor,
                    group=group,
                    async_op=async_op,
                )

            call = _in_collective(self._meter.liveness, call)
            if not self._meter.armed:
                return call()
            nbytes = output_tensor.numel() * output_tensor.element_size()
            return _issue(self._meter._tally, "all_gather", nbytes, self._timing, call)

    class _CountingReduceScatter(ReduceScatter):
        """FSDP's reduce-scatter, counted. Bytes: the input, this rank's whole flattened
        gradient of the group (padded). While the meter is armed, that input's sum of
        squares goes into the meter's local_grad_sumsq, on the stream FSDP reduces on
        (param_group None: not)."""

        def __init__(
            self, inner: ReduceScatter, meter: CommsMeter, param_group: Any | None, timing: str
        ) -> None:
            self.inner, self._meter, self._group, self._timing = inner, meter, param_group, timing

        def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            return self.inner.allocate(size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            def call() -> Any:
                return self.inner(
                    output_tensor=output_tensor,
                    input_tensor=input_tensor,
                    group=group,
                    op=op,
                    async_op=async_op,
                )

            call = _in_collective(self._meter.liveness, call)
            if not self._meter.armed:
                return call()
            if self._group is not None:
                self._meter._add_local_sumsq(
                    input_tensor, _predivide_factor(self._group, input_tensor)
                )
            nbytes = input_tensor.numel() * input_tensor.element_size()
            return _issue(self._meter._tally, "reduce_scatter", nbytes, self._timing, call)


def _predivide_factor(param_group: Any, flat_grads: torch.Tensor) -> float:
    """What FSDP divided the reduce-scatter input by before handing it to the comm (1: nothing).

    torch 2.13's foreach_reduce asks _get_gradient_divide_factors: with an fp32 or bf16 reduce
    dtype (the trainer's case: fp32) nothing is pre-divided, the averaging being the
    reduce-scatter's op (AVG, or PREMUL_SUM with a custom divide factor); with another
    reduce dtype (fp16) the input is divided first by a power of two near sqrt(dp) to avoid
    overflow. A power of two divides exactly, so multiplying back restores the gradients.
    """
    hsdp = param_group._is_hsdp
    pre, _post, _rs_op, _ar_op = _get_gradient_divide_factors(
        param_group._reduce_scatter_process_group,
        param_group._all_reduce_process_group if hsdp else None,
        flat_grads.dtype,
        flat_grads.device.type,
        param_group.gradient_divide_factor,
        param_group.force_sum_reduction_for_comms,
    )
    return float(pre or 1.0)


def _param_groups(module: nn.Module) -> list[Any]:
    """An FSDP module's parameter groups: a list from torch 2.13 on, at most one before."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = state._fsdp_param_group
        groups = [] if group is None else [group]
    return list(groups)


def _fsdp_modules(model: nn.Module) -> list[nn.Module]:
    if FSDPModule is None:
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def install_fsdp(meter: CommsMeter, model: nn.Module) -> bool:
    modules = _fsdp_modules(model)
    if not modules:
        return False
    if not hasattr(modules[0], "set_custom_all_gather"):
        meter._measured -= {"all_gather", "reduce_scatter"}
        meter._reasons.append("FSDP2 of this torch has no set_custom_all_gather")
        return True
    covered: set[int] = set()
    for module in modules:
        for param_group in _param_groups(module):
            if getattr(param_group, "_is_hsdp", False):
                meter._measured.discard("all_reduce")
                meter._reasons.append("all_reduce: HSDP's replica all-reduce is not counted")
            if _wrap(meter, module, param_group, _can_undo_predivide(meter, param_group)):
                covered.update(id(p.sharded_param) for p in param_group.fsdp_params)
    trainable = [p for p in model.parameters() if p.requires_grad]
    meter.covers_grads = bool(trainable) and all(id(p) in covered for p in trainable)
    return True


def _can_undo_predivide(meter: CommsMeter, param_group: Any) -> bool:
    """Whether this torch's FSDP answers _predivide_factor (a private interface): asked
    once here, so that a mismatch costs the local norm, never a failed backward."""
    try:
        _predivide_factor(param_group, torch.empty(0, device=meter.device))
    except (AttributeError, TypeError) as e:
        meter._reasons.append(f"local gradient norm: FSDP's divide factors unknown ({e})")
        return False
    return True


def _wrap(meter: CommsMeter, module: nn.Module, param_group: Any, sumsq: bool) -> bool:
    """Wrap one FSDP module's comms; True if its gradients pass through our reduce-scatter
    and go into local_grad_sumsq."""
    ag_group = param_group._all_gather_process_group
    rs_group = param_group._reduce_scatter_process_group
    ag, rs = param_group._all_gather_comm, param_group._reduce_scatter_comm
    try:
        module.set_custom_all_gather(_CountingAllGather(ag, meter, meter._timing_of(ag_group)))
        module.set_custom_reduce_scatter(
            _CountingReduceScatter(
                rs, meter, param_group if sumsq else None, meter._timing_of(rs_group)
            )
        )
    except ValueError as e:  # several parameter groups in one module
        meter._measured -= {"all_gather", "reduce_scatter"}
        meter._reasons.append(f"FSDP comms of {type(module).__name__}: {e}")
        return False

    def restore() -> None:
        module.set_custom_all_gather(ag)
        module.set_custom_reduce_scatter(rs)

    meter._restore.append(restore)
    return sumsq and rs_group.size() > 1  # dp = 1: FSDP copies the gradients, no collective
