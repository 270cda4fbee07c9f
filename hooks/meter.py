"""The meter protocol: the verbs the monitor drives every meter through.

A meter reads one kind of statistic (module docstring of monitor.py). The monitor calls,
on every meter and in this order:

- `start_step(logged)` before each step: arm for it (`logged`: the monitor logs it);
- `end_step(loss)` at the step boundary, every step (`loss`: a 0-d device tensor, not read);
- `collect(step, steps)` on a logged step: its values, by name: `records.RANK_SLOT` fields
  (host numbers, or 0-d device tensors) and the reducer's keyword inputs (`maxima`,
  `activations`, `update`, `local_grad_sumsq`), which the step reducer packs. `steps`:
  the steps since the previous logged one. Device values stay on the device: no host sync;
- `close()` once, at the end: remove hooks, stop threads.

Adding a meter is one line in Monitor.__init__; its values reach the reducer by name.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class Meter(Protocol):
    def start_step(self, logged: bool) -> None: ...

    def end_step(self, loss: torch.Tensor) -> None: ...

    def collect(self, step: int, steps: int) -> dict[str, Any]: ...

    def close(self) -> None: ...


class Every:
    """Due on the first logged step at or after each multiple of `every` (0: never), from
    `first_step` on: the canary's schedule, and the replica fingerprints' with it."""

    def __init__(self, every: int, first_step: int = 0) -> None:
        self.every = every
        self._next = -(-first_step // every) * every if every else 0  # a multiple, not before

    def due(self, step: int) -> bool:
        if not self.every or step < self._next:
            return False
        self._next = (step // self.every + 1) * self.every
        return True
