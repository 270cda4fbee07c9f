"""SDC fingerprints: equal for equal bits, different for any flipped bit."""

from __future__ import annotations

import torch

from trainvitals.hooks.canary import FINGERPRINT_BITS, Canary, checksum_weights, fingerprint


def test_every_single_bit_flip_changes_the_fingerprint() -> None:
    t = torch.randn(64, dtype=torch.float32)
    w = checksum_weights(t.numel(), t.device)
    base = fingerprint(t, w).item()
    bits = t.view(torch.int32)
    for index in range(0, 64, 7):
        for bit in range(32):
            flipped = bits.clone()
            flipped[index] ^= 1 << bit if bit < 31 else -(2**31)
            assert fingerprint(flipped.view(torch.float32), w).item() != base


def test_fingerprint_fits_float64_exactly() -> None:
    fp = Canary(torch.device("cpu"), torch.float32).run().item()
    assert 0 <= fp < 2**FINGERPRINT_BITS and float(fp) == fp


def test_canaries_agree_unless_faulty() -> None:
    a, b = Canary(torch.device("cpu"), torch.float32), Canary(torch.device("cpu"), torch.float32)
    assert a.run().item() == b.run().item()
    b.fault = lambda out: out + (out.abs() > 30).float()  # a unit wrong on a few outputs
    assert a.run().item() != b.run().item()
    bf = Canary(torch.device("cpu"), torch.bfloat16)
    assert bf.run().item() == Canary(torch.device("cpu"), torch.bfloat16).run().item()
