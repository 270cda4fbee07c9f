"""Tensor parallelism's collectives, counted from the model's structure: they go through
DTensor, not FSDP, so a forward hook on every module whose weight is sharded over the mesh
dim named "tp" counts them (Megatron-LM's split, Shoeybi et al. 2019, as in
trainer/parallel.py). See comms.py for the rules.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor

from .collectives import _in_collective, _Tally
from .layers import local

if TYPE_CHECKING:
    from .comms import CommsMeter


def _tp_style(module: nn.Module) -> str | None:
    """ "rowwise", "colwise" or "unknown" for a module whose weight is sharded over a mesh
    dim named "tp" of size > 1; None for any other module."""
    weight = module._parameters.get("weight")
    if not isinstance(weight, DTensor):
        return None
    names = weight.device_mesh.mesh_dim_names or ()
    if "tp" not in names:
        return None
    dim = names.index("tp")
    placement = weight.placements[dim]
    if weight.device_mesh.size(dim) == 1 or not placement.is_shard():
        return None  # replicated (the RMSNorm weights): no collective of its own
    sharded_dim = placement.dim % weight.ndim
    if isinstance(module, nn.Linear):  # weight (out, in): sharding `in` leaves partial sums
        return "colwise" if sharded_dim == 0 else "rowwise"
    if isinstance(module, nn.Embedding):  # weight (vocab, dim): sharding vocab leaves sums
        return "rowwise" if sharded_dim == 0 else "colwise"
    return "unknown"


def _gloo_waits(meter: CommsMeter, kind: str) -> Callable:
    """The one forward hook, on every step, of a tensor-parallel module on gloo: the
    forward's wait below and, for a colwise module (`kind` "all_gather"), the backward's
    (`_backward_waits`).

    DTensor hands
    back the output of its collective (the rowwise all-reduce, the all-gather of a colwise
    output made whole) before it completes, and the host would block at the output's first
    use, between modules, while the heartbeat says "forward" and no clock runs. Waited for
    here instead: under the phase "collective" (as FSDP's are), so that a rank blocked by a
    peer that hangs mid-forward says it waits and the peer is the one named (bench/
    liveness.py --where forward --tp 2 named both), and timed on armed steps, so that a
    rank the others wait for here arrives late (the straggler's arrival signal; without
    it an idle rank under tp went unnamed). The wait is where the first use would block
    anyway, and on gloo's CPU tensors no device is involved; the output stays what it was
    (its wait is done once)."""

    colwise = kind == "all_gather"

    def hook(_module: nn.Module, args: tuple, output: Any) -> None:
        if colwise:  # and in backward, where the input's gradient is summed
            _backward_waits(meter, args)
        if not isinstance(output, AsyncCollectiveTensor):
            return
        start_s = time.perf_counter()
        _in_collective(meter.liveness, output.trigger_wait)()
        if meter.armed:
            meter._tally.add_time(kind, time.perf_counter() - start_s)

    return hook


def _backward_waits(meter: CommsMeter, args: tuple) -> None:
    """For a colwise module on gloo: its input's gradient is all-reduced inside autograd,
    in the backward of the DTensor the input was made into (DTensor.from_local), which
    blocks until the peers' partial sums arrive. Hooks on that one graph node say
    "collective" while it runs, so that a rank blocked there by a peer that hangs
    mid-backward says it waits and the peer is the one named (before, both were:
    bench/liveness.py --where backward --tp 2), and time it on armed steps, as above. The
    hooks die with the step's graph."""
    node = getattr(args[0], "grad_fn", None) if args else None
    if node is None or not torch.is_grad_enabled():
        return
    live, armed = meter.liveness, meter.armed
    entered: list[tuple[float, str]] = []

    def enter(_grads: Any) -> None:
        entered.append((time.perf_counter(), live.phase if live is not None else ""))
        if live is not None:
            live.phase = "collective"

    def leave(_grad_inputs: Any, _grad_outputs: Any) -> None:
        if not entered:
            return
        start_s, before = entered.pop()
        if live is not None:
            live.phase = before
        if armed:
            meter._tally.add_time("all_reduce", time.perf_counter() - start_s)

    node.register_prehook(enter)
    node.register_hook(leave)


def _rowwise_hook(tally: _Tally, timed: bool) -> Callable:
    def hook(_module: nn.Module, _args: tuple, output: Any) -> None:
        out = local(output)  # the replicated sum: what the all-reduce carried
        tally.add("all_reduce", out.numel() * out.element_size(), timed)

    return hook


def _colwise_hook(tally: _Tally, timed: bool, full_width: int) -> Callable:
    def hook(_module: nn.Module, args: tuple, output: Any) -> None:
        inp = args[0]
        if inp.requires_grad and torch.is_grad_enabled():
            # Backward turns the input's partial gradients into a replicated one.
            tally.add("all_reduce", inp.numel() * inp.element_size(), timed)
        out = local(output)
        if out.shape[-1] == full_width:  # output gathered whole (output_layouts=Replicate)
            tally.add("all_gather", out.numel() * out.element_size(), timed)

    return hook


def install_tp(meter: CommsMeter, model: nn.Module) -> bool:
    found = False
    for module in model.modules():
        kind = _tp_style(module)
        if kind is None:
            continue
        found = True
        if kind == "unknown":
            meter._measured -= {"all_reduce", "all_gather"}
            meter._reasons.append(f"tensor parallelism of a {type(module).__name__}: unknown")
            continue
        weight = module._parameters["weight"]
        timing = meter._timing_of(weight.device_mesh.get_group("tp"))
        timed = timing in ("hook", "host")
        if timing == "host":  # gloo: waited for and timed by these hooks, every step
            waits = _gloo_waits(meter, "all_reduce" if kind == "rowwise" else "all_gather")
            meter._restore.append(module.register_forward_hook(waits).remove)
        if kind == "rowwise":
            hook = _rowwise_hook(meter._tally, timed)
        else:
            full_width = weight.shape[0 if isinstance(module, nn.Linear) else 1]
            hook = _colwise_hook(meter._tally, timed, full_width)
        meter._tp_hooks.append((module, hook))
    return found
