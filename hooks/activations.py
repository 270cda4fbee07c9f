"""Block outputs: the one meter that reads activations, on the monitor's forward hooks.

On every step each block output's max-abs is taken (one read, left on the device) and lined
up with the steps before it; they are folded into running maxima and non-finite step counts
once per logged step (or every FOLD_STEPS steps). On a logged step the outputs' L2 norms
and exact non-finite counts are taken too, for the step reducer (reducer.py) to sum per
layer. On CUDA the reads run on a side stream beside the backward where that is safe
(split_by_stream). Nothing here waits for the device.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .layers import LayerMap, arrived, first_float_tensor, replication_weight
from .norms import fused_norms, max_abs, norm_dtype

log = logging.getLogger(__name__)

# Steps whose extrema may wait for a fold: bounds the small device tensors held between
# logged steps when the interval is long.
FOLD_STEPS = 64
# A block output waiting to be read: (layer, local shard, replication weight on a logged
# step, the shard's version counter when the layer returned it).
BlockOutput = tuple[int, torch.Tensor, float, int]
# A logged block output: (layer, weight, elements, L2 norm, non-finite count).
LoggedOutput = tuple[int, float, int, torch.Tensor, torch.Tensor]


class ActivationMeter:
    """Forward hooks on every layer of `layers` and on `model` (module docstring).

    `arm(logged)` says whether the coming step is a logged one; `end_step(loss)` closes a
    step; `take_logged()` and `maxima()` hand a logged step's values to the reducer, and
    `reset()` starts the next interval; `close()` removes the hooks."""

    def __init__(
        self, model: nn.Module, layers: LayerMap, device: torch.device, plain_weight: float
    ) -> None:
        self.layers = layers
        self.device = device
        self._plain_weight = plain_weight
        self.active = False  # is the running step a logged one?
        self._act_logged: list[LoggedOutput] = []
        # Block outputs of the running forward, read together when it returns (the version
        # counter tells an in-place change before the read).
        self._pending: list[BlockOutput] = []
        self._changed_warned = False
        self._forward_seen: set[int] = set()  # layers whose output this step's forward read
        # Block-output max-abs: this step's, by layer; then every step's since the last fold.
        self._step_max: dict[int, torch.Tensor] = {}
        self._maxima: list[torch.Tensor] = []
        self._zero = torch.zeros((), device=device)
        # Where block outputs are read on CUDA (_read_beside); elsewhere in program order.
        self._side = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.reset()
        self._handles = [
            m.register_forward_hook(self._activation_hook(i)) for i, m in enumerate(layers.modules)
        ]
        # After the layers' hooks: a layer that is the model itself is collected first.
        self._handles.append(model.register_forward_hook(self._read_outputs))

    def arm(self, logged: bool) -> None:
        self.active = logged

    start_step = arm  # the meter protocol (meter.py)

    def collect(self, step: int, steps: int) -> dict[str, Any]:
        """The meter protocol's logged step: the maxima and block outputs, then a new
        interval (reset replaces the tensors that maxima() just copied: no sync)."""
        values = {"maxima": self.maxima(), "activations": self.take_logged()}
        self.reset()
        return values

    def take_logged(self) -> list[LoggedOutput]:
        """The logged step's block outputs (norms and counts on the device), handed over once."""
        logged, self._act_logged = self._act_logged, []
        return logged

    def maxima(self) -> torch.Tensor:
        """[max-abs (L) | non-finite steps (L) | steps with any non-finite value] since the
        last reset, for the MAX reduction."""
        return torch.cat([self._act_max, self._act_bad_steps, self._bad_steps.reshape(1)])

    def close(self) -> None:
        for h in self._handles:
            h.remove()

    def reset(self) -> None:
        """Start a new interval: maxima and non-finite step counts from zero (after a
        logged step took them)."""
        n = len(self.layers.names)
        self._act_max = torch.zeros(n, dtype=torch.float64, device=self.device)
        self._act_bad_steps = torch.zeros(n, dtype=torch.float64, device=self.device)
        self._bad_steps = torch.zeros((), dtype=torch.float64, device=self.device)

    def end_step(self, loss: torch.Tensor) -> None:
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
        if self.active or len(self._maxima) >= FOLD_STEPS * (len(self.layers.names) + 1):
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
            if self.active:
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
        if not (self.active and record):
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
