"""Which parameters and activations make up each "layer", and how to weight their shards.

A layer is a top-level child module of the model that holds parameters, with ModuleLists
expanded into their items: for the reference trainer that gives
`tok_embeddings, layers.0, ..., layers.N-1, norm, output`.

Statistics are computed on local shards and summed over every rank with one collective.
A shard that is *replicated* over a mesh dimension appears on each rank of that dimension,
so its contribution is weighted by 1 / (size of that dimension): summed over the ranks it
then counts exactly once. Sharded placements (FSDP's Shard(0), tensor parallelism's
Shard(0/1), strided shards) partition the tensor and get weight 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

try:  # what functional collectives return before they are waited on (torch 2.2 and later)
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
except ImportError:  # pragma: no cover
    AsyncCollectiveTensor = None


@dataclass(frozen=True)
class LayerMap:
    names: list[str]
    modules: list[nn.Module]
    # For each parameter (in model.parameters() order): its layer index.
    param_layer: list[int]


def find_layers(model: nn.Module) -> LayerMap:
    names: list[str] = []
    modules: list[nn.Module] = []
    for child_name, child in model.named_children():
        items = (
            [(f"{child_name}.{i}", m) for i, m in enumerate(child)]
            if isinstance(child, nn.ModuleList)
            else [(child_name, child)]
        )
        for name, module in items:
            if any(True for _ in module.parameters()):
                names.append(name)
                modules.append(module)
    layer_of = {id(p): i for i, m in enumerate(modules) for p in m.parameters()}
    orphans = [n for n, p in model.named_parameters() if id(p) not in layer_of]
    if orphans:
        # Parameters held directly by the root: give them a layer of their own.
        names.append("root")
        modules.append(model)
        layer_of.update(
            {id(p): len(names) - 1 for p in model.parameters() if id(p) not in layer_of}
        )
    return LayerMap(names, modules, [layer_of[id(p)] for p in model.parameters()])


class OptimizerParams:
    """Which of the model's parameters an optimizer steps, by their position in `params`
    (none: not this model's optimizer). The optimizer hooks are global, so they fire for
    every optimizer in the process; the answer is worked out once per optimizer."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self._index = {id(p): i for i, p in enumerate(params)}
        self._positions: dict[int, list[int]] = {}

    def positions(self, optimizer: torch.optim.Optimizer) -> list[int]:
        key = id(optimizer)
        if key not in self._positions:
            self._positions[key] = [
                self._index[id(p)]
                for group in optimizer.param_groups
                for p in group["params"]
                if id(p) in self._index
            ]
        return self._positions[key]


def replication_weight(t: torch.Tensor, plain_copies: int = 1) -> float:
    """1 / (number of ranks holding an identical copy of this tensor's local shard).

    A plain tensor has `plain_copies` copies: for parameters that is the world size (DDP
    replicates them on every rank); for activations, 1 unless told otherwise.
    """
    if not isinstance(t, DTensor):
        return 1.0 / plain_copies
    copies = 1
    for dim, placement in enumerate(t.placements):
        if placement.is_replicate():
            copies *= t.device_mesh.size(dim)
        elif placement.is_partial():
            # A partial tensor's local values are addends, not copies: its norm is not
            # the norm of the whole. Callers must not see one (FSDP reduces gradients).
            raise ValueError(f"cannot take a norm of a Partial DTensor ({t.placements})")
    return 1.0 / copies


def plain_activation_weight(mesh: DeviceMesh | None, replicated_dims: tuple[str, ...]) -> float:
    """Weight of a plain-tensor activation, identical on every rank along `replicated_dims`.

    Without sequence parallelism a tensor-parallel block hands back the same activations on
    every rank of its tp group (RowwiseParallel ends in an all-reduce), so each copy counts
    1/tp.
    """
    if mesh is None:
        return 1.0
    names = mesh.mesh_dim_names or ()
    copies = 1
    for dim in replicated_dims:
        if dim in names:
            copies *= mesh.size(names.index(dim))
    return 1.0 / copies


def local(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor this rank holds of `t` (a DTensor's local shard), for reading.

    Taken from the DTensor directly: `to_local()` runs an autograd Function, about 13 us a
    call, which over every parameter (three times) was most of a logged step's host time."""
    return t._local_tensor if isinstance(t, DTensor) else t


def first_float_tensor(output: Any) -> torch.Tensor | None:
    """The tensor a layer's statistics describe: its output, or the first floating-point
    tensor in a tuple, list or dict of them (a Hugging Face layer returns (hidden, ...), a
    model a dict of outputs); None if it has none (token ids, a router's indices)."""
    if isinstance(output, torch.Tensor):
        return output if output.is_floating_point() else None
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, tuple | list):
        for item in output:
            found = first_float_tensor(item)
            if found is not None:
                return found
    return None


def dense_values(t: torch.Tensor) -> torch.Tensor:
    """A tensor whose norm is `t`'s: a sparse gradient (nn.Embedding(sparse=True)) by its
    values, as the norm kernels take dense tensors only."""
    if not t.is_sparse:
        return t
    # sync point: sparse gradients only; coalescing sizes its output on the host.
    return t.coalesce().values()


def arrived(t: torch.Tensor) -> torch.Tensor:
    """The plain local tensor of a layer's output. A tensor-parallel layer returns the
    result of an asynchronous collective wrapped in a tensor subclass: reading it through
    the wrapper costs a Python dispatch per op, so it is unwrapped once it has arrived.
    The wait is where the next layer would wait anyway."""
    t = local(t)
    if AsyncCollectiveTensor is not None and isinstance(t, AsyncCollectiveTensor):
        t = t.trigger_wait()
    return t


def check_attachable(model: nn.Module) -> None:
    """ValueError for a model the monitor cannot watch as it is: one already watched (two
    monitors would both wrap FSDP's collectives, and closing one would unwrap the other's),
    or one with parameters not materialized yet (on the meta device)."""
    if getattr(model, "_trainvitals_attached", False):
        raise ValueError("attach: a monitor is already attached to this model; close() it first")
    meta = next((n for n, p in model.named_parameters() if local(p).is_meta), None)
    if meta is not None:
        raise ValueError(
            f"attach: parameter {meta!r} is on the meta device; materialize the model "
            "(model.to_empty(device=...) and load or initialise its weights) before attach"
        )
