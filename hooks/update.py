"""The change an optimizer step makes to the parameters, measured for the logged steps.

    meter = UpdateMeter(params)   # the model's parameters (DTensors or plain)
    meter.arm()                   # at the step boundary before a logged step
    ...optimizer.step()...        # measured by the meter's optimizer hooks
    norms = meter.take()          # at the logged step: per-parameter L2 norms, or None

Measuring the change needs a copy of the parameters from before the step. Taken in a
global optimizer pre-hook and read in the post-hook, that copy lives only while the
optimizer steps, when the activations are gone. A copy taken at the monitor's step boundary
would instead live through the next forward and backward, on top of the activations at
their peak: one more fp32 copy of every local shard, every logged step.

A training loop without a torch optimizer (a hand-written update) is measured between step
boundaries: until an optimizer of these parameters has stepped, `arm()` copies the
parameters at once and `take()` compares them with the parameters as they are then.

Several optimizers (one for the embeddings, one for the rest) are measured each on its
own parameters. Parameters no optimizer steps have not changed: their norm is 0. Nothing
here waits for the device.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from .layers import OptimizerParams, local
from .norms import fused_norms, norm_dtype


class UpdateMeter:
    def __init__(self, params: list[torch.Tensor]) -> None:
        self._params = params
        self._owned = OptimizerParams(params)
        self._uses_optimizer = False  # has an optimizer of these parameters stepped?
        self._armed = False
        self._seen_step = False  # start_step arms only after a step ended (meter protocol)
        self._boundary_copy: list[torch.Tensor] | None = None  # loops without an optimizer
        self._before: dict[int, list[torch.Tensor]] = {}  # per optimizer, while it steps
        self._norms: list[torch.Tensor | None] | None = None  # per parameter, by post-hooks
        self._handles = [
            register_optimizer_step_pre_hook(self._pre_step),
            register_optimizer_step_post_hook(self._post_step),
        ]

    def arm(self) -> None:
        """The next optimizer step is measured (call before it, at the step boundary)."""
        self._armed, self._norms = True, None
        if not self._uses_optimizer:
            self._boundary_copy = _copy([local(p) for p in self._params])

    def start_step(self, logged: bool) -> None:
        """The meter protocol: before a logged step, measure the optimizer step that comes
        first (the one after the previous step's end); none precedes the first step seen."""
        if logged and self._seen_step:
            self.arm()

    def end_step(self, loss: torch.Tensor) -> None:
        self._seen_step = True

    def collect(self, step: int, steps: int) -> dict[str, Any]:
        return {"update": self.take()}

    def take(self) -> list[torch.Tensor] | None:
        """Per-parameter L2 norms (0-d device tensors) of the change the measured step made,
        or None if there was none to measure. Disarms."""
        norms, self._norms = self._norms, None
        copy, self._boundary_copy = self._boundary_copy, None
        self._armed = False
        self._before.clear()  # an optimizer step that never finished (it raised)
        if norms is not None:
            stepped = next(n for n in norms if n is not None)
            zero = stepped.new_zeros(())  # parameters that no optimizer steps did not change
            return [zero if n is None else n for n in norms]
        if copy is not None:
            return _change_norms(copy, [local(p) for p in self._params])
        return None

    def _pre_step(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        positions = self._owned.positions(optimizer)
        if not positions:
            return
        self._uses_optimizer = True
        if not self._armed:
            return
        self._boundary_copy = None  # the optimizer's own hooks measure it instead
        self._before[id(optimizer)] = _copy([local(self._params[i]) for i in positions])

    def _post_step(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        before = self._before.pop(id(optimizer), None)
        if before is None:
            return
        positions = self._owned.positions(optimizer)
        norms = _change_norms(before, [local(self._params[i]) for i in positions])
        if self._norms is None:
            self._norms = [None] * len(self._params)
        for i, norm in zip(positions, norms, strict=True):
            self._norms[i] = norm

    def close(self) -> None:
        for h in self._handles:
            h.remove()


@torch.no_grad()
def _copy(shards: list[torch.Tensor]) -> list[torch.Tensor]:
    return list(torch._foreach_mul(shards, 1.0))  # x * 1 is exact: one fused copy


@torch.no_grad()
def _change_norms(before: list[torch.Tensor], after: list[torch.Tensor]) -> list[torch.Tensor]:
    """||after - before|| of each pair. In place: the copy becomes minus the change (same
    norm), so no second copy is made."""
    torch._foreach_sub_(before, after)
    return fused_norms(before, 2, dtype=norm_dtype(before))
