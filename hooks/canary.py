"""SDC fingerprints, computed on the device without reading anything back to the host.

Canary: every rank multiplies the same fixed matrices in the training dtype and hashes the
result's bits. Identical healthy devices running the same kernels agree bit for bit, so a
rank whose fingerprint differs from the majority computes wrong numbers.

The hash is a weighted sum of the result's bit patterns with fixed random odd 64-bit
weights, wrapping modulo 2^64, cut to 52 bits so that it travels exactly in the float64
vector the monitor reduces. Any single flipped bit changes it; it is a checksum, not a
cryptographic hash, which is all an honest-hardware comparison needs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .meter import Every

FINGERPRINT_BITS = 52
_MASK = (1 << FINGERPRINT_BITS) - 1
_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def fingerprint(t: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """0-d int64 device tensor: a 52-bit checksum of `t`'s bits (`weights`: int64, t.numel())."""
    bits = t.contiguous().view(_INT_VIEW[t.element_size()]).reshape(-1).long()
    return ((bits * weights).sum() & _MASK).reshape(())


def checksum_weights(n: int, device: torch.device, seed: int = 0x5DC) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randint(-(2**62), 2**62, (n,), generator=gen, dtype=torch.int64) | 1
    return w.to(device)


class Canary:
    """A fixed matmul whose fingerprint every healthy rank shares.

    `fault` is the injection point of trainer/faults.py: a function applied to the matmul's
    result on a rank that simulates a faulty unit. None in real runs.
    """

    def __init__(
        self,
        device: torch.device,
        dtype: torch.dtype,
        size: int = 256,
        *,
        every: int = 0,
        first_step: int = 0,
    ) -> None:
        gen = torch.Generator().manual_seed(20250101)
        self.a = torch.randn(size, size, generator=gen).to(device, dtype)
        self.b = torch.randn(size, size, generator=gen).to(device, dtype)
        self.weights = checksum_weights(size * size, device)
        self.fault: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.schedule = Every(every, first_step)  # when collect() runs it (0: never)

    def start_step(self, logged: bool) -> None:
        pass

    def end_step(self, loss: torch.Tensor) -> None:
        pass

    def collect(self, step: int, steps: int) -> dict[str, Any]:
        """The meter protocol: the fingerprint on a logged step its schedule makes due."""
        return {"canary_fingerprint": self.run().double()} if self.schedule.due(step) else {}

    def close(self) -> None:
        pass

    def run(self) -> torch.Tensor:
        """0-d int64 fingerprint on the device (no host sync)."""
        out = self.a @ self.b
        if self.fault is not None:
            out = self.fault(out)
        return fingerprint(out, self.weights)
