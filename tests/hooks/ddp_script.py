"""A plain training loop, optionally under DDP, monitored by trainvitals (run by test_ddp.py).

python ddp_script.py OUT.jsonl                 one process, the whole global batch
torchrun --nproc-per-node 2 ddp_script.py OUT  DDP over gloo, half the batch per rank
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from trainvitals.hooks import JsonlExporter, NullExporter, attach
from trainvitals.trainer.model import PRESETS, Transformer

GLOBAL_BATCH, SEQ, STEPS = 8, 32, 4


def main(out: str) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    torch.manual_seed(0)
    model = Transformer(PRESETS["tiny"])
    if world > 1:
        model = DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    exporter = JsonlExporter(out) if rank == 0 else NullExporter()
    monitor = attach(model, exporter=exporter, log_every=1, peak_flops_per_s=1e12)
    gen = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        batch = torch.randint(0, 256, (GLOBAL_BATCH, SEQ + 1), generator=gen)
        mine = batch.view(world, -1, SEQ + 1)[rank]
        loss = F.cross_entropy(model(mine[:, :-1]).flatten(0, 1), mine[:, 1:].flatten())
        loss.backward()
        monitor.step(loss=loss, tokens=mine[:, 1:].numel())
        opt.step()
        opt.zero_grad()
    monitor.close()
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
