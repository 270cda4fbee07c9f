"""FSDP2 x tensor parallelism on a 2-D DeviceMesh (dp, tp).

Tensor parallelism follows Megatron-LM's split (Shoeybi et al., 2019): in each block the
q/k/v and w1/w3 projections are column-sharded and wo/w2 row-sharded, so a block needs one
all-reduce forward and one backward per sub-layer. The embedding is row-sharded over the
vocabulary and the head column-sharded, both returning replicated activations. The RMSNorm
weights are replicated DTensors on the tp mesh, so that every parameter lives on the same
2-D mesh once FSDP shards it over dp: gradient clipping and the hooks then see one kind of
parameter. FSDP2 (`fully_shard`) wraps each block and the root.

With tp = 1 tensor parallelism is left out, as torchtitan does: a one-wide tp mesh splits
nothing, and routing every op of the model through DTensor's dispatch multiplied the host
time of a step (the whole step on a GPU when the host sets the pace).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from .model import RMSNorm, Transformer


def build_mesh(device_type: str, dp: int, tp: int) -> DeviceMesh:
    mesh = init_device_mesh(device_type, (dp, tp), mesh_dim_names=("dp", "tp"))
    # A flattened dp x tp view lets DTensor reduce over both dims in one collective (the
    # global gradient norm for clipping) instead of two in sequence.
    mesh["dp", "tp"]._flatten("dp_tp")
    return mesh


def _replicate_norm(norm: RMSNorm, tp_mesh: DeviceMesh) -> None:
    """Make the norm weight a Replicate DTensor; inputs and outputs stay plain tensors."""

    def to_dtensor(_mod: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False) for x in inputs)

    def to_local(_mod: nn.Module, output: DTensor, _mesh: DeviceMesh) -> torch.Tensor:
        return output.to_local()

    distribute_module(norm, tp_mesh, input_fn=to_dtensor, output_fn=to_local)


def apply_tensor_parallel(model: Transformer, tp_mesh: DeviceMesh) -> None:
    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
            "output": ColwiseParallel(output_layouts=Replicate()),
        },
    )
    for block in model.layers:
        parallelize_module(
            block,
            tp_mesh,
            {
                "attention.wq": ColwiseParallel(),
                "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(),
            },
        )
        _replicate_norm(block.attention_norm, tp_mesh)
        _replicate_norm(block.ffn_norm, tp_mesh)
    _replicate_norm(model.norm, tp_mesh)


def apply_fsdp(
    model: Transformer, dp_mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy | None = None
) -> None:
    policy = mp_policy or MixedPrecisionPolicy()
    for block in model.layers:
        fully_shard(block, mesh=dp_mesh, mp_policy=policy)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy)


def parallelize(
    model: Transformer, mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy | None = None
) -> Transformer:
    """Shard `model` in place over `mesh` (dims named 'dp' and 'tp'); returns it.

    Every rank must pass a model with identical weights (same seed): tensor parallelism
    slices the local full tensors rather than broadcasting them. `mp_policy`: FSDP's
    mixed-precision policy (default: none).
    """
    if mesh["tp"].size() > 1:
        apply_tensor_parallel(model, mesh["tp"])
    apply_fsdp(model, mesh["dp"], mp_policy)
    return model
