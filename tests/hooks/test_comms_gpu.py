"""CommsMeter on CUDA and NCCL. Skipped without a GPU.

With one GPU the NCCL group has one rank, so FSDP issues no collectives of its own: the
completion-hook test issues them directly, and the no-sync test calls the meter's
reduce-scatter wrapper the way FSDP would.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from trainvitals.hooks import comms
from trainvitals.hooks.comms_fsdp import _param_groups
from trainvitals.trainer.model import PRESETS, Transformer
from trainvitals.trainer.parallel import build_mesh, parallelize

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def nccl_world(tmp_path_factory):
    store = dist.FileStore(str(tmp_path_factory.mktemp("nccl") / "store"), 1)
    dist.init_process_group(
        "nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0)
    )
    yield dist.group.WORLD
    dist.destroy_process_group()


def _seconds(tally: comms._Tally) -> dict[str, float]:
    with tally._lock:
        return dict(tally.hook_time_s)


def test_completion_hook_times_each_kind(nccl_world) -> None:
    tally = comms._Tally()
    # TORCH_NCCL_ENABLE_TIMING is not set here: enable=True turns timing on afterwards.
    assert comms.watch_nccl_completions(nccl_world, tally, enable=True) == ""
    x = torch.ones(1 << 22, device="cuda")
    dist.all_reduce(x)
    dist.all_gather_into_tensor(torch.empty_like(x), x)
    dist.reduce_scatter_tensor(torch.empty_like(x), x)
    torch.cuda.synchronize()
    deadline = time.monotonic() + 10  # the hook thread sees completions within ~100 ms
    while min(_seconds(tally).values()) == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    seconds = _seconds(tally)
    comms.watch_nccl_completions(nccl_world, None, enable=False)
    assert all(0 < s < 1 for s in seconds.values()), seconds


def test_meter_on_fsdp_never_syncs(nccl_world) -> None:
    mesh = build_mesh("cuda", 1, 1)
    torch.manual_seed(0)
    model = parallelize(Transformer(PRESETS["small"]).cuda(), mesh)
    meter = comms.CommsMeter(model, mesh, torch.device("cuda", 0), time_collectives=True)
    assert not meter.covers_grads  # dp = 1: no reduce-scatter carries the gradients
    tokens = torch.randint(0, 256, (2, 64), device="cuda")
    meter.arm(True)
    F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    assert all(v == 0 for v in meter.take(1).values())
    meter.arm(False)
    # What FSDP calls for dp > 1: this rank's flat gradients, reduced over the group.
    (param_group,) = _param_groups(model.layers[0])
    reduce_scatter = param_group._reduce_scatter_comm
    flat = torch.randn(1 << 16, device="cuda")
    out = torch.empty_like(flat)
    reduce_scatter(output_tensor=out, input_tensor=flat, group=nccl_world, op=dist.ReduceOp.SUM)
    meter.arm(True)  # one armed step: the call above is not counted, the two below are
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronising CUDA call now raises
    try:
        for _ in range(2):
            reduce_scatter(
                output_tensor=out, input_tensor=flat, group=nccl_world, op=dist.ReduceOp.SUM
            )
        sumsq = meter.local_grad_sumsq.clone()  # take() zeroes it
        took = meter.take(3)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    expected = 2 * flat.double().square().sum().item()
    assert sumsq.item() == pytest.approx(expected, rel=1e-9), meter.unavailable
    assert took["reduce_scatter_count"] == 2
    assert took["reduce_scatter_bytes"] == 2 * flat.numel() * 4
    meter.close()
    assert param_group._reduce_scatter_comm is not reduce_scatter
