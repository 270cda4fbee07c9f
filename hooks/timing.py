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
  `stopped_time_s` is the time the process was stopped in the same span (stopped.py): a
  stopped thread uses no CPU time, so a rank stopped from outside would not look slow.
- CUDA: GPU time from the first forward to the end of the optimizer step, from CUDA events
  on the current stream. An event is read only once the device has passed it
  (`Event.query()` does not block), so a logged step reports steps the device had
  finished, usually up to the previous one.

A logged step reports the mean of both over the steps since the previous logged step (on
CUDA, over the steps the device finished since then, at most the last 8): at log_every=10
one step's noise would otherwise stand for ten, and the straggler detector's evidence
would be as noisy as a single step's. `stopped_time_s` is NaN on CUDA ranks, whose event
time already spans a stop of the host (the device idles until the host launches more).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from .layers import OptimizerParams
from .stopped import StoppedClock


class Mean:
    """A running mean of finite seconds, taken and started over at each logged step."""

    def __init__(self) -> None:
        self.total_s, self.n = 0.0, 0

    def add(self, seconds: float) -> None:
        if math.isfinite(seconds):  # NaN: a step without a forward
            self.total_s, self.n = self.total_s + seconds, self.n + 1

    def take(self) -> float:
        mean_s = self.total_s / self.n if self.n else math.nan
        self.total_s, self.n = 0.0, 0
        return mean_s


def recorded_event() -> torch.cuda.Event:
    e = torch.cuda.Event(enable_timing=True)
    e.record()  # enqueued on the current stream; the host goes on at once
    return e


class StepTimer:
    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        wall_clock: Callable[[], float] = time.perf_counter,
        cpu_clock: Callable[[], float] = time.thread_time,
        stopped: StoppedClock | None = None,
    ) -> None:
        self.cuda = device.type == "cuda"
        self._wall, self._cpu = wall_clock, cpu_clock  # injectable, for tests
        self.stopped = stopped  # None: not measured (CUDA ranks, or turned off)
        self._stopped_s = self._stopped_now()
        self._owned = OptimizerParams(list(model.parameters()))
        self._boundary_s = self._wall()
        self._cpu_s = self._cpu()
        self._forward_seen = False
        self._data_time_s = math.nan
        # Since the last logged step (meter protocol): data time, CPU compute time.
        self._data, self._compute, self._stops = Mean(), Mean(), Mean()
        self._span: list[torch.cuda.Event] = []  # [start] or [start, end] of the running step
        self._done: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = deque(maxlen=8)
        self._last_gpu_s = math.nan  # the last finished step's, for a report with none new
        self._handles = [
            # The data time ends first among the root's pre-forward hooks: FSDP's runs the
            # root's all-gather and waits in it for the slowest rank, which is no data
            # time (counted, a rank's data-parallel peers showed its slow data loading as
            # their own). The CUDA span starts after it, as before: on the device that
            # wait is for the others, not this rank's work.
            model.register_forward_pre_hook(self._data_end, prepend=True),
            model.register_forward_pre_hook(self._forward_start),
            register_optimizer_step_post_hook(self._optimizer_end),
        ]

    def restart(self) -> float:
        """Count the coming step's data time from now (the end of `attach`: the node
        discovery and group creation after this timer was made are no data time); returns
        the time, for the step time to start from the same instant."""
        self._boundary_s = self._wall()
        return self._boundary_s

    def _data_end(self, _module: nn.Module, _args: Any) -> None:
        if math.isnan(self._data_time_s):  # the step's first forward (gradient accumulation)
            self._data_time_s = self._wall() - self._boundary_s

    def _forward_start(self, _module: nn.Module, _args: Any) -> None:
        if self._forward_seen:
            return
        self._forward_seen = True
        if self.cuda:
            if len(self._span) == 2:
                self._done.append((self._span[0], self._span[1]))
            self._span = [recorded_event()]

    def _optimizer_end(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        if not self._owned.positions(optimizer):
            return  # the hook is global: another model's optimizer
        self._boundary_s = self._wall()
        if self.cuda and self._span:
            self._span[1:] = [recorded_event()]

    def step(self) -> None:
        """At the monitor's step boundary: add this step's data time and (on CPU) compute
        time to the means of the steps since the last logged one."""
        cpu_s, stopped_s = self._cpu(), self._stopped_now()
        self._data.add(self._data_time_s)
        if not self.cuda:
            self._compute.add(cpu_s - self._cpu_s)
        self._stops.add(stopped_s - self._stopped_s)  # NaN without a clock: not added
        self._cpu_s, self._stopped_s = cpu_s, stopped_s
        self._data_time_s = math.nan
        self._forward_seen = False
        self._boundary_s = self._wall()  # the optimizer's end moves it later, if one runs
        if self.cuda and self._span:
            self._span[1:] = [recorded_event()]

    def start_step(self, logged: bool) -> None:
        pass

    def end_step(self, loss: torch.Tensor) -> None:
        """The meter protocol: step() at every boundary."""
        self.step()

    def collect(self, step: int, steps: int) -> dict[str, Any]:
        """Means over the steps since the last logged step; the means start over."""
        data_s, compute_s, stopped_s = self._data.take(), self._compute.take(), self._stops.take()
        if self.cuda:
            compute_s = self._finished_gpu_time_s()
        return {"data_time_s": data_s, "compute_time_s": compute_s, "stopped_time_s": stopped_s}

    def _stopped_now(self) -> float:
        """The stopped clock's total (a plain float: no lock, no I/O); NaN without one."""
        return self.stopped.stopped_s if self.stopped is not None else math.nan

    def _finished_gpu_time_s(self) -> float:
        """Mean GPU time of the steps the device finished since the last report (the same
        stream finishes them in order); with none, the last finished step's again."""
        total_ms, n = 0.0, 0
        while self._done and self._done[0][1].query():  # non-blocking: passed it yet?
            start, end = self._done.popleft()
            total_ms, n = total_ms + start.elapsed_time(end), n + 1
        if n:
            self._last_gpu_s = total_ms / n / 1e3  # ms -> s
        return self._last_gpu_s

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        if self.stopped is not None:
            self.stopped.close()
