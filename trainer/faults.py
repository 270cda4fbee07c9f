"""Fault injection for the reference trainer, with ground truth, so detectors meet real faults.

    --inject straggler:rank=1,step=20,slowdown=0.3   rank 1 computes 30% longer from step 20
    --inject sdc:rank=2,step=30,fraction=0.001       rank 2 has a faulty unit from step 30: a
                                                     fraction of one op's outputs (and of the
                                                     SDC canary's) come out wrong
    --inject sdc:rank=2,step=30,mode=bitflip         one bit of one weight flips in rank 2's
                                                     memory at step 30 (a replicated weight
                                                     where there is one, so replicas disagree)
    --inject spike:step=50,kind=batch                one step trains on random bytes
    --inject spike:step=50,kind=lr                   one step uses 30x the learning rate
    --inject nan:step=40                             the loss becomes NaN
    --inject crash:rank=3,step=60 / hang:rank=3,step=60

Every rank parses the same specs; rank 0 records each fault as an event (`fault:<kind>`)
at its step, which is the ground truth detectors are scored against.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field

import torch
from torch import nn

KINDS = {
    # kind: (required parameters, optional parameters with defaults)
    "straggler": ({"rank", "step", "slowdown"}, {}),
    "sdc": ({"rank", "step"}, {"fraction": 0.001, "mode": "unit"}),
    "spike": ({"step"}, {"kind": "batch"}),
    "nan": ({"step"}, {}),
    "crash": ({"rank", "step"}, {}),
    "hang": ({"rank", "step"}, {}),
}
_TEXT_PARAMS = {"kind", "mode"}
_WHOLE_PARAMS = {"rank", "step"}
LR_SPIKE_FACTOR = 30.0
BITFLIP_BIT = 20  # a float32 mantissa bit: the weight changes by a few percent, nothing blows up


@dataclass(frozen=True)
class Fault:
    kind: str
    params: dict = field(default_factory=dict)

    @property
    def step(self) -> int:
        return int(self.params["step"])

    @property
    def rank(self) -> int:
        return int(self.params.get("rank", -1))


def parse_fault(spec: str) -> Fault:
    """'straggler:rank=1,step=20,slowdown=0.3' -> Fault. ValueError names what is wrong."""
    kind, _, rest = spec.partition(":")
    if kind not in KINDS:
        raise ValueError(f"--inject {spec!r}: unknown fault {kind!r}; one of {sorted(KINDS)}")
    required, optional = KINDS[kind]
    params: dict = dict(optional)
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or key not in required | set(optional):
            raise ValueError(
                f"--inject {spec!r}: unexpected {item!r}; takes {sorted(required | set(optional))}"
            )
        params[key] = _value(spec, key, value)
    missing = required - set(params)
    if missing:
        raise ValueError(f"--inject {spec!r}: missing {sorted(missing)}")
    if kind == "straggler" and not 0 < params["slowdown"] <= 10:
        raise ValueError(f"--inject {spec!r}: slowdown must be in (0, 10]")
    if kind == "sdc" and not 0 < params["fraction"] <= 1:
        raise ValueError(f"--inject {spec!r}: fraction must be in (0, 1]")
    if kind == "sdc" and params["mode"] not in ("unit", "bitflip"):
        raise ValueError(f"--inject {spec!r}: sdc mode must be 'unit' or 'bitflip'")
    if kind == "spike" and params["kind"] not in ("batch", "lr"):
        raise ValueError(f"--inject {spec!r}: spike kind must be 'batch' or 'lr'")
    return Fault(kind, params)


def _value(spec: str, key: str, text: str) -> str | int | float:
    """A parameter's value: text, a whole number >= 0 (rank, step) or a number."""
    if key in _TEXT_PARAMS:
        return text
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if key in _WHOLE_PARAMS:
        if not (value.is_integer() and value >= 0):  # False for nan and inf too
            raise ValueError(f"--inject {spec!r}: {key} must be a whole number >= 0, got {text!r}")
        return int(value)
    if math.isnan(value):
        raise ValueError(f"--inject {spec!r}: {key} must be a number, got {text!r}")
    return value  # inf is refused by the range checks in parse_fault


