"""The step reducer: a logged step's statistics packed into the vectors of records.py and
this rank's slot, their reductions and the node's gather started, nothing waited for.

Per-layer sums (gradients, parameters, updates, block outputs) are replication-weighted
sums of squares on the local shards, summed per layer with one index_add each, so that the
SUM over ranks counts every element once (layers.py). The result is a `Pending`: the
tensors the collectives fill and the wait that the export reader calls on its own thread.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .activations import LoggedOutput
from .layers import LayerMap, dense_values, local, replication_weight
from .norms import fused_norms, norm_dtype
from .records import RANK_SLOT, StepMeta, VectorLayout
from .topology import Node

# Slots filled on the device (the others come from the host in one copy), and the two that
# the MAX reduction takes from the slot.
_LOSS, _GRAD_LOCAL, _STEP_TIME, _ARRIVAL = (
    RANK_SLOT.index(name) for name in ("loss", "grad_sumsq_local", "step_time_s", "arrival_unix_s")
)
# Slot values a rank fills on the device, or leaves at these: NaN (not measured) and a
# negative sum of squares (not measured, so that a measured NaN stays one). Writing a Python
# number into a device tensor would copy it from pageable memory and synchronise.
_DEVICE_DEFAULTS = {"canary_fingerprint": math.nan, "replica_fingerprint": math.nan,
                    "grad_sumsq_local": -1.0}  # fmt: skip


# torch 2.13 renamed all_gather_into_tensor (and warns on the old name); older ones lack it.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class Pending:
    """A logged step in flight: once `wait()` returns, `parts` (the SUM vector, the MAX
    vector and the node's slots, or on CUDA all in one pinned host tensor) hold the
    reduced values."""

    meta: StepMeta
    parts: tuple[torch.Tensor, ...]
    wait: Callable[[], Any]


class StepReducer:
    """Packs and reduces logged steps for one rank (module docstring)."""

    def __init__(
        self,
        params: list[torch.Tensor],
        layers: LayerMap,
        layout: VectorLayout,
        device: torch.device,
        *,
        world_size: int,
        group: Any,
        node: Node,
        plain_weight: float,
    ) -> None:
        self.params = params
        self.layers = layers
        self.layout = layout
        self.device = device
        self.distributed = group is not None
        self._group = group  # the monitor's own: never queued behind (or blocking) FSDP's
        self.node = node
        self._param_weight = [replication_weight(p, world_size) for p in params]
        self._plain_weight = plain_weight
        self._constants: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # _layer_sums

    def reduce(
        self,
        meta: StepMeta,
        loss: torch.Tensor,
        tokens: int,
        host_slot: dict[str, float],
        device_slot: dict[str, torch.Tensor],
        *,
        maxima: torch.Tensor,
        activations: list[LoggedOutput],
        update: list | None,
        local_grad_sumsq: torch.Tensor | None,
        dropped: int,
    ) -> Pending:
        """Pack the step and start its reductions. `host_slot`: this rank's slot values known
        on the host; `device_slot`: those on the device (fingerprints); `maxima`: the MAX
        vector's per-layer part (activations.py); `update`: the update norms (update.py);
        `local_grad_sumsq`: this rank's gradients before the data-parallel reduction, when a
        hook read them (comms.py); `dropped`: what this rank dropped so far."""
        pin = self.device.type == "cuda"
        w = self._plain_weight  # the loss and token count are replicated like activations
        n = self.layout.n_layers
        act_sumsq, act_nonfinite, act_count = self._activation_stats(activations)
        # Job totals of power and energy: a rank without a reading adds 0 and is not counted.
        (power, power_n), (energy, energy_n) = (
            (value, 1.0) if math.isfinite(value) else (0.0, 0.0)
            for value in (host_slot.get("power_w", math.nan), host_slot.get("energy_j", math.nan))
        )
        per_step = [tokens * w, power, power_n, energy, energy_n, float(dropped)]
        slot_values = {**_DEVICE_DEFAULTS, **host_slot}
        # One host->device copy for every host-side number.
        host = self.upload(
            [*act_count, *per_step, *(slot_values.get(k, 0.0) for k in RANK_SLOT)], torch.float64
        )
        loss = loss.double().reshape(1)
        grad_sumsq, grad_nonfinite, param_sumsq, update_sumsq = self._param_stats(update)
        slot = host[n + len(per_step) :].clone()
        slot[_LOSS] = loss[0]
        if local_grad_sumsq is not None:  # FSDP, DDP: read before the reduction
            slot[_GRAD_LOCAL] = local_grad_sumsq
        elif not self.distributed:  # one process: its gradients are the local ones
            slot[_GRAD_LOCAL] = grad_sumsq.sum()
        for name, value in device_slot.items():
            i = RANK_SLOT.index(name)
            slot[i] = value  # device to device: no sync
        # records.py gives the layout: PER_STEP after the seven per-layer blocks.
        vec = torch.cat(
            [grad_sumsq, act_sumsq, host[:n], param_sumsq, update_sumsq,
             grad_nonfinite, act_nonfinite,
             loss * (tokens * w), host[n : n + 1], loss, host[n + 1 : n + len(per_step)]]
        )  # fmt: skip
        # A bad step is seen by several ranks (tp copies, dp peers after the reduction): the
        # count travels as a max, the most steps any one rank saw, not once per rank.
        vec_max = torch.cat(
            [maxima, slot[_STEP_TIME : _STEP_TIME + 1], slot[_ARRIVAL : _ARRIVAL + 1]]
        )
        works = []
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
            works.append(_all_gather(slots, slot, group=self.node.group, async_op=True))
        wait = (lambda: [w.wait() for w in works]) if works else _no_wait
        if not pin:
            return Pending(meta, (vec, vec_max, slots), wait)
        wait()  # on CUDA this orders our stream after the collective; the host does not block
        both = torch.cat([vec, vec_max, slots]).to("cpu", non_blocking=True)  # pinned memory
        ready = torch.cuda.Event()
        ready.record()
        return Pending(meta, (both,), ready.synchronize)

    def upload(self, values: list, dtype: torch.dtype) -> torch.Tensor:
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
                self.upload([r * n + i for r, i, _ in layout], torch.int64),
                self.upload([w for *_, w in layout], torch.float64),
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
    def _param_stats(self, update: list | None) -> tuple[torch.Tensor, ...]:
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
        update = update or []
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

    def _activation_stats(
        self, logged: list[LoggedOutput]
    ) -> tuple[torch.Tensor, torch.Tensor, list[float]]:
        """Per-layer sums of squares and non-finite counts of the logged step's block
        outputs (replication-weighted), and their element counts (known on the host)."""
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


def _no_wait() -> None:
    pass
