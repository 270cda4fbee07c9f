"""What the comms meter (comms.py) shares with its per-parallelism parts (comms_fsdp.py,
comms_tp.py, comms_ddp.py): the per-kind tally, the timing sources (NCCL's completion hook,
the host's own clock on gloo) and the wrapper that counts one collective as it is issued.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

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
