"""Replica fingerprints: a checksum of the parameters a rank must hold identically to others.

Under FSDP x TP, a parameter replicated over the tp dimension (the RMSNorm weights of the
reference trainer) has the same local shard on every rank of a tp group; under plain data
parallelism every parameter is the same on every rank. Healthy ranks therefore agree bit
for bit on the checksum of those shards. A rank whose copy differs has had a bit flipped
in memory or computed a wrong update: silent data corruption the loss may never show.

`replica_group` numbers the sets of ranks that must agree: ranks with the same coordinates
on the mesh dimensions the chosen parameters are NOT replicated over.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from .canary import FINGERPRINT_BITS, checksum_weights
from .layers import local
from .meter import Every

_MASK = (1 << FINGERPRINT_BITS) - 1
_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_TILE = 4096  # weights repeat every _TILE elements; any single flipped bit still shows
_CHUNK = 1 << 22  # elements widened to int64 at a time, to bound the temporary memory


def _replicated_dims(p: torch.Tensor) -> tuple[int, ...]:
    if not isinstance(p, DTensor):
        return ()
    return tuple(
        d for d, pl in enumerate(p.placements) if pl.is_replicate() and p.device_mesh.size(d) > 1
    )


def _choose(
    params: list[torch.Tensor], mesh: DeviceMesh | None, world_size: int
) -> tuple[list[torch.Tensor], int | None]:
    if mesh is None:  # plain data parallelism: every parameter is replicated on every rank
        return (list(params), 0) if world_size > 1 else ([], None)
    dims_of = [_replicated_dims(p) for p in params]
    choices = [d for d in dims_of if d]
    if not choices:
        return [], None
    # The most common set of replicated mesh dims (tp for the reference trainer).
    dims = max(set(choices), key=choices.count)
    tensors = [p for p, d in zip(params, dims_of, strict=True) if d == dims]
    group = 0
    for d, c in enumerate(mesh.get_coordinate() or []):  # mixed radix, non-replicated dims
        if d not in dims:
            group = group * mesh.size(d) + c
    return tensors, group


class ReplicaFingerprint:
    """Which local shards to checksum, and this rank's replica group (None: no replicas)."""

    def __init__(
        self,
        params: list[torch.Tensor],
        mesh: DeviceMesh | None,
        world_size: int,
        *,
        every: int = 0,
        first_step: int = 0,
    ) -> None:
        self.tensors, self.group = _choose(params, mesh, world_size)
        self.schedule = Every(every, first_step)  # the canary's: both on the same steps
        if self.tensors:
            device = self.tensors[0].device
            self._weights = checksum_weights(_TILE, device, seed=0x7E9)

    def start_step(self, logged: bool) -> None:
        pass

    def end_step(self, loss: torch.Tensor) -> None:
        pass

    def collect(self, step: int, steps: int) -> dict[str, Any]:
        """The meter protocol: the replica group, and the fingerprint when due (and one)."""
        values: dict[str, Any] = {"replica_group": math.nan if self.group is None else self.group}
        if self.schedule.due(step) and self.group is not None:
            values["replica_fingerprint"] = self.fingerprint().double()
        return values

    def close(self) -> None:
        pass

    def fingerprint(self) -> torch.Tensor:
        """0-d int64 device tensor (no host sync). Call only when `group` is not None."""
        total = torch.zeros((), dtype=torch.int64, device=self._weights.device)
        for p in self.tensors:
            t = local(p)
            bits = t.detach().contiguous().view(_INT_VIEW[t.element_size()]).reshape(-1)
            for chunk in bits.split(_CHUNK):
                wide = chunk.long()
                pad = (-wide.numel()) % _TILE
                if pad:
                    wide = torch.nn.functional.pad(wide, (0, pad))
                total += (wide.view(-1, _TILE) * self._weights).sum()
        return total & _MASK
