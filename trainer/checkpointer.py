"""When to checkpoint, and saving without holding training up: DCP async_save.

A save is due every `every_steps` steps, or every `every_min` minutes of training. Ranks must
agree on the step of a collective save, and their clocks do not: the minutes are turned into
a number of steps by rank 0 (from its measured step time) and broadcast, once after the
first few steps and again after each save, both places where the ranks wait anyway.

Asynchronous saves (`async_save=True`): each rank copies its shards to host memory (the
*stall*: the only time the training step waits) and a background thread writes them with
DCP on a gloo group of its own (the training's collectives must not interleave with the
save's). The checkpoint is complete when rank 0's write finishes, rank 0 being DCP's
coordinator that writes the metadata last; only then does rank 0 write trainer.json and
move `latest` (checkpoint.finish), so a reader never sees an incomplete checkpoint there.

Events (rank 0): `checkpoint_stall` at the save's step (`stall_s`: time the step waited),
and `checkpoint` once complete (`save_s`: from the save's start to complete; `stall_s`;
`async`), so the supervisor knows which checkpoints exist and which step each holds, and
goodput charges the stall only.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

from . import checkpoint

ESTIMATE_AFTER_STEPS = 5  # steps timed before the first minutes -> steps estimate


class Checkpointer:
    """Saves the model, optimizer and scheduler on schedule; one per rank."""

    def __init__(
        self,
        root: Path | None,
        rank: int,
        config: dict,
        monitor,
        every_steps: int = 0,
        every_min: float = 0.0,
        async_save: bool = False,
        first_step: int = 0,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.root, self.rank, self.config, self.monitor = root, rank, config, monitor
        self.every_steps, self.every_min, self.async_save = every_steps, every_min, async_save
        self.clock = clock
        self._pending: tuple[Future, int, str, dict, float, float] | None = None
        self._next_timed_step = first_step + ESTIMATE_AFTER_STEPS if every_min else None
        self._estimated = False  # the first timed step only measures the step time
        # (step, time) the step time is measured from: the end of the step before the first
        self._since = (first_step - 1, clock())
        # DCP's async writer runs collectives on its own thread: a group of its own.
        self._group = (
            dist.new_group(backend="gloo") if async_save and dist.is_initialized() else None
        )
        # The schedule's broadcast: a CPU tensor (gloo), not on the async writer's group.
        self._schedule_group = (
            dist.new_group(backend="gloo") if every_min and dist.is_initialized() else None
        )

    def after_step(self, step: int, run_id: str, model, optimizer, scheduler) -> None:
        """Call after every optimizer step: finish a completed async save, start a due one."""
        self.poll()
        timed = self._next_timed_step is not None and step >= self._next_timed_step
        if timed and not self._estimated:
            self._estimated = True
            self._estimate(step)  # the first estimate: no save yet
            return
        if (self.every_steps and (step + 1) % self.every_steps == 0) or timed:
            self.save(step, run_id, model, optimizer, scheduler)
            if self.every_min:
                self._estimate(step)

    def _estimate(self, step: int) -> None:
        """Rank 0 turns every_min into steps from its step time since the last estimate;
        every rank takes its number (a broadcast: a sync point, at a save or once)."""
        first, start_s = self._since
        per_step_s = (self.clock() - start_s) / max(1, step - first)
        steps = max(1, round(self.every_min * 60 / max(per_step_s, 1e-9)))
        if dist.is_initialized():
            n = torch.tensor([steps], dtype=torch.int64)
            dist.broadcast(n, src=0, group=self._schedule_group)  # sync point: ranks agree
            steps = int(n.item())
        self._next_timed_step = step + steps
        self._since = (step, self.clock())

    def save(self, step: int, run_id: str, model, optimizer, scheduler) -> None:
        # Declared to the monitor: a synchronous save of a large model takes minutes, which
        # the collector's watchdog would otherwise take for a hang of the whole job.
        with self.monitor.pause("checkpoint"):
            self._save(step, run_id, model, optimizer, scheduler)

    def _save(self, step: int, run_id: str, model, optimizer, scheduler) -> None:
        start_s = self.clock()
        if not self.async_save:
            saved_s = checkpoint.save(
                self.root, step, run_id, model, optimizer, scheduler, self.rank, self.config
            )
            if self.rank == 0:
                self.monitor.event("checkpoint", step, detail={"duration_s": saved_s})
            return
        self.wait()  # one save in flight at a time: the previous one finishes first
        model_sd, optim_sd = get_state_dict(model, optimizer)
        future = dcp.async_save(
            {"model": model_sd, "optim": optim_sd},
            checkpoint_id=checkpoint.path_of(self.root, step),
            process_group=self._group,
        )  # returns once this rank's shards are copied to host memory
        stall_s = self.clock() - start_s
        meta = {"step": step, "run_id": run_id, "scheduler": scheduler.state_dict()}
        self._pending = (future, step, run_id, meta, start_s, stall_s)
        if self.rank == 0:
            self.monitor.event("checkpoint_stall", step, detail={"stall_s": stall_s})

    def poll(self) -> None:
        """Finish the async save in flight if it is done (never blocks)."""
        if self._pending is not None and self._pending[0].done():
            self._finish()

    def wait(self) -> None:
        """Block until the async save in flight, if any, is complete."""
        if self._pending is not None:
            with self.monitor.pause("checkpoint"):
                self._pending[0].result()
            self._finish()

    def _finish(self) -> None:
        future, step, _run_id, meta, start_s, stall_s = self._pending
        self._pending = None
        future.result()  # raises what the writer raised
        if self.rank == 0:
            checkpoint.finish(self.root, step, {**meta, "config": self.config})
            detail = {"stall_s": stall_s, "save_s": self.clock() - start_s, "async": True}
            self.monitor.event("checkpoint", step, detail=detail)
