"""The monitor: the whole footprint of trainvitals in a training script.

    monitor = attach(model, mesh, collector_url="http://127.0.0.1:8000")
    for step in range(steps):
        loss = loss_fn(model(x), y); loss.backward()
        monitor.step(loss=loss, tokens=x.numel(), lr=sched.get_last_lr()[0])
        clip_grad_norm_(...); opt.step(); opt.zero_grad()
    monitor.close()

Call `step` after `backward` and before clipping and `zero_grad`: it reads the gradients as
backward left them, so per-layer and global gradient norms are the unclipped ones.

The hot path never waits for the device or the network. The monitor wires stages, as
OpenTelemetry's SDK separates them:

- meters read one kind of statistic each: block outputs (activations.py), collectives
  (comms.py), step timing (timing.py), the optimizer's update (update.py), power
  (power.py), the SDC canary and replica fingerprints (canary.py, replica.py), all driven
  through one protocol (meter.py: start_step, end_step, collect, close);
- on a logged step the step reducer (reducer.py) packs them into one device vector
  (records.VectorLayout, its size independent of the world size), starts one SUM
  all-reduce and a small MAX one on a process group of the monitor's own, and the gather of
  this rank's slot (timing, power, fingerprints) to its node's leader (topology.py);
- the export reader (reader.py) waits for them on its own thread, builds the columns
  (rank 0 the steps and layers rows, each node's leader its node's ranks rows) and hands
  batches to an exporter (exporter.py, otlp.py) every export interval.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from trainvitals.schema import PAUSES

from .activations import ActivationMeter
from .canary import Canary
from .comms import CommsMeter
from .config import MonitorConfig
from .exporter import Exporter, HttpExporter, NullExporter
from .flops import TP_NOT_COUNTED, StepFlops, counted_source, estimate_source
from .heartbeat import HeartbeatSender, Liveness, NullHeartbeat, PhaseHooks
from .layers import check_attachable, find_layers, local, plain_activation_weight
from .meter import Meter
from .power import PowerSampler
from .reader import ExportReader
from .records import StepMeta, VectorLayout
from .reducer import StepReducer
from .replica import ReplicaFingerprint
from .runmeta import run_metadata
from .spool import default_spool_dir
from .stopped import StoppedClock
from .timing import StepTimer
from .tokens import TokenCheck
from .update import UpdateMeter

log = logging.getLogger(__name__)

# A rank that ends without close() (an exception, torchrun's SIGTERM after a peer crashed)
# exports what is queued for at most this long: the steps it trained before the peer
# crashed reach the store. Well inside torchrun's 30 s between SIGTERM and SIGKILL.
EXIT_FLUSH_S = 5.0


def attach(
    model: nn.Module,
    mesh: DeviceMesh | None = None,
    *,
    collector_url: str | None = None,
    exporter: Exporter | None = None,
    **config: Any,
) -> Monitor:
    """Start monitoring `model` (sharded over `mesh`, or None for a single process).

    Telemetry goes to `exporter`, else to the collector at `collector_url`, else nowhere.
    Keyword arguments are MonitorConfig fields. Collective: every rank must call it.
    """
    ddp = None
    while True:  # DDP(compile(m)) and compile(DDP(m)) alike: the layers are m's
        if isinstance(model, DistributedDataParallel):
            ddp, model = model, model.module
        elif hasattr(model, "_orig_mod"):  # what torch.compile wraps a model in
            model = model._orig_mod
        else:
            break
    if exporter is None and collector_url:
        rank = dist.get_rank() if dist.is_initialized() else 0
        exporter = HttpExporter(collector_url, spool_dir=default_spool_dir(rank))
    exporter = exporter or NullExporter()
    if collector_url:
        config.setdefault("heartbeat_url", collector_url)
    return Monitor(model, mesh, exporter, MonitorConfig(**config), ddp=ddp)


class Monitor:
    """Meters, step reducer and export reader of one rank, wired (module docstring).

    >>> from torch import nn
    >>> from trainvitals.hooks import InMemoryExporter
    >>> model, out = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)), InMemoryExporter()
    >>> monitor = attach(model, exporter=out, log_every=1, peak_flops_per_s=1e12)
    >>> model(torch.ones(2, 4)).sum().backward()
    >>> monitor.step(loss=torch.tensor(1.0), tokens=2)
    >>> monitor.close()
    >>> len(out.rows("steps")), len(out.rows("layers")), len(out.rows("ranks"))
    (1, 2, 1)
    """

    def __init__(
        self,
        model: nn.Module,
        mesh: DeviceMesh | None,
        exporter: Exporter,
        cfg: MonitorConfig,
        ddp: DistributedDataParallel | None = None,
    ) -> None:
        self.cfg = cfg
        self.exporter = exporter
        self.mesh = mesh
        # Without a mesh under torch.distributed (plain DDP): data parallel over every rank,
        # plain parameters replicated on each, activations each rank's own.
        self.distributed = dist.is_initialized() and dist.get_world_size() > 1
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        # A group of our own: our all-reduce never queues behind (or blocks) FSDP's.
        self._group = dist.new_group() if self.distributed else None

        self.params = list(model.parameters())
        if not self.params:
            raise ValueError("attach: the model has no parameters to monitor")
        check_attachable(model)
        self._model = model
        model._trainvitals_attached = True
        self.layers = find_layers(model)
        self.device = local(self.params[0]).device
        layer_numel = [0] * len(self.layers.names)
        for p, layer in zip(self.params, self.layers.param_layer, strict=True):
            layer_numel[layer] += p.numel()  # a DTensor's numel is its global size
        self.layout = VectorLayout(len(self.layers.names), tuple(layer_numel))
        # The meters: each reads one kind of statistic; the reducer packs them on a logged step.
        # All driven through the Meter protocol (meter.py), in this order.
        every, first = cfg.canary_every, cfg.first_step  # the SDC checks' schedule
        cuda = self.device.type == "cuda"
        self.power = PowerSampler(
            self.device, int(os.environ.get("LOCAL_RANK", "0")), cfg.power_interval_s or None
        )
        # CPU ranks' compute time is CPU time, blind to a stopped process; CUDA event time
        # is not (the device idles while the host is stopped).
        stops = None if cuda or not cfg.stopped_interval_s else StoppedClock(cfg.stopped_interval_s)
        self.timer = StepTimer(model, self.device, stopped=stops)
        self.update = UpdateMeter(self.params)  # the optimizer step before a logged step
        self.comms = CommsMeter(
            model, mesh, self.device, time_collectives=cfg.time_collectives, ddp=ddp
        )
        plain_weight = plain_activation_weight(mesh, cfg.activation_replicated_dims)
        self.activations = ActivationMeter(model, self.layers, self.device, plain_weight)
        dtype = getattr(torch, cfg.canary_dtype or ("bfloat16" if cuda else "float32"))
        self.canary = Canary(self.device, dtype, every=every, first_step=first)
        self.replica = ReplicaFingerprint(
            self.params, mesh, self.world_size, every=every, first_step=first
        )
        self.meters: list[Meter] = [
            self.power, self.timer, self.update, self.comms, self.activations, self.canary,
            self.replica,
        ]  # fmt: skip
        self._last_logged = cfg.first_step - 1
        self.step_count = cfg.first_step
        self._active = self._logged(cfg.first_step)  # is this step a logged one?
        for meter in self.meters:
            meter.start_step(self._active)

        run_meta, self.node = run_metadata(self, model)  # collective; finds this rank's node
        self.run_id = run_meta.pop("run_id")
        self.flops_per_token = run_meta["flops_per_token"]
        self.peak_flops_per_s = run_meta["peak_flops_per_s"]
        # Without flops_per_token, rank 0 (whose steps rows carry MFU) counts its first
        # step's FLOPs (flops.StepFlops); the runs row waits for the count: a stored runs
        # row is never replaced.
        counting = self.rank == 0 and cfg.flops_per_token is None
        if counting and run_meta["tp"] > 1:
            counting = False
            run_meta["flops_source"] = estimate_source(TP_NOT_COUNTED)
        self._flops = StepFlops(model) if counting else None
        self._runs_row = run_meta if self.rank == 0 else None
        self.reducer = StepReducer(
            self.params, self.layers, self.layout, self.device, world_size=self.world_size,
            group=self._group, node=self.node, plain_weight=plain_weight,
        )  # fmt: skip
        self.reader = ExportReader(
            exporter, self.run_id, rank=self.rank, node=self.node, layout=self.layout,
            world_size=self.world_size, interval_s=cfg.export_interval_s,
            queue_size=cfg.queue_size, runs_row=None if counting else self._runs_row,
        )  # fmt: skip
        # `tokens` must be this rank's: checked against the token ids its forwards received.
        self.tokens_check = TokenCheck(
            model, lambda detail: self.event("tokens_suspect", self.step_count, self.rank, detail)
        )
        self.liveness = Liveness(cfg.first_step)  # what this rank's heartbeats say
        self._phases = PhaseHooks(model, self.liveness)
        self.comms.liveness = self.liveness
        self.heartbeat = (
            HeartbeatSender(
                cfg.heartbeat_url,
                self.run_id,
                self.rank,
                self.liveness,
                cfg.heartbeat_interval_s,
                last_words=lambda: self.reader.flush(EXIT_FLUSH_S),
            )
            if cfg.heartbeat_url
            else NullHeartbeat()
        )
        # The first step's data time and step time start at the same instant: step 0's data
        # time once included attach's collectives and exceeded its step time.
        self._last_step_end = self.timer.restart()
        self._closed = False

    # ------------------------------------------------------------------ hot path (no sync)

    def step(self, loss: torch.Tensor | float, tokens: int, lr: float | None = None) -> None:
        """Mark the end of a training step. Never waits for the device or the network.

        loss: this rank's loss tensor (on the device; not read here), or a number; a tensor
        of per-sample losses counts as its mean. tokens: tokens this rank processed in the
        step, not the global batch's (checked: tokens.py). lr: the learning rate the step
        used, if known (a number of any kind).
        """
        now, arrival_unix_s = time.perf_counter(), time.time()
        step_time_s, self._last_step_end = now - self._last_step_end, now
        if self._flops is not None:  # the first step only
            self._end_flop_count(tokens)
        self.liveness.finished(self.step_count)
        loss = self._loss_scalar(loss)
        if lr is not None:
            lr = float(lr)  # numpy and tensor lrs too; sync point only for an lr on the GPU
        for meter in self.meters:
            meter.end_step(loss)
        self.tokens_check.step(tokens, self.step_count)
        if self._active:
            timing = {"step_time_s": step_time_s, "arrival_unix_s": arrival_unix_s}
            self._launch(loss, tokens, lr, timing)
        self.step_count += 1
        self._active = self._logged(self.step_count)
        for meter in self.meters:
            meter.start_step(self._active)

    def _end_flop_count(self, tokens: int) -> None:
        """End the first step's FLOP count: its FLOPs per token replace the estimate from
        this step on, and the runs row, held back for it, goes out. No device sync."""
        assert self._flops is not None and self._runs_row is not None
        flops, why_not = self._flops.finish(), self._flops.error
        self._flops = None
        if flops and tokens > 0:
            self.flops_per_token = flops / tokens  # data parallel: the whole model's
            source = counted_source(flops, tokens, self.step_count)
        else:
            why_not = why_not or f"{flops} FLOPs over {tokens} tokens"
            log.warning("trainvitals: MFU stays an estimate (6 N): FLOPs %s", why_not)
            source = estimate_source(why_not)
        row = {**self._runs_row, "flops_per_token": self.flops_per_token, "flops_source": source}
        self.reader.runs_row(row)

    def _logged(self, step: int) -> bool:
        """Every log_every-th step, and the run's last one when total_steps is known."""
        return step % self.cfg.log_every == 0 or step == (self.cfg.total_steps or 0) - 1

    def _loss_scalar(self, loss: torch.Tensor | float) -> torch.Tensor:
        """The step's loss as a 0-d device tensor, without reading it."""
        if not isinstance(loss, torch.Tensor):  # a number the user read already
            return self.reducer.upload([float(loss)], torch.float32)[0]
        loss = loss.detach()
        return loss.reshape(()) if loss.numel() == 1 else loss.float().mean()

    def _launch(
        self, loss: torch.Tensor, tokens: int, lr: float | None, timing: dict[str, float]
    ) -> None:
        """Collect the meters, hand everything to the reducer, the step in flight to the
        reader. Each value goes by name: the reducer's own inputs, else a slot field, on
        the device (a tensor: copied device to device) or the host."""
        steps, self._last_logged = self.step_count - self._last_logged, self.step_count
        values: dict[str, Any] = {**timing, "tokens": tokens}
        for meter in self.meters:
            values.update(meter.collect(self.step_count, steps))
        inputs = {k: values.pop(k, None) for k in _REDUCER_INPUTS}
        device_slot = {k: v for k, v in values.items() if isinstance(v, torch.Tensor)}
        host_slot = {k: v for k, v in values.items() if k not in device_slot}
        meta = StepMeta(self.step_count, lr, self.flops_per_token, self.peak_flops_per_s)
        pending = self.reducer.reduce(
            meta, loss, tokens, host_slot, device_slot, **inputs, dropped=self.telemetry_dropped
        )
        self.reader.put(pending)

    # ------------------------------------------------------------------ export, end

    @property
    def telemetry_dropped(self) -> int:
        """Logged steps dropped on a full queue, plus batches the exporter could not keep
        or raised on."""
        return self.reader.dropped

    def event(self, kind: str, step: int, rank: int = -1, detail: dict | None = None) -> None:
        """Record an event (an injected fault, a restart, a checkpoint). Never blocks."""
        self.reader.event(kind, step, rank, detail)

    @contextlib.contextmanager
    def pause(self, phase: str = "checkpoint") -> Iterator[None]:
        """Declare a pause between steps, on every rank that takes part in it (the save and
        its barriers): `with monitor.pause("checkpoint"): save(...)`, or "eval" around an
        evaluation under no_grad. Heartbeats say `phase` while it lasts, and the collector's
        watchdog allows it `liveness.pause_s` (30 min) before calling the job hung, not a
        step's hang threshold (10x a step, at least 30 s): a job saving for a minute is not
        hung. Rank 0 records a `pause:<phase>` event with its duration at its end, which
        the stall detector takes out of the gap between logged steps. Undeclared, such a
        pause looks like a stuck data loader. Never blocks."""
        _check_pause(phase)
        live = self.liveness
        before, live.phase = live.phase, phase
        started_s = time.perf_counter()
        try:
            yield
        finally:
            live.phase = before
            # The step-based stall detector takes its time out of gaps. A pause inside
            # another (the trainer's wait for an async save within its save) is the outer
            # one's time: one event, the outermost's.
            if self.rank == 0 and before not in PAUSES:
                detail = {"duration_s": time.perf_counter() - started_s}
                self.event(f"pause:{phase}", max(0, self.step_count - 1), detail=detail)

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Export every step and event queued so far, and wait (up to `timeout_s`) until the
        exporter has taken them: for a process about to end without `close()` (a crash, an
        injected one too). True if done in time. Blocks: not for the training step."""
        return self.reader.flush(timeout_s)

    def close(self, timeout_s: float = 30.0) -> None:
        """Flush what is pending and stop the background threads. Call on every rank; a
        second call does nothing."""
        if self._closed:
            return
        self._closed = True
        self.heartbeat.close("ended")  # first: a slow drain below must not look like a hang
        self._phases.close()
        self.tokens_check.close()
        for meter in self.meters:
            meter.close()
        self._model._trainvitals_attached = False
        if self._flops is not None:  # no step: nothing counted, the row goes as estimated
            self._flops.finish()
            self.reader.runs_row({**self._runs_row, "flops_source": estimate_source("no step")})
        if self.rank == 0:  # a clean end: alerting tells a finished run from a stalled one
            detail = {
                "telemetry_dropped": self.telemetry_dropped,
                # Steps after the last logged one: their maxima and non-finite counts never
                # left the device (total_steps makes the last step a logged one).
                "unlogged_tail_steps": self.step_count - 1 - self._last_logged,
            }
            self.event("run_end", self.step_count, detail=detail)
        self.reader.close(timeout_s)


class NullMonitor:
    """Monitoring off, behind the Monitor's interface: every call returns at once."""

    canary = None
    telemetry_dropped = 0

    def __init__(self, run_id: str = "") -> None:
        self.run_id = run_id or "unmonitored"

    def step(self, loss: torch.Tensor, tokens: int, lr: float | None = None) -> None:
        pass

    def event(self, kind: str, step: int, rank: int = -1, detail: dict | None = None) -> None:
        pass

    def pause(self, phase: str = "checkpoint") -> contextlib.AbstractContextManager[None]:
        _check_pause(phase)
        return contextlib.nullcontext()

    def flush(self, timeout_s: float = 10.0) -> bool:
        return True

    def close(self, timeout_s: float = 30.0) -> None:
        pass


def _check_pause(phase: str) -> None:
    if phase not in PAUSES:
        raise ValueError(f"pause phase must be one of {list(PAUSES)}, got {phase!r}")


# What meters collect for StepReducer.reduce's keyword inputs rather than the rank slot.
_REDUCER_INPUTS = ("maxima", "activations", "update", "local_grad_sumsq")