def corrupt(t: torch.Tensor, fraction: float, seed: int = 7) -> torch.Tensor:
    """A faulty unit's output: a fixed `fraction` of the elements come out 8x too large, negated."""
    gen = torch.Generator(device=t.device).manual_seed(seed)
    mask = torch.rand(t.shape, generator=gen, device=t.device) < fraction
    return torch.where(mask, -8.0 * t, t)


def flip_bit(param: torch.Tensor, bit: int) -> None:
    """Flip one bit of the first element of this rank's (local shard of the) float32 weight."""
    t = param.to_local() if hasattr(param, "to_local") else param
    with torch.no_grad():
        t.view(torch.int32).view(-1)[0] ^= 1 << bit


class FaultInjector:
    """Applies the faults that concern this rank at the right steps."""

    def __init__(self, specs: list[str], rank: int, world_size: int) -> None:
        self.faults = [parse_fault(s) for s in specs]
        for f in self.faults:
            if f.rank >= world_size:
                raise ValueError(f"--inject {f.kind}: rank {f.rank} >= world size {world_size}")
        self.rank = rank

    def _mine(self, kind: str, step: int, started: bool = False) -> list[Fault]:
        return [
            f for f in self.faults
            if f.kind == kind and f.rank in (-1, self.rank)
            and (step >= f.step if started else step == f.step)
        ]  # fmt: skip

    def record(self, monitor, step: int) -> None:
        """Rank 0 writes the ground truth of every fault that starts at `step`."""
        if self.rank == 0:
            for f in self.faults:
                if f.step == step:
                    detail = {k: v for k, v in f.params.items() if k not in ("rank", "step")}
                    monitor.event(f"fault:{f.kind}", step, f.rank, detail)

    def arm_sdc(self, model: nn.Module, monitor, step: int) -> None:
        """From its step on, this rank computes wrong values in one op and in its canary;
        or, for a bit flip, one bit of one weight flips once, now."""
        for f in self._mine("sdc", step):
            if f.params["mode"] == "bitflip":
                replicas = getattr(getattr(monitor, "replica", None), "tensors", None)
                flip_bit(replicas[0] if replicas else next(model.parameters()), BITFLIP_BIT)
                continue
            block = next(m for name, m in model.named_modules() if name.endswith("feed_forward"))
            block.register_forward_hook(lambda _m, _i, out, p=f.params: corrupt(out, p["fraction"]))
            if monitor.canary is not None:  # None when the hooks are off
                monitor.canary.fault = lambda out, p=f.params: corrupt(out, p["fraction"])

    def batch(self, step: int, inputs: torch.Tensor, targets: torch.Tensor):
        """The step's batch; random bytes for a batch spike (nothing to learn from them)."""
        if any(f.params["kind"] == "batch" for f in self._mine("spike", step)):
            gen = torch.Generator().manual_seed(step)
            noise = torch.randint(0, 256, (inputs.shape[0], inputs.shape[1] + 1), generator=gen)
            return noise[:, :-1].to(inputs.device), noise[:, 1:].to(targets.device)
        return inputs, targets

    def lr_factor(self, step: int) -> float:
        hit = any(f.params["kind"] == "lr" for f in self._mine("spike", step))
        return LR_SPIKE_FACTOR if hit else 1.0

    def loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        return loss * float("nan") if self._mine("nan", step) else loss

    def slow_down(self, step: int, compute_s: float, device: torch.device) -> None:
        """A straggler computes `slowdown` x its own step's compute time more (busy, not asleep)."""
        for f in self._mine("straggler", step, started=True):
            _busy(f.params["slowdown"] * compute_s, device)

    def crash_or_hang(self, step: int) -> None:
        if self._mine("crash", step):
            os._exit(17)  # a crashed rank: no cleanup, no goodbye
        if self._mine("hang", step):
            while True:
                time.sleep(3600)


def _busy(seconds: float, device: torch.device) -> None:
    """Keep this rank's device busy for about `seconds` (a slow device, not an idle one)."""
    if device.type == "cuda":
        # About 1.5e9 cycles per second on current data-centre GPUs; order of magnitude is enough.
        torch.cuda._sleep(int(seconds * 1.5e9))
        return
    a = torch.randn(128, 128)
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        a @ a
