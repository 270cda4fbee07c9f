"""A check of `monitor.step(tokens=...)`: this rank's tokens, not the global batch's.

The hooks sum the ranks' `tokens` for the job's tokens/s, so a global count multiplies
throughput (and MFU) by the number of data-parallel ranks. A forward pre-hook on the model
counts the token ids this rank's forwards received since the last step, from tensor
metadata only (dtype and numel: no device sync): per forward call the largest integer
tensor among its arguments (input ids; an attention mask or labels of the same shape are
not counted twice), summed over the step's forwards (gradient accumulation). Forwards
without autograd (validation under `no_grad`) are not counted.

A model fed floats (images, embeddings) gives nothing to compare with and is never
judged. A `tokens` above SUSPECT_RATIO x the ids seen cannot be this rank's: the monitor
warns once and records a `tokens_suspect` event. Fewer tokens than ids (padding left out)
are fine.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)

# A global count across dp >= 2 ranks is at least 2x the ids this rank saw; 1.5x leaves room
# for a count that adds tokens the ids do not hold (a BOS token per sequence, say).
SUSPECT_RATIO = 1.5


class TokenCheck:
    """Compares each step's `tokens` with the integer ids this rank's forwards received.

    `on_suspect(detail)` is called once, the first time `tokens` cannot be this rank's;
    the hook is then removed, so the check costs nothing for the rest of the run.
    """

    def __init__(self, model: nn.Module, on_suspect: Callable[[dict[str, Any]], None]) -> None:
        self._on_suspect = on_suspect
        self._ids_seen = 0  # token ids in this step's forwards so far
        self._handle = model.register_forward_pre_hook(self._forward, with_kwargs=True)

    def _forward(self, _module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not torch.is_grad_enabled():
            return
        self._ids_seen += max(
            (
                x.numel()
                for x in (*args, *kwargs.values())
                if isinstance(x, torch.Tensor)
                and not x.dtype.is_floating_point
                and not x.dtype.is_complex
                and x.dtype != torch.bool
            ),
            default=0,
        )

    def step(self, tokens: Any, step: int) -> None:
        """At the monitor's step boundary, with the `tokens` the user passed."""
        seen, self._ids_seen = self._ids_seen, 0
        if self._handle is None or seen == 0 or isinstance(tokens, torch.Tensor):
            return  # already warned, no ids to compare with, or a tensor (reading it syncs)
        try:
            suspect = float(tokens) > SUSPECT_RATIO * seen
        except (TypeError, ValueError):
            return
        if not suspect:
            return
        self.close()
        log.warning(
            "trainvitals: monitor.step(tokens=%s) at step %d, but this rank's model saw %d "
            "token ids this step: pass this rank's tokens, not the global count (the job's "
            "tokens/s sums the ranks' counts, so a global count multiplies it by the number "
            "of data-parallel ranks)",
            tokens,
            step,
            seen,
        )
        self._on_suspect({"tokens": float(tokens), "token_ids_seen": seen})

    def close(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
