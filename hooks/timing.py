"""Per-rank data-loading and compute time, measured without waiting for the device.

Two boundaries mark each step on the host:
- the end of the optimizer step (a global optimizer post-hook; the monitor's `step()` call
  stands in when no torch optimizer runs), and
- the model's first forward after it (a forward pre-hook on the root module).

`data_time_s` is the host time between the two: where a training loop fetches its next
batch (plus zero_grad and scheduler bookkeeping, which take microseconds). With gradient
accumulation only the first micro-batch's wait counts.

`compute_time_s`:
- CPU: the training thread's CPU time between `step()` calls. Time blocked in a gloo
  collective waiting for slower ranks is not CPU time, so a rank that merely waits for a
  straggler does not look slow.
- CUDA: GPU time from the first forward to the end of the optimizer step, from CUDA events
  on the current stream. An event is read only once the device has passed it
  (`Event.query()` does not block), so the value a logged step reports is that of the most
  recent step the device had finished, usually the previous one.
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from .layers import OptimizerParams


def recorded_event() -> torch.cuda.Event:
    e = torch.cuda.Event(enable_timing=True)
    e.record()  # enqueued on the current stream; the host goes on at once
    return e


class StepTimer:
    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._owned = OptimizerParams(list(model.parameters()))
        self._boundary_s = time.perf_counter()
        self._cpu_s = time.thread_time()
        self._forward_seen = False
        self._data_time_s = math.nan
        self._last = (math.nan, math.nan)  # step() at the last end_step (meter protocol)
        self._span: list[torch.cuda.Event] = []  # [start] or [start, end] of the running step
        self._done: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = deque(maxlen=8)
        self._handles = [
            model.register_forward_pre_hook(self._forward_start),
            register_optimizer_step_post_hook(self._optimizer_end),
        ]

    def restart(self) -> float:
        """Count the coming step's data time from now (the end of `attach`: the node
        discovery and group creation after this timer was made are no data time); returns
        the time, for the step time to start from the same instant."""
        self._boundary_s = time.perf_counter()
        return self._boundary_s

    def _forward_start(self, _module: nn.Module, _args: Any) -> None:
        if self._forward_seen:
            return
        self._forward_seen = True
        self._data_time_s = time.perf_counter() - self._boundary_s
        if self.cuda:
            if len(self._span) == 2:
                self._done.append((self._span[0], self._span[1]))
            self._span = [recorded_event()]

    def _optimizer_end(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        if not self._owned.positions(optimizer):
            return  # the hook is global: another model's optimizer
        self._boundary_s = time.perf_counter()
        if self.cuda and self._span:
            self._span[1:] = [recorded_event()]

    def step(self) -> tuple[float, float]:
        """At the monitor's step boundary: (data_time_s, compute_time_s) of this rank."""
        cpu_s = time.thread_time()
        compute_s = cpu_s - self._cpu_s if not self.cuda else self._finished_gpu_time_s()
        self._cpu_s = cpu_s
        data_s, self._data_time_s = self._data_time_s, math.nan
        self._forward_seen = False
        self._boundary_s = time.perf_counter()  # the optimizer's end moves it later, if one runs
        if self.cuda and self._span:
            self._span[1:] = [recorded_event()]
        return data_s, compute_s

    def start_step(self, logged: bool) -> None:
        pass

    def end_step(self, loss: torch.Tensor) -> None:
        """The meter protocol: step() at every boundary, kept for a logged step's collect."""
        self._last = self.step()

    def collect(self, step: int, steps: int) -> dict[str, Any]:
        data_time_s, compute_time_s = self._last
        return {"data_time_s": data_time_s, "compute_time_s": compute_time_s}

    def _finished_gpu_time_s(self) -> float:
        for start, end in reversed(self._done):
            if end.query():  # non-blocking: has the device passed this event yet?
                return start.elapsed_time(end) / 1e3  # ms -> s
        return math.nan

    def close(self) -> None:
        for h in self._handles:
            h.remove()
