"""`trainvitals plan`: what a training run costs, before it starts.

Training compute C = 6 N D FLOPs for N parameters and D tokens (Kaplan et al., 2020, eq. 2.1;
the attention term is left out, which is small for contexts much shorter than 12 x the
model width). Wall time = C / (devices x peak FLOP/s x MFU). Energy = devices x board power
x wall time: an upper bound for the accelerators alone (boards rarely sit at their limit;
hosts, network and cooling come on top).
"""

from __future__ import annotations

from dataclasses import dataclass

from trainvitals import checks
from trainvitals.hooks.flops import PEAKS

SECONDS_PER_DAY = 86_400


@dataclass(frozen=True)
class Plan:
    flops: float
    seconds: float
    energy_j: float | None

    @property
    def days(self) -> float:
        return self.seconds / SECONDS_PER_DAY


def plan(
    params: float, tokens: float, gpu: str, count: int, mfu: float,
    precision: str = "bf16", power_w: float | None = None,
) -> Plan:  # fmt: skip
    if gpu not in PEAKS:
        raise ValueError(f"unknown device {gpu!r}; one of {sorted(PEAKS)}")
    checks.positive("params", params)
    checks.positive("tokens", tokens)
    if count < 1 or not 0 < mfu <= 1:
        raise ValueError(f"count must be >= 1 and mfu in (0, 1], got {count} and {mfu}")
    if power_w is not None:
        checks.positive("power_w", power_w)
    peak = getattr(PEAKS[gpu], precision, None)
    if peak is None:
        raise ValueError(f"{gpu} has no {precision} peak in the table")
    flops = 6.0 * params * tokens
    seconds = flops / (count * peak * mfu)
    power = power_w if power_w is not None else PEAKS[gpu].board_power_w
    return Plan(flops, seconds, None if power is None else count * power * seconds)


def describe(p: Plan) -> str:
    energy = "unknown (pass --power-w)" if p.energy_j is None else f"{p.energy_j / 3.6e9:,.0f} MWh"
    return (
        f"training compute: {p.flops:.3g} FLOPs\n"
        f"wall time:        {p.days:,.1f} days\n"
        f"accelerator energy (at board power): {energy}"
    )
