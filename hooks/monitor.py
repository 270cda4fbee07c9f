"""The monitor: the whole footprint of trainvitals in a training script.

    monitor = attach(model, mesh, collector_url="http://127.0.0.1:8000")
    for step in range(steps):
        loss = loss_fn(model(x), y); loss.backward()
        monitor.step(loss=loss, tokens=x.numel(), lr=sched.get_last_lr()[0])
        clip_grad_norm_(...); opt.step(); opt.zero_grad()
    monitor.close()

Call `step` after `backward` and before clipping and `zero_grad`: it reads the gradients as
backward left them, so per-layer and global gradient norms are the unclipped ones.

The hot path never waits for the device or the network. An unlogged step reads each
block output once (its extremes, left on the device). On a logged step the statistics are
packed into one device vector (records.VectorLayout, its size independent of the world
size), reduced with one asynchronous SUM all-reduce (and a small MAX one for the maxima) on
a process group of the monitor's own, while each rank's own slot (timing, power,
fingerprints) is gathered by its node's leader over the node's group (topology.py). All of
it is copied to pinned host memory without blocking and handed to a background thread that
waits for it, builds the columns and exports them: rank 0 the steps and layers rows, every
node's leader its node's ranks rows.
"""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from trainvitals.schema import check_run_id

from .canary import Canary
from .comms import CommsMeter
from .exporter import Exporter, HttpExporter, NullExporter
from .flops import peak_flops
from .heartbeat import HeartbeatSender, Liveness, NullHeartbeat, PhaseHooks
from .layers import (
    arrived,
    dense_values,
    find_layers,
    first_float_tensor,
    local,
    plain_activation_weight,
    replication_weight,
)
from .norms import fused_norms, max_abs, norm_dtype
from .power import PowerSampler
from .records import (
    RANK_SLOT,
    SAMPLED_FIELDS,
    StepMeta,
    VectorLayout,
    add_ranks,
    add_step,
    release_unix_s,
)
from .replica import ReplicaFingerprint
from .spool import default_spool_dir
from .timing import StepTimer
from .topology import Node, find_node, node_key
from .update import UpdateMeter
from .wire import ColumnBatch

log = logging.getLogger(__name__)

# Slots filled on the device (the others come from the host in one copy), and the two that
# the MAX reduction takes from the slot.
_LOSS, _CANARY, _REPLICA, _GRAD_LOCAL, _STEP_TIME, _ARRIVAL = (
    RANK_SLOT.index(name)
    for name in (
        "loss",
        "canary_fingerprint",
        "replica_fingerprint",
        "grad_sumsq_local",
        "step_time_s",
        "arrival_unix_s",
    )
)


@dataclass
class MonitorConfig:
    """Settings of a monitor. Every field has a default that suits a first run."""

    run_id: str = ""  # empty: a fresh id, agreed by all ranks
    # Steps between logged steps. A logged step costs several unlogged ones: per-layer norms
    # of every gradient, parameter and output, the parameter copy behind update RMS, and
    # two all-reduces (bench/hook_overhead.py measures both intervals).
    log_every: int = 10
    export_interval_s: float = 1.0  # each exporting rank sends a batch at most this often
    queue_size: int = 1024  # logged steps waiting for export; more are counted and dropped
    flops_per_token: float | None = None  # None: 6 x non-embedding params (no attention term)
    peak_flops_per_s: float | None = None  # None: from the device table or measured on CPU
    peak_precision: str = "bf16"  # which column of the peak table: "bf16" or "fp8"
    token_target: int | None = None  # tokens the run means to train on (for time-to-target)
    model_name: str = ""
    model_config: dict[str, Any] = field(default_factory=dict)
    # Mesh dims along which a block's plain-tensor output is identical (see layers.py).
    activation_replicated_dims: tuple[str, ...] = ("tp",)
    # Steps between SDC canary fingerprints, taken on the first logged step at or after
    # each multiple of it (every rank alike); 0: off.
    canary_every: int = 50
    canary_dtype: str = ""  # "": bfloat16 on CUDA, float32 elsewhere (the usual training dtype)
    power_interval_s: float = 0.1  # power sampling period; 0: no power sampling
    first_step: int = 0  # a resumed run counts on from where its checkpoint left off
    # Steps the run trains for, counted from 0 like first_step (None: not known). Its last
    # step is then logged whatever the interval, so that the maxima and non-finite counts of
    # the steps after the last interval reach the collector too.
    total_steps: int | None = None
    # Time NCCL collectives with CUDA events (one pair per collective; docs/interconnect.md).
    # None: only if TORCH_NCCL_ENABLE_TIMING=1 is set.
    time_collectives: bool | None = None
    # Collector that receives this rank's heartbeats (every rank sends its own; "": none,
    # unless attach() was given a collector_url), and how often, in seconds (hooks/heartbeat.py).
    heartbeat_url: str = ""
    heartbeat_interval_s: float = 2.0

    def __post_init__(self) -> None:
        if self.run_id:  # refused now: the collector would refuse every batch of the run
            check_run_id(self.run_id)
        if self.log_every < 1:
            raise ValueError(f"MonitorConfig.log_every must be >= 1, got {self.log_every}")
        if self.export_interval_s <= 0:
            raise ValueError("MonitorConfig.export_interval_s must be > 0")
        if self.queue_size < 1:
            raise ValueError("MonitorConfig.queue_size must be >= 1")
        if self.flops_per_token is not None and self.flops_per_token <= 0:
            raise ValueError("MonitorConfig.flops_per_token must be > 0")
        if self.peak_precision not in ("bf16", "fp8"):
            raise ValueError(
                f"MonitorConfig.peak_precision must be bf16 or fp8, got {self.peak_precision!r}"
            )
        if self.first_step < 0:
            raise ValueError(f"MonitorConfig.first_step must be >= 0, got {self.first_step}")
        if self.total_steps is not None and self.total_steps < 1:
            raise ValueError(f"MonitorConfig.total_steps must be >= 1, got {self.total_steps}")
        if self.canary_every < 0 or self.power_interval_s < 0:
            raise ValueError("MonitorConfig.canary_every and power_interval_s must be >= 0")
        if not (math.isfinite(self.heartbeat_interval_s) and self.heartbeat_interval_s > 0):
            raise ValueError(
                f"MonitorConfig.heartbeat_interval_s must be > 0, got {self.heartbeat_interval_s}"
            )
        if self.canary_dtype not in ("", "float32", "bfloat16", "float16"):
            raise ValueError(f"MonitorConfig.canary_dtype: unknown dtype {self.canary_dtype!r}")


