"""DDP's gradient all-reduces, counted by a comm hook that also reads each bucket's still-local
gradients (the local gradient norm). See comms.py.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from .comms import CommsMeter


def install_ddp(meter: CommsMeter, ddp: nn.Module) -> bool:
    """DDP: a comm hook that counts each gradient bucket's all-reduce and, while armed,
    adds the bucket's still-local gradients into local_grad_sumsq before delegating to
    DDP's default all-reduce. DDP takes one comm hook: if the user set theirs, ours
    stands aside."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    group = ddp.process_group
    timing, tally = meter._timing_of(group), meter._tally

    # No annotations: DDP checks them against its own types, which postponed
    # annotations (strings) would fail.
    def hook(_state, bucket):
        grads = bucket.buffer()
        if not meter.armed:
            return allreduce_hook(group, bucket)
        meter._add_local_sumsq(grads, 1.0)
        tally.add("all_reduce", grads.numel() * grads.element_size(), timing != "none")
        start_s = time.perf_counter()
        fut = allreduce_hook(group, bucket)
        if timing != "host":
            return fut

        def timed(f: torch.futures.Future) -> torch.Tensor:
            tally.add_time("all_reduce", time.perf_counter() - start_s)
            return f.value()

        return fut.then(timed)

    try:
        ddp.register_comm_hook(None, hook)
    except RuntimeError as e:  # a comm hook is already registered, or training began
        meter._reasons.append(f"DDP: our comm hook could not be registered ({e})")
        return False
    meter.covers_grads = True
    return True
