"""Worker of test_comms.py: the reference model on FSDP2 x TP over gloo, metered by CommsMeter.

torchrun --nproc-per-node DP*TP comms_script.py OUT_DIR DP TP

Writes OUT_DIR/rank{R}.json. For each variant (the trainer's parallelize(); with dp > 1 and
tp = 1 also FSDP with an fp16 reduce dtype, which pre-divides the reduce-scatter input) and
each step: the meter's take(1) (step 0 unarmed), its local_grad_sumsq, and the same sum of
squares computed from an unsharded copy of the model (same seed) on this rank's own slice of
the batch.
"""

from __future__ import annotations

import copy
import gc
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from trainvitals.hooks.comms import CommsMeter
from trainvitals.trainer.model import PRESETS, Transformer
from trainvitals.trainer.parallel import build_mesh, parallelize

GLOBAL_BATCH, SEQ, STEPS = 4, 16, 3


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())


def _reference_sumsq(
    model: nn.Module, reference: nn.Module, tp_rank: int, fp16_reduce: bool
) -> float:
    """Sum of squares of the reference gradients restricted to this rank's tp shard."""
    total = torch.zeros((), dtype=torch.float64)
    for name, p in model.named_parameters():
        grad = reference.get_parameter(name).grad
        names = p.device_mesh.mesh_dim_names
        if "tp" in names:  # tensor-parallel (parallelize() leaves tp = 1 out)
            placement = p.placements[names.index("tp")]
            if placement.is_shard():
                grad = grad.chunk(p.device_mesh.size(names.index("tp")), placement.dim)[tp_rank]
        if fp16_reduce:
            grad = grad.half()  # what FSDP put into the fp16 reduce-scatter
        total += grad.double().square().sum()
    return float(total)


def _shard(model: Transformer, mesh, fp16_reduce: bool) -> None:
    policy = MixedPrecisionPolicy(reduce_dtype=torch.float16) if fp16_reduce else None
    parallelize(model, mesh, policy)


def run(mesh, dp: int, fp16_reduce: bool) -> dict:
    dp_rank, tp_rank = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    torch.manual_seed(0)
    model = Transformer(PRESETS["tiny"])
    reference = copy.deepcopy(model)  # unsharded, same weights; no optimizer step on either
    _shard(model, mesh, fp16_reduce)
    meter = CommsMeter(model, mesh, torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)
    steps = []
    for step in range(STEPS + 2):
        tokens = torch.randint(0, 256, (GLOBAL_BATCH, SEQ + 1), generator=gen)
        mine = tokens.view(dp, -1, SEQ + 1)[dp_rank]
        # Step 0 unarmed: nothing of it is counted. Then two more steps for one take(2),
        # the first of them armed.
        meter.arm(0 < step <= STEPS)
        _loss(model, mine).backward()
        model.zero_grad()
        if step >= STEPS:
            continue
        local_sumsq = meter.local_grad_sumsq.item()  # sync point: test only
        reference.zero_grad()
        _loss(reference, mine).backward()
        steps.append(
            {
                "take": meter.take(1),
                "local_grad_sumsq": local_sumsq,
                "reference_sumsq": _reference_sumsq(model, reference, tp_rank, fp16_reduce),
            }
        )
    result = {"steps": steps, "take2": meter.take(2), "covers_grads": meter.covers_grads}
    meter.close()
    meter.arm(True)
    _loss(model, mine).backward()  # after close(): nothing is counted, even armed
    result["after_close"] = meter.take(1)
    result["unavailable"] = meter.unavailable
    return result


def main(out: str, dp: int, tp: int) -> None:
    dist.init_process_group("gloo")
    mesh = build_mesh("cpu", dp, tp)
    results = {"parallelize": run(mesh, dp, fp16_reduce=False)}
    if dp > 1 and tp == 1:
        results["fp16_reduce"] = run(mesh, dp, fp16_reduce=True)
    Path(out, f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    # Free the collectives' leftovers (reference cycles of the models and meters above)
    # while the process group lives, and let every rank finish before it goes: without
    # this, gloo aborted the interpreter's teardown in about 1 run of 3 ("terminate called
    # without an active exception"), after every result was written; with it, 0 of 6.
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