@dataclass
class _Event:
    row: dict[str, Any]


@dataclass
class _Flush:
    """Export what is queued before this at once, then set `done`."""

    done: threading.Event


@dataclass
class _Pending:
    """A logged step in flight: once `wait()` returns, `parts` (the SUM vector then the MAX
    vector, or on CUDA both in one pinned host tensor) hold the reduced values."""

    meta: StepMeta
    parts: tuple[torch.Tensor, ...]
    wait: Callable[[], Any]


_STOP = object()

# Steps whose extrema may wait for a fold: bounds the small device tensors held between
# logged steps when the interval is long.
FOLD_STEPS = 64
# A block output waiting to be read: (layer, local shard, replication weight on a logged
# step, the shard's version counter when the layer returned it).
BlockOutput = tuple[int, torch.Tensor, float, int]


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
        _check_attachable(model)
        self._model = model
        model._trainvitals_attached = True
        self.layers = find_layers(model)
        self.device = local(self.params[0]).device
        layer_numel = [0] * len(self.layers.names)
        for p, layer in zip(self.params, self.layers.param_layer, strict=True):
            layer_numel[layer] += p.numel()  # a DTensor's numel is its global size
        self.layout = VectorLayout(len(self.layers.names), tuple(layer_numel))
        self._param_weight = [replication_weight(p, self.world_size) for p in self.params]
        self._plain_weight = plain_activation_weight(mesh, cfg.activation_replicated_dims)
        self._constants: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # _layer_sums
        self.update = UpdateMeter(self.params)  # the optimizer step before a logged step
        # Block outputs of a logged step: (layer, weight, elements, L2 norm, non-finite count)
        self._act_logged: list[tuple[int, float, int, torch.Tensor, torch.Tensor]] = []
        self.replica = ReplicaFingerprint(self.params, mesh, self.world_size)
        self.timer = StepTimer(model, self.device)
        self.comms = CommsMeter(
            model, mesh, self.device, time_collectives=cfg.time_collectives, ddp=ddp
        )
        self._last_logged = cfg.first_step - 1
        every = cfg.canary_every or 1
        self._next_canary_step = -(-cfg.first_step // every) * every  # a multiple, not before

        self.step_count = cfg.first_step
        self.dropped_steps = 0
        self.failed_exports = 0  # batches an exporter raised on (one that cannot encode them)
        canary_dtype = cfg.canary_dtype or ("bfloat16" if self.device.type == "cuda" else "float32")
        self.canary = Canary(self.device, getattr(torch, canary_dtype))
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.power = PowerSampler(self.device, local_rank, cfg.power_interval_s or None)
        self._active = self._logged(cfg.first_step)  # is this step a logged one?
        self.comms.arm(self._active)
        self._reset_accumulators()
        # Block outputs of the running forward, read together when it returns (the version
        # counter tells an in-place change before the read).
        self._pending: list[BlockOutput] = []
        self._changed_warned = False
        self._forward_seen: set[int] = set()  # layers whose output this step's forward read
        # Block-output max-abs: this step's, by layer; then every step's since the last fold.
        self._step_max: dict[int, torch.Tensor] = {}
        self._maxima: list[torch.Tensor] = []
        self._zero = torch.zeros((), device=self.device)
        # Where block outputs are read on CUDA (_read_beside); elsewhere in program order.
        self._side = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._handles = [
            m.register_forward_hook(self._activation_hook(i))
            for i, m in enumerate(self.layers.modules)
        ]
        # After the layers' hooks: a layer that is the model itself is collected first.
        self._handles.append(model.register_forward_hook(self._read_outputs))

        run_meta = self._run_metadata(model)  # collective
        self.run_id = run_meta["run_id"]
        self.flops_per_token = run_meta["flops_per_token"]
        self.peak_flops_per_s = run_meta["peak_flops_per_s"]
        self._queue: queue.Queue = queue.Queue(maxsize=cfg.queue_size)
        self._thread = threading.Thread(
            target=self._export_loop, args=(run_meta,), name="trainvitals-export", daemon=True
        )
        self._thread.start()
        self.liveness = Liveness(cfg.first_step)  # what this rank's heartbeats say
        self._phases = PhaseHooks(model, self.liveness)
        self.comms.liveness = self.liveness
        self.heartbeat = (
            HeartbeatSender(
                cfg.heartbeat_url, self.run_id, self.rank, self.liveness, cfg.heartbeat_interval_s
            )
            if cfg.heartbeat_url
            else NullHeartbeat()
        )
        self._last_step_end = time.perf_counter()
        self._closed = False

    # ------------------------------------------------------------------ set-up (may sync)

    def _run_metadata(self, model: nn.Module) -> dict[str, Any]:
        n_params = sum(p.numel() for p in self.params)  # DTensor.numel() is the global size
        embed = sum(
            p.numel()
            for m in model.modules()
            if isinstance(m, nn.Embedding)
            for p in m.parameters()
        )
        fpt = self.cfg.flops_per_token or 6.0 * (n_params - embed)
        peak, source = (
            (0.0, "")
            if self.rank
            else peak_flops(self.device, self.cfg.peak_flops_per_s, self.cfg.peak_precision)
        )
        shared = {
            "run_id": self.cfg.run_id or uuid.uuid4().hex[:12],
            "host": socket.gethostname(),
            "node": node_key(),
        }
        gathered = [shared]
        if self.distributed:
            gathered = [None] * self.world_size
            dist.all_gather_object(
                gathered, shared, group=self._group
            )  # sync point: once, at attach
        self.node = (
            find_node([g["node"] for g in gathered], self.rank, self._group)
            if self.distributed
            else Node((0,), 0)
        )
        sizes = {}
        if self.mesh is not None:
            sizes = {n: self.mesh.size(i) for i, n in enumerate(self.mesh.mesh_dim_names or ())}
        device_name = (
            torch.cuda.get_device_name(self.device)
            if self.device.type == "cuda"
            else self.device.type
        )
        return {
            "run_id": gathered[0]["run_id"],  # rank 0's id, so every rank agrees
            "started_unix_s": time.time(),
            "model": self.cfg.model_name or type(model).__name__,
            "model_config_json": json.dumps(self.cfg.model_config),
            "n_params": n_params,
            "n_layers": len(self.layers.names),
            "layer_names_json": json.dumps(self.layers.names),
            "world_size": self.world_size,
            # Without a "dp" dimension (plain DDP, or other names) every rank not in
            # tensor parallelism is a data-parallel replica.
            "dp": sizes.get("dp", self.world_size // sizes.get("tp", 1)),
            "tp": sizes.get("tp", 1),
            "device_type": self.device.type,
            "device_name": device_name,
            "hosts_json": json.dumps([g["host"] for g in gathered]),
            "flops_per_token": float(fpt),
            "peak_flops_per_s": peak,
            "peak_flops_source": source,
            "power_source": self.power.source,
            "power_unavailable": self.power.unavailable,
            "token_target": self.cfg.token_target,
        }

    # ------------------------------------------------------------------ hot path (no sync)

    def _reset_accumulators(self) -> None:
        """What every step adds to between logged steps: maxima and non-finite steps."""
        n = len(self.layers.names)
        self._act_max = torch.zeros(n, dtype=torch.float64, device=self.device)
        self._act_bad_steps = torch.zeros(n, dtype=torch.float64, device=self.device)
        self._bad_steps = torch.zeros((), dtype=torch.float64, device=self.device)

    def _end_step(self, loss: torch.Tensor) -> None:
        """Line up this step's max-abs per layer and the loss behind those of the steps
        before it. Nothing runs on the device here: the rows are folded into the running
        maxima once per logged step (or every FOLD_STEPS steps)."""
        if self._pending:  # layers run outside the model's forward (or it was bypassed)
            self._read_outputs()
        zero = self._zero
        self._maxima.extend(self._step_max.get(i, zero) for i in range(len(self.layers.names)))
        self._maxima.append(loss)  # only its finiteness is read
        self._step_max = {}
        self._forward_seen.clear()
        if self._active or len(self._maxima) >= FOLD_STEPS * (len(self.layers.names) + 1):
            if self._side is not None:  # the side stream's reads before the fold uses them
                torch.cuda.current_stream(self.device).wait_stream(self._side)
            self._fold_maxima()

    def _fold_maxima(self) -> None:
        """Fold the lined-up steps into the running maxima and non-finite step counts. A
        non-finite value anywhere in an output makes its max-abs non-finite, so the steps
        that held one are counted from the maxima alone."""
        n = len(self.layers.names)
        rows = torch.stack(self._maxima).view(-1, n + 1)  # a row per step, the loss last
        self._maxima = []
        bad = rows.isfinite().logical_not_()
        self._act_max = torch.maximum(self._act_max, rows[:, :n].amax(0))  # NaN stays NaN
        self._act_bad_steps += bad[:, :n].sum(0)
        self._bad_steps += bad.any(1).sum()

    def _activation_hook(self, index: int) -> Callable:
        def hook(_module: nn.Module, _inputs: Any, output: Any) -> None:
            if not torch.is_grad_enabled():
                return  # validation or inference between training steps: not the step's
            out = first_float_tensor(output)
            if out is None:
                return  # no floating-point output (token ids, a router's indices)
            shard = arrived(out)  # read under no_grad: nothing for autograd to record
            if shard.numel() == 0:
                return
            weight = 0.0
            if self._active:
                weight = replication_weight(out) if isinstance(out, DTensor) else self._plain_weight
            if _graph_task_id() != -1:
                # Recomputed inside backward (activation checkpointing): read at once, as
                # holding it would keep it alive through the rest of the backward. Its sums
                # count only if the forward did not see the layer: a reentrant checkpoint
                # runs its forward without grad, unseen; a non-reentrant one ran it in full.
                recount = index not in self._forward_seen
                self._read_on_streams([(index, shard, weight, shard._version)], record=recount)
                return
            self._forward_seen.add(index)
            # Held until the forward returns, when autograd still holds these outputs for
            # the backward anyway: no memory is kept alive that would not be.
            self._pending.append((index, shard, weight, shard._version))

        return hook

    def _read_outputs(self, _module: Any = None, _inputs: Any = None, output: Any = None) -> None:
        """When the model's forward returns: read the block outputs it produced."""
        pending, self._pending = self._pending, []
        if pending:
            self._read_on_streams(pending, output)

    def _read_on_streams(self, pending: list[BlockOutput], output: Any = None, **kw: Any) -> None:
        """Read block outputs: in program order off CUDA; on CUDA beside the backward where
        split_by_stream allows (`output`: what the model returned, if it did), the rest on
        the training stream after the side stream's earlier reads, whose maxima these may
        fold into (micro-batches, recomputation; long finished by then: nothing waits)."""
        if self._side is None:
            self._read(pending, **kw)
            return
        inline, beside = split_by_stream(pending, first_float_tensor(output))
        if inline:
            torch.cuda.current_stream(self.device).wait_stream(self._side)
            self._read(inline, **kw)
        if beside:
            self._read_beside(beside, **kw)

    def _read_beside(self, pending: list[BlockOutput], **kw: Any) -> None:
        """Read block outputs on the monitor's own CUDA stream, beside the backward that
        follows (their reductions are memory-bound, the backward's matmuls compute-bound),
        instead of in front of it. The device orders it: the side stream starts after the
        work queued so far, and the training stream waits for it before the next fold
        (`_end_step`). No host wait."""
        side = self._side
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._read(pending, **kw)
        for _, shard, *_ in pending:
            # The allocator must not hand this memory to the training stream (the backward
            # frees these outputs) before the side stream has read it.
            shard.record_stream(side)

    @torch.no_grad()
    def _read(self, pending: list[BlockOutput], record: bool = True) -> None:
        """Every output's max-abs, one read of each (on CUDA in one fused kernel per dtype),
        waiting on the device for the next fold; on a logged step also, if `record`, their
        L2 norms (fused) and exact non-finite counts."""
        shards = [shard for _, shard, *_ in pending]
        for (index, shard, _, version), value in zip(pending, max_abs(shards), strict=True):
            if shard._version != version:
                self._warn_changed(index)
            seen = self._step_max.get(index)  # run again: micro-batches of the step
            self._step_max[index] = value if seen is None else torch.maximum(seen, value)
        if not (self._active and record):
            return
        norms = fused_norms(shards, 2, dtype=norm_dtype(shards))
        for (index, shard, weight, _), norm in zip(pending, norms, strict=True):
            # x - x is 0 for a finite x and NaN for NaN or inf: two passes, where isfinite
            # takes five.
            nonfinite = torch.count_nonzero(shard - shard)
            self._act_logged.append((index, weight, shard.numel(), norm, nonfinite))

    def _warn_changed(self, index: int) -> None:
        """Once per run: a layer output changed in place between its layer's return and the
        read (rare: autograd refuses it for outputs the next layer saved for backward)."""
        if not self._changed_warned:
            self._changed_warned = True
            log.warning(
                "trainvitals: the output of layer %r was changed in place before the model's "
                "forward returned; its activation statistics describe the changed tensor",
                self.layers.names[index],
            )

    def _upload(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        """Host numbers to the device without waiting: on CUDA through pinned memory, copied
        asynchronously (from pageable memory the copy would synchronise)."""
        host = torch.tensor(values, dtype=dtype)
        if self.device.type != "cuda":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    def _layer_sums(
        self, key: tuple, entries: Callable[[], list[tuple]], rows: int, values: torch.Tensor
    ) -> torch.Tensor:
        """Sum values[k] * weight_k into slot (row_k, layer_k) of a (rows, n_layers) float64
        matrix, entries()[k] = (row_k, layer_k, weight_k): one index_add on the device. The
        layout is built and uploaded once per `key` (it changes only when, say, a frozen
        parameter stops having a gradient), not on every logged step."""
        if key not in self._constants:
            if len(self._constants) >= 16:  # keys that keep changing must not pile up
                self._constants.clear()
            n, layout = self.layout.n_layers, entries()
            self._constants[key] = (
                self._upload([r * n + i for r, i, _ in layout], torch.int64),
                self._upload([w for *_, w in layout], torch.float64),
            )
        flat, weight = self._constants[key]
        out = torch.zeros(rows * self.layout.n_layers, dtype=torch.float64, device=self.device)
        return out.index_add_(0, flat, values * weight).view(rows, -1)

    def _param_entries(self, have: tuple[int, ...], n_update: int) -> list[tuple]:
        """_layer_sums rows of _param_stats: gradients, parameters, updates, and the
        gradients again for their non-finite flags."""
        layer, weight = self.layers.param_layer, self._param_weight
        owners = [(0, i) for i in have] + [(1, i) for i in range(len(self.params))]
        owners += [(2, i) for i in range(n_update)] + [(3, i) for i in have]
        return [(row, layer[i], weight[i]) for row, i in owners]

    @torch.no_grad()  # parameter shards may require grad; nothing here is for autograd
    def _param_stats(self) -> tuple[torch.Tensor, ...]:
        """Per-layer sums of squares of the gradients, the parameters and their change by the
        previous optimizer step (negative when it was not measured), and per layer how many
        gradient tensors hold a NaN or inf; all local shards, replication-weighted so that
        the sum over ranks counts every element once. One fused norm over the gradients and
        parameters (the change's norms were taken when the optimizer stepped).

        Non-finite gradients are read off their norms at no extra cost (an exact count of
        values would read every gradient five more times)."""
        have = tuple(i for i, p in enumerate(self.params) if p.grad is not None)
        grads = [dense_values(local(self.params[i].grad)) for i in have]
        shards = [local(p) for p in self.params]
        update = self.update.take() or []
        tensors = grads + shards
        norms = torch.stack(fused_norms(tensors, 2, dtype=norm_dtype(tensors)) + update).double()
        bad = norms[: len(have)].isfinite().logical_not().double()
        sums = self._layer_sums(
            ("params", have, len(update)),
            lambda: self._param_entries(have, len(update)),
            4,
            torch.cat([norms.square(), bad]),
        )
        if not update:
            # Not measured: a negative sum of squares, which no measurement gives, so that a
            # NaN update (a step that wrote NaN weights) still reads as NaN. A kernel
            # argument: no copy from the host.
            sums[2].fill_(-1.0)
        return sums[0], sums[3], sums[1], sums[2]

    def _activation_stats(self) -> tuple[torch.Tensor, torch.Tensor, list[float]]:
        """Per-layer sums of squares and non-finite counts of the logged step's block
        outputs (replication-weighted), and their element counts (known on the host)."""
        logged, self._act_logged = self._act_logged, []
        count = [0.0] * self.layout.n_layers
        for index, weight, numel, _norm, _bad in logged:
            count[index] += numel * weight
        if not logged:
            zeros = torch.zeros((2, self.layout.n_layers), dtype=torch.float64, device=self.device)
            return zeros[0], zeros[1], count
        owners = tuple((index, weight) for index, weight, *_ in logged)
        norms = torch.stack([norm for *_, norm, _bad in logged]).double()
        bad = torch.stack([bad for *_, bad in logged]).double()
        sums = self._layer_sums(
            ("activations", owners),
            lambda: [(row, index, weight) for row in (0, 1) for index, weight in owners],
            2,
            torch.cat([norms.square(), bad]),
        )
        return sums[0], sums[1], count

    def step(self, loss: torch.Tensor | float, tokens: int, lr: float | None = None) -> None:
        """Mark the end of a training step. Never waits for the device or the network.

        loss: this rank's loss tensor (on the device; not read here), or a number; a tensor
        of per-sample losses counts as its mean. tokens: tokens this rank processed in the
        step. lr: the learning rate the step used, if known (a number of any kind).
        """
        now, arrival_unix_s = time.perf_counter(), time.time()
        step_time_s, self._last_step_end = now - self._last_step_end, now
        self.liveness.finished(self.step_count)
        data_time_s, compute_time_s = self.timer.step()
        loss = self._loss_scalar(loss)
        if lr is not None:
            lr = float(lr)  # numpy and tensor lrs too; sync point only for an lr on the GPU
        self._end_step(loss)
        if self._active:
            timing = {
                "step_time_s": step_time_s,
                "compute_time_s": compute_time_s,
                "data_time_s": data_time_s,
                "arrival_unix_s": arrival_unix_s,
            }
            self._launch(loss, tokens, lr, timing)
            self._reset_accumulators()  # after _launch copied them into its vector
        self.step_count += 1
        self._active = self._logged(self.step_count)
        self.comms.arm(self._active)
        if self._active:
            # The optimizer step that follows changes the parameters: the next (logged) step
            # reports that change (update.py).
            self.update.arm()

    def _logged(self, step: int) -> bool:
        """Every log_every-th step, and the run's last one when total_steps is known."""
        return step % self.cfg.log_every == 0 or step == (self.cfg.total_steps or 0) - 1

    def _loss_scalar(self, loss: torch.Tensor | float) -> torch.Tensor:
        """The step's loss as a 0-d device tensor, without reading it."""
        if not isinstance(loss, torch.Tensor):  # a number the user read already
            return self._upload([float(loss)], torch.float32)[0]
        loss = loss.detach()
        return loss.reshape(()) if loss.numel() == 1 else loss.float().mean()

    def _launch(
        self, loss: torch.Tensor, tokens: int, lr: float | None, timing: dict[str, float]
    ) -> None:
        pin = self.device.type == "cuda"
        w = self._plain_weight  # the loss and token count are replicated like activations
        n = self.layout.n_layers
        power = self.power.read()
        # Copied before take() zeroes it (both in stream order: no sync).
        local_grad_sumsq = self.comms.local_grad_sumsq.clone()
        traffic = self.comms.take(self.step_count - self._last_logged)
        self._last_logged = self.step_count
        host_slot = {
            **timing,
            **traffic,
            "tokens": tokens,
            **{k: getattr(power, k, math.nan) for k in SAMPLED_FIELDS},
            "replica_group": math.nan if self.replica.group is None else self.replica.group,
            # Filled on the device below, or NaN (a negative sum of squares: not measured,
            # so that a measured NaN stays one). Writing a Python number into a device
            # tensor would copy it from pageable memory and synchronise.
            "canary_fingerprint": math.nan,
            "replica_fingerprint": math.nan,
            "grad_sumsq_local": -1.0,
        }
        act_sumsq, act_nonfinite, act_count = self._activation_stats()
        # Job totals of power and energy: a rank without a reading adds 0 and is not counted.
        (power, power_n), (energy, energy_n) = (
            (value, 1.0) if math.isfinite(value) else (0.0, 0.0)
            for value in (host_slot["power_w"], host_slot["energy_j"])
        )
        per_step = [tokens * w, power, power_n, energy, energy_n, float(self.telemetry_dropped)]
        # One host->device copy for every host-side number.
        host = self._upload(
            [*act_count, *per_step, *(host_slot.get(k, 0.0) for k in RANK_SLOT)], torch.float64
        )
        loss = loss.double().reshape(1)
        grad_sumsq, grad_nonfinite, param_sumsq, update_sumsq = self._param_stats()
        slot = host[n + len(per_step) :].clone()
        slot[_LOSS] = loss[0]
        if self.comms.covers_grads:  # FSDP, DDP: read before the reduction
            slot[_GRAD_LOCAL] = local_grad_sumsq
        elif not self.distributed:  # one process: its gradients are the local ones
            slot[_GRAD_LOCAL] = grad_sumsq.sum()
        if self.cfg.canary_every and self.step_count >= self._next_canary_step:
            every = self.cfg.canary_every  # the first logged step at or after each multiple
            self._next_canary_step = (self.step_count // every + 1) * every
            slot[_CANARY] = self.canary.run().double()  # device to device: no sync
            if self.replica.group is not None:
                slot[_REPLICA] = self.replica.fingerprint().double()
        # records.py gives the layout: PER_STEP after the seven per-layer blocks.
        vec = torch.cat(
            [grad_sumsq, act_sumsq, host[:n], param_sumsq, update_sumsq,
             grad_nonfinite, act_nonfinite,
             loss * (tokens * w), host[n : n + 1], loss, host[n + 1 : n + len(per_step)]]
        )  # fmt: skip
        # A bad step is seen by several ranks (tp copies, dp peers after the reduction): the
        # count travels as a max, the most steps any one rank saw, not once per rank.
        vec_max = torch.cat(
            [self._act_max, self._act_bad_steps, self._bad_steps.reshape(1),
             slot[_STEP_TIME : _STEP_TIME + 1], slot[_ARRIVAL : _ARRIVAL + 1]]
        )  # fmt: skip
        wait, works = _no_wait, []
        if self.distributed:
            # Maxima cannot ride the SUM: a second, small reduction right behind it.
            works = [
                dist.all_reduce(vec, group=self._group, async_op=True),
                dist.all_reduce(vec_max, op=dist.ReduceOp.MAX, group=self._group, async_op=True),
            ]
        slots = slot
        if self.node.group is not None:
            # The node's slots, to its leader (all of them receive: a few KB on the node).
            slots = slot.new_empty(len(self.node.ranks) * len(RANK_SLOT))
            works.append(
                dist.all_gather_into_tensor(slots, slot, group=self.node.group, async_op=True)
            )
        if works:
            wait = lambda: [w.wait() for w in works]  # noqa: E731
        if pin:
            wait()  # on CUDA this orders our stream after the collective; the host does not block
            both = torch.cat([vec, vec_max, slots])
            parts = (both.to("cpu", non_blocking=True),)  # pinned memory
            ready = torch.cuda.Event()
            ready.record()
            wait = ready.synchronize
        else:
            parts = (vec, vec_max, slots)
        meta = StepMeta(self.step_count, lr, self.flops_per_token, self.peak_flops_per_s)
        try:
            self._queue.put_nowait(_Pending(meta, parts, wait))
        except queue.Full:
            self.dropped_steps += 1  # exported as a counter; training never blocks on us

    # ------------------------------------------------------------------ background thread

    def _export_loop(self, run_meta: dict[str, Any]) -> None:
        builder = ColumnBatch(self.run_id)
        if self.rank == 0:
            builder.append("runs", **{k: v for k, v in run_meta.items() if k != "run_id"})
        last_flush = time.monotonic()
        while True:
            try:
                item = self._queue.get(timeout=self.cfg.export_interval_s)
            except queue.Empty:
                item = None
            if item is _STOP:
                break
            if isinstance(item, _Flush):
                if len(builder):
                    self._export(builder)
                    builder, last_flush = ColumnBatch(self.run_id), time.monotonic()
                item.done.set()
                continue
            urgent = isinstance(item, _Event)  # rare, and the record of a crash: sent at once
            if urgent:
                builder.append("events", **item.row)
            elif item is not None:
                # sync point: on this export thread only; training never waits for it.
                item.wait()
                if self.rank == self.node.leader:
                    self._add_rows(builder, item)
            due = time.monotonic() - last_flush >= self.cfg.export_interval_s
            if len(builder) and (due or urgent):
                self._export(builder)
                builder, last_flush = ColumnBatch(self.run_id), time.monotonic()
        if len(builder):
            self._export(builder)

    def _add_rows(self, batch: ColumnBatch, item: _Pending) -> None:
        """The rows of a reduced step: steps and layers on rank 0, the node's ranks on its
        leader. Numpy columns throughout: O(layers + local ranks), nothing per row."""
        # sync point: host, after wait(), on this export thread only.
        both = np.concatenate([p.numpy() for p in item.parts])
        size, max_size = self.layout.size, self.layout.max_size
        v, v_max = both[:size], both[size : size + max_size]
        if self.rank == 0:
            add_step(batch, self.layout, v, v_max, item.meta, self.world_size)
        slots = both[size + max_size :].reshape(len(self.node.ranks), len(RANK_SLOT))
        release = release_unix_s(self.layout, v_max)
        add_ranks(batch, item.meta.step, np.asarray(self.node.ranks), slots, release)

    def _export(self, builder: ColumnBatch) -> None:
        try:
            self.exporter.export(builder)
        except Exception:  # an exporter must not raise; if one does, training goes on
            self.failed_exports += 1
            log.exception("trainvitals exporter failed; the batch is lost")

    @property
    def telemetry_dropped(self) -> int:
        """Logged steps dropped on a full queue, plus batches the exporter could not keep
        or raised on."""
        dropped_batches = getattr(self.exporter, "dropped_batches", 0)
        return self.dropped_steps + dropped_batches + self.failed_exports

    def event(self, kind: str, step: int, rank: int = -1, detail: dict | None = None) -> None:
        """Record an event (an injected fault, a restart, a checkpoint). Never blocks."""
        row = {
            "step": step,
            "rank": rank,
            "kind": kind,
            "detail": json.dumps(detail or {}),
            "time_unix_s": time.time(),
        }
        try:
            self._queue.put_nowait(_Event(row))
        except queue.Full:
            self.dropped_steps += 1

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Export every step and event queued so far, and wait (up to `timeout_s`) until the
        exporter has taken them: for a process about to end without `close()` (a crash, an
        injected one too). True if done in time. Blocks: not for the training step."""
        done = threading.Event()
        try:
            self._queue.put(_Flush(done), timeout=timeout_s)
        except queue.Full:
            return False
        return done.wait(timeout_s)

    def close(self, timeout_s: float = 30.0) -> None:
        """Flush what is pending and stop the background threads. Call on every rank; a
        second call does nothing."""
        if self._closed:
            return
        self._closed = True
        self.heartbeat.close("ended")  # first: a slow drain below must not look like a hang
        self._phases.close()
        self.power.close()
        self.timer.close()
        self.update.close()
        self.comms.close()
        for h in self._handles:
            h.remove()
        self._model._trainvitals_attached = False
        if self.rank == 0:  # a clean end: alerting tells a finished run from a stalled one
            detail = {
                "telemetry_dropped": self.telemetry_dropped,
                # Steps after the last logged one: their maxima and non-finite counts never
                # left the device (total_steps makes the last step a logged one).
                "unlogged_tail_steps": self.step_count - 1 - self._last_logged,
            }
            self.event("run_end", self.step_count, detail=detail)
        try:
            self._queue.put(_STOP, timeout=timeout_s)
        except queue.Full:
            log.warning("trainvitals export queue stayed full for %.0f s at close", timeout_s)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("trainvitals export thread did not finish within %.0f s", timeout_s)
        try:
            self.exporter.shutdown(timeout_s)
        except Exception:  # an exporter must not raise; if one does, training still ends well
            log.exception("trainvitals exporter failed to shut down")


class NullMonitor:
    """Monitoring off, behind the Monitor's interface: every call returns at once."""

    canary = None

    def __init__(self, run_id: str = "") -> None:
        self.run_id = run_id or "unmonitored"

    def step(self, loss: torch.Tensor, tokens: int, lr: float | None = None) -> None:
        pass

    def event(self, kind: str, step: int, rank: int = -1, detail: dict | None = None) -> None:
        pass

    def flush(self, timeout_s: float = 10.0) -> bool:
        return True

    def close(self, timeout_s: float = 30.0) -> None:
        pass


def _check_attachable(model: nn.Module) -> None:
    """ValueError for a model the monitor cannot watch as it is: one already watched (two
    monitors would both wrap FSDP's collectives, and closing one would unwrap the other's),
    or one with parameters not materialized yet (on the meta device)."""
    if getattr(model, "_trainvitals_attached", False):
        raise ValueError("attach: a monitor is already attached to this model; close() it first")
    meta = next((n for n, p in model.named_parameters() if local(p).is_meta), None)
    if meta is not None:
        raise ValueError(
            f"attach: parameter {meta!r} is on the meta device; materialize the model "
            "(model.to_empty(device=...) and load or initialise its weights) before attach"
        )


def split_by_stream(
    pending: list[BlockOutput], returned: torch.Tensor | None
) -> tuple[list[BlockOutput], list[BlockOutput]]:
    """Which pending block outputs (index, shard, ...) must be read in the training stream's
    order, and which may be read on the monitor's side stream.

    In order: the output the model returns (`returned`, or a view of it), as its caller may
    change it in place while a side stream still reads it (the head's output, small beside
    the blocks'); and a tensor subclass with no storage of its own (a wrapper), which the
    allocator cannot be told about. If `returned` is such a wrapper, every output stays in
    order."""
    ptr = _storage(arrived(returned)) if returned is not None else -1
    keep = [ptr is None or at is None or at == ptr for at in (_storage(e[1]) for e in pending)]
    inline = [entry for entry, k in zip(pending, keep, strict=True) if k]
    beside = [entry for entry, k in zip(pending, keep, strict=True) if not k]
    return inline, beside


def _storage(t: torch.Tensor) -> int | None:
    """Where a tensor's memory is (a view of it shares the address); None for a tensor
    subclass that has no storage of its own (a wrapper)."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def _graph_task_id() -> int:
    """The autograd graph task this thread is running (-1 outside backward)."""
    return torch._C._current_graph_task_id()


def _no_wait() -> None:
    pass
