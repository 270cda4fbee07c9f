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
collectives on gloo give nothing to time by. A kind whose collectives were not all timed
reports NaN. Durations include waiting for the slowest peer, and overlapping collectives
each count in full, so the sum can exceed the step time.

Nothing here waits for the device: sizes are host metadata, and the local gradient norm is a
device reduction added into a device tensor.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from .layers import local

try:  # FSDP2's comm interface (checked on torch 2.11 and 2.13)
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
        _get_gradient_divide_factors,
    )
except ImportError:  # pragma: no cover - older torch: FSDP traffic is reported as NaN
    FSDPModule = AllGather = ReduceScatter = _get_gradient_divide_factors = None

KINDS = ("all_gather", "reduce_scatter", "all_reduce")


class _Tally:
    """Per-kind counts, bytes and seconds. Written by the training thread, autograd's
    threads and the comms' callback threads, so every access holds the lock (uncontended:
    tens of nanoseconds)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        self.count = dict.fromkeys(KINDS, 0)
        self.nbytes = dict.fromkeys(KINDS, 0)
        self.time_s = dict.fromkeys(KINDS, 0.0)  # host-timed, armed steps
        self.hook_time_s = dict.fromkeys(KINDS, 0.0)  # NCCL completion hook, every step
        self.untimed = dict.fromkeys(KINDS, 0)

    def add(self, kind: str, nbytes: int, timed: bool) -> None:
        with self._lock:
            self.count[kind] += 1
            self.nbytes[kind] += nbytes
            self.untimed[kind] += not timed

    def add_time(self, kind: str, seconds: float) -> None:
        with self._lock:
            self.time_s[kind] += seconds

    def add_hook_time(self, kind: str, seconds: float) -> None:
        with self._lock:
            self.hook_time_s[kind] += seconds

    def take(self) -> tuple[dict, dict, dict, dict, dict]:
        with self._lock:
            taken = self.count, self.nbytes, self.time_s, self.hook_time_s, self.untimed
            self._reset()
        return taken


# ---------------------------------------------------------------------- timing sources

# c10d's op types, by the kind they belong to (the *_BASE ones are the single-tensor forms
# FSDP and DTensor issue).
_OP_KIND = {
    "ALLGATHER": "all_gather",
    "_ALLGATHER_BASE": "all_gather",
    "ALLGATHER_COALESCED": "all_gather",
    "REDUCE_SCATTER": "reduce_scatter",
    "_REDUCE_SCATTER_BASE": "reduce_scatter",
    "REDUCE_SCATTER_TENSOR_COALESCED": "reduce_scatter",
    "ALLREDUCE": "all_reduce",
    "ALLREDUCE_COALESCED": "all_reduce",
}

# NCCL takes one completion hook per process group, forever (there is no unregister): each
# hooked group forwards to a box that holds the tally of the meter now watching it, or None.
_HOOKED: dict[str, tuple[dist.ProcessGroup, list]] = {}
_HOOKED_LOCK = threading.Lock()


def _on_completion(box: list, info: Any) -> None:
    """Runs on NCCL's hook thread for every finished collective of the group."""
    tally, kind = box[0], _OP_KIND.get(info.op_type.name)
    duration = info.active_duration  # CUDA-event time from launch to completion
    seconds = duration.total_seconds() if hasattr(duration, "total_seconds") else float(duration)
    if tally is not None and kind is not None and seconds >= 0:  # negative: not timed
        tally.add_hook_time(kind, seconds)


def watch_nccl_completions(group: dist.ProcessGroup, tally: _Tally | None, enable: bool) -> str:
    """Send the durations of `group`'s collectives to `tally` (None: to nobody).

    Returns "" on success, else why not. `enable` turns collective timing on for the group
    when TORCH_NCCL_ENABLE_TIMING was not set: a CUDA event pair per collective from then on.
    """
    name = group.group_name
    with _HOOKED_LOCK:
        hooked = _HOOKED.get(name)
        if hooked is not None and hooked[0] is group:
            hooked[1][0] = tally
            return ""
        if tally is None:
            return ""
        box = [tally]
        try:
            if enable:
                group._enable_collectives_timing()
            group._register_on_completion_hook(lambda info: _on_completion(box, info))
        except (RuntimeError, ValueError) as e:  # timing off, another hook there, not NCCL
            return f"nccl completion hook on group {name}: {e}"
        _HOOKED[name] = (group, box)
        return ""


def _backend(group: dist.ProcessGroup, device: torch.device) -> str:
    name = dist.get_backend(group)
    if device.type == "cuda" and "nccl" in name:
        return "nccl"
    return "gloo" if device.type == "cpu" and "gloo" in name else name


def _issue(tally: _Tally, kind: str, nbytes: int, timing: str, call: Callable) -> Any:
    """Count one collective and run `call`, which issues it.

    timing: "hook" (a completion hook times it), "host" (gloo: the host waits for it, or for
    the future it returns) or "none".
    """
    if timing != "host":
        tally.add(kind, nbytes, timed=timing == "hook")
        return call()
    start_s = time.perf_counter()
    work = call()
    tally.add(kind, nbytes, timed=True)
    if work is None:  # a blocking call: it returned when the collective had finished
        tally.add_time(kind, time.perf_counter() - start_s)
    else:  # runs on gloo's thread when the collective finishes
        work.get_future().then(lambda _f: tally.add_time(kind, time.perf_counter() - start_s))
    return work


