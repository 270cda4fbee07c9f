"""Collective traffic per rank and step, and this rank's gradient norm before the reduction.

    meter = CommsMeter(model, mesh, device)   # after parallelize(): FSDP2 and TP in place
    meter.arm(True)                            # before each step: will it be logged?
    ...forward, backward...
    row = meter.take(n_steps)                  # per-step figures; re-zeroes local_grad_sumsq
    meter.close()

Collectives are counted, sized and host-timed on armed steps only (the monitor arms the
steps it logs): between them the wrappers hand straight through and the tensor-parallel
hooks are not installed, so an unlogged step pays almost nothing. Traffic repeats from step
to step, so the logged step stands for its interval.

What is counted, and where:
- FSDP2 all-gathers and reduce-scatters: every FSDPModule gets a counting wrapper around the
  comm it had (`set_custom_all_gather` / `set_custom_reduce_scatter`), which delegates to it.
- Tensor-parallel collectives go through DTensor, not FSDP; they are counted from the
  structure, by a forward hook on every module whose weight is sharded over the mesh dim
  named "tp" (Megatron-LM's split, Shoeybi et al. 2019, as in trainer/parallel.py):
    rowwise (Linear weight Shard(1), Embedding Shard(0)): one all-reduce of the output, forward;
    colwise (Linear weight Shard(0), Embedding Shard(1)): one all-reduce of the input's
      gradient in backward (when the input needs one), and one all-gather of the output in
      forward when the output comes back whole (output_layouts=Replicate()).
  Sequence parallelism (Shard(1) activation layouts) is not recognised, and a forward that
  activation checkpointing runs twice counts its colwise backward all-reduce twice.
- DDP: a comm hook counts each gradient bucket's all-reduce and reads the bucket's local
  gradients before delegating to DDP's default all-reduce.
- Not counted: collectives issued outside the model (gradient clipping's norm, the monitor's
  own all-reduce), HSDP's replica all-reduce.

Bytes are nccl-tests' "algorithm bytes", the buffer size of the collective: all-gather its
output, reduce-scatter its input, all-reduce its tensor. The bytes one rank puts on the
wire ("bus bytes") follow from them: x (n-1)/n for all-gather and reduce-scatter, and
x 2(n-1)/n for a ring all-reduce, n being the group's size
(https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md).

Time, per kind (docs/interconnect.md has the table): on NCCL, the process group's completion
hook, which reports each collective's duration measured with CUDA events on NCCL's hook
thread (taking the GIL briefly per collective, a step or so after it ran), for every step
(it cannot tell which step a late report belongs to), averaged over the interval; it needs
collective timing on (TORCH_NCCL_ENABLE_TIMING=1, or time_collectives=True).
On gloo, FSDP's collectives block the host, so the host time of the call is the collective's
time (a done-callback on the future when FSDP issues one asynchronously); DTensor's
tensor-parallel collectives on gloo are timed where the hooks wait for them (comms_tp.py:
the forward's at the module's output, the backward's on the graph node that all-reduces a
colwise input's gradient). A kind whose collectives were not all timed
reports NaN. Durations include waiting for the slowest peer, and overlapping collectives
each count in full, so the sum can exceed the step time.

Nothing here waits for the device: sizes are host metadata, and the local gradient norm is a
device reduction added into a device tensor.

Split by parallelism: comms_fsdp.py, comms_tp.py and comms_ddp.py install the counting for
each; collectives.py holds what they share (the tally, the timing sources).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .collectives import KINDS, _backend, _on_completion, _Tally, watch_nccl_completions
from .comms_ddp import install_ddp
from .comms_fsdp import install_fsdp
from .comms_tp import install_tp

__all__ = ["KINDS", "CommsMeter", "_Tally", "_on_completion", "watch_nccl_completions"]


class CommsMeter:
    """Counts a model's FSDP2 and tensor-parallel collectives on this rank (see module doc).

    arm(logged): called by the monitor before every step, True for the steps it logs:
        only those are counted, and only then does the reduce-scatter add into
        local_grad_sumsq.
    local_grad_sumsq: 0-d float64 on `device`, the sum of squares of this rank's own
        gradients before the data-parallel reduction, accumulated while armed: the local
        gradient shard this rank computed (its tensor-parallel shard; replicated parameters
        such as the norm weights on every tp rank), once per reduce-scatter. Zeroed in place
        by take(): copy it (torch.cat does) before calling take().
    covers_grads: True when every trainable parameter's gradient passes through a wrapped
        reduce-scatter (FSDP2 with dp > 1). Else local_grad_sumsq stays 0: with dp = 1 the
        gradients after backward are this rank's own and their norm is the local one; under
        DDP they are already averaged and the local norm is not available here.
    unavailable: what is not measured, and why ("" when everything is).

    mesh: the (dp, tp) mesh; tensor-parallel modules are looked for only when it has a dim
    named "tp". FSDP modules are found in the model itself.
    """

    def __init__(
        self,
        model: nn.Module,
        mesh: DeviceMesh | None,
        device: torch.device,
        *,
        time_collectives: bool | None = None,
        ddp: nn.Module | None = None,
    ) -> None:
        # time_collectives: turn NCCL collective timing on (None: only if
        # TORCH_NCCL_ENABLE_TIMING=1 already did). Costs a CUDA event pair per collective
        # and a hand-over to the hook thread.
        if time_collectives is None:
            time_collectives = os.environ.get("TORCH_NCCL_ENABLE_TIMING", "0") == "1"
        self.armed = False
        # heartbeat.Liveness of the monitor, if any: FSDP's collectives mark its phase.
        self.liveness: Any = None
        self._armed_steps = 0  # since the last take()
        self._tp_hooks: list[tuple[nn.Module, Callable]] = []  # installed while armed
        self._tp_handles: list[Any] = []
        self.device = device
        self.local_grad_sumsq = torch.zeros((), dtype=torch.float64, device=device)
        self.covers_grads = False
        self._tally = _Tally()
        self._time_collectives = time_collectives
        self._reasons: list[str] = []
        self._timing: dict[str, str] = {}  # process-group name -> "hook" | "host" | "none"
        self._restore: list[Callable[[], None]] = []
        self._watched: list[dist.ProcessGroup] = []
        self._measured = set(KINDS)
        try:
            fsdp = install_fsdp(self, model)
        except AttributeError as e:  # FSDP internals of a torch this was not written for
            self.close()  # gives back whatever was wrapped before the failure
            self._timing.clear()
            self._measured -= {"all_gather", "reduce_scatter"}
            self._reasons.append(f"FSDP comms: {e}")
            self.covers_grads, fsdp = False, True
        tp = mesh is not None and "tp" in (mesh.mesh_dim_names or ()) and install_tp(self, model)
        ddp_counted = ddp is not None and install_ddp(self, ddp)
        if dist.is_initialized() and dist.get_world_size() > 1 and not (fsdp or tp or ddp_counted):
            self._measured.clear()
            self._reasons.append(
                "no FSDP2 or tensor-parallel modules: collectives are not counted (DDP's "
                "gradient all-reduces are not instrumented)"
            )
        self.unavailable = "; ".join(dict.fromkeys(self._reasons))  # each reason once

    # ------------------------------------------------------------------ set-up

    def _timing_of(self, group: dist.ProcessGroup) -> str:
        name = group.group_name
        if name not in self._timing:
            backend = _backend(group, self.device)
            timing = "none"
            if backend == "nccl":
                reason = watch_nccl_completions(group, self._tally, self._time_collectives)
                timing = "none" if reason else "hook"
                if reason:
                    self._reasons.append(f"time: {reason}")
                else:
                    self._watched.append(group)
            elif backend == "gloo":
                timing = "host"
            self._timing[name] = timing
        return self._timing[name]

    def _add_local_sumsq(self, flat_grads: torch.Tensor, predivide: float) -> None:
        # float64 so the sum over millions of squares keeps its digits. Runs on the stream
        # FSDP reduces on, ordered before the step's optimizer by FSDP's own event waits.
        sumsq = torch.linalg.vector_norm(flat_grads, dtype=torch.float64).square()
        self.local_grad_sumsq.add_(sumsq * (predivide * predivide) if predivide != 1 else sumsq)

    def arm(self, logged: bool) -> None:
        """Before each step: count it (a step the monitor logs) or let it pass."""
        self.armed = logged
        if not logged:
            for handle in self._tp_handles:
                handle.remove()
            self._tp_handles = []
            return
        self._armed_steps += 1
        if not self._tp_handles and self._tp_hooks:
            self._tp_handles = [m.register_forward_hook(hook) for m, hook in self._tp_hooks]

    start_step = arm  # the meter protocol (meter.py)

    def end_step(self, loss: torch.Tensor) -> None:
        pass

    def collect(self, step: int, steps: int) -> dict[str, Any]:
        """The meter protocol's logged step: take(steps), and the local gradients' sum of
        squares when a hook read them, copied before take() zeroes it (stream order)."""
        local_grad = self.local_grad_sumsq.clone() if self.covers_grads else None
        return {**self.take(steps), "local_grad_sumsq": local_grad}

    def take(self, n_steps: int) -> dict[str, float]:
        """Per-step figures of every {kind}_count, {kind}_bytes and {kind}_time_s (NaN where
        not measured, or where no step was armed since the last take): counts, bytes and
        host-timed seconds averaged over the armed steps, NCCL completion-hook seconds over
        the last `n_steps` steps. Resets the counters and zeroes local_grad_sumsq.
        Host-side: never waits for the device."""
        if n_steps < 1:
            raise ValueError(f"CommsMeter.take: n_steps must be >= 1, got {n_steps}")
        count, nbytes, time_s, hook_time_s, untimed = self._tally.take()
        armed, self._armed_steps = self._armed_steps, 0
        self.local_grad_sumsq.zero_()  # stream-ordered after the monitor's read of it
        out = {}
        for kind in KINDS:
            measured = kind in self._measured and armed > 0
            out[f"{kind}_count"] = count[kind] / armed if measured else math.nan
            out[f"{kind}_bytes"] = nbytes[kind] / armed if measured else math.nan
            timed = measured and not untimed[kind]  # no collectives at all: 0 s, truly
            seconds = time_s[kind] / armed + hook_time_s[kind] / n_steps if timed else math.nan
            out[f"{kind}_time_s"] = seconds
        return out

    def close(self) -> None:
        """Give FSDP back its comms, remove the hooks, stop taking NCCL completions."""
        self.arm(False)
        self._tp_hooks.clear()
        for restore in reversed(self._restore):
            restore()
        self._restore.clear()
        for group in self._watched:
            watch_nccl_completions(group, None, enable=False)
        self._watched.clear()