def _in_collective(live: Any, call: Callable) -> Callable:
    """`call`, with the training thread's heartbeat phase (heartbeat.Liveness) "collective"
    while it runs: a rank blocked there waits for its peers (on gloo the call blocks until
    the collective completes; on NCCL it only enqueues it)."""
    if live is None:
        return call

    def marked() -> Any:
        before, live.phase = live.phase, "collective"
        try:
            return call()
        finally:
            live.phase = before

    return marked


# ---------------------------------------------------------------------- FSDP2 comms

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


# ---------------------------------------------------------------------- tensor parallelism


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


# ---------------------------------------------------------------------- the meter


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
            fsdp = self._install_fsdp(model)
        except AttributeError as e:  # FSDP internals of a torch this was not written for
            self.close()  # gives back whatever was wrapped before the failure
            self._timing.clear()
            self._measured -= {"all_gather", "reduce_scatter"}
            self._reasons.append(f"FSDP comms: {e}")
            self.covers_grads, fsdp = False, True
        tp = mesh is not None and "tp" in (mesh.mesh_dim_names or ()) and self._install_tp(model)
        ddp_counted = ddp is not None and self._install_ddp(ddp)
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

    def _install_fsdp(self, model: nn.Module) -> bool:
        modules = _fsdp_modules(model)
        if not modules:
            return False
        if not hasattr(modules[0], "set_custom_all_gather"):
            self._measured -= {"all_gather", "reduce_scatter"}
            self._reasons.append("FSDP2 of this torch has no set_custom_all_gather")
            return True
        covered: set[int] = set()
        for module in modules:
            for param_group in _param_groups(module):
                if getattr(param_group, "_is_hsdp", False):
                    self._measured.discard("all_reduce")
                    self._reasons.append("all_reduce: HSDP's replica all-reduce is not counted")
                if self._wrap(module, param_group, self._can_undo_predivide(param_group)):
                    covered.update(id(p.sharded_param) for p in param_group.fsdp_params)
        trainable = [p for p in model.parameters() if p.requires_grad]
        self.covers_grads = bool(trainable) and all(id(p) in covered for p in trainable)
        return True

    def _can_undo_predivide(self, param_group: Any) -> bool:
        """Whether this torch's FSDP answers _predivide_factor (a private interface): asked
        once here, so that a mismatch costs the local norm, never a failed backward."""
        try:
            _predivide_factor(param_group, torch.empty(0, device=self.device))
        except (AttributeError, TypeError) as e:
            self._reasons.append(f"local gradient norm: FSDP's divide factors unknown ({e})")
            return False
        return True

    def _wrap(self, module: nn.Module, param_group: Any, sumsq: bool) -> bool:
        """Wrap one FSDP module's comms; True if its gradients pass through our reduce-scatter
        and go into local_grad_sumsq."""
        ag_group = param_group._all_gather_process_group
        rs_group = param_group._reduce_scatter_process_group
        ag, rs = param_group._all_gather_comm, param_group._reduce_scatter_comm
        try:
            module.set_custom_all_gather(_CountingAllGather(ag, self, self._timing_of(ag_group)))
            module.set_custom_reduce_scatter(
                _CountingReduceScatter(
                    rs, self, param_group if sumsq else None, self._timing_of(rs_group)
                )
            )
        except ValueError as e:  # several parameter groups in one module
            self._measured -= {"all_gather", "reduce_scatter"}
            self._reasons.append(f"FSDP comms of {type(module).__name__}: {e}")
            return False

        def restore() -> None:
            module.set_custom_all_gather(ag)
            module.set_custom_reduce_scatter(rs)

        self._restore.append(restore)
        return sumsq and rs_group.size() > 1  # dp = 1: FSDP copies the gradients, no collective

    def _install_tp(self, model: nn.Module) -> bool:
        found = False
        for module in model.modules():
            kind = _tp_style(module)
            if kind is None:
                continue
            found = True
            if kind == "unknown":
                self._measured -= {"all_reduce", "all_gather"}
                self._reasons.append(f"tensor parallelism of a {type(module).__name__}: unknown")
                continue
            weight = module._parameters["weight"]
            timed = self._timing_of(weight.device_mesh.get_group("tp")) == "hook"
            if kind == "rowwise":
                hook = _rowwise_hook(self._tally, timed)
            else:
                full_width = weight.shape[0 if isinstance(module, nn.Linear) else 1]
                hook = _colwise_hook(self._tally, timed, full_width)
            self._tp_hooks.append((module, hook))
        return found

    def _install_ddp(self, ddp: nn.Module) -> bool:
        """DDP: a comm hook that counts each gradient bucket's all-reduce and, while armed,
        adds the bucket's still-local gradients into local_grad_sumsq before delegating to
        DDP's default all-reduce. DDP takes one comm hook: if the user set theirs, ours
        stands aside."""
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        group = ddp.process_group
        timing, tally = self._timing_of(group), self._tally

        # No annotations: DDP checks them against its own types, which postponed
        # annotations (strings) would fail.
        def hook(_state, bucket):
            grads = bucket.buffer()
            if not self.armed:
                return allreduce_hook(group, bucket)
            self._add_local_sumsq(grads, 1.0)
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
            self._reasons.append(f"DDP: our comm hook could not be registered ({e})")
            return False
        self.covers_grads = True
        return True

    # ------------------------------------------------------------------ hot path (no sync)

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
