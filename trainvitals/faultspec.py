"""The fault language: `kind:key=value,...`, shared by the trainer and the simulator.

    straggler:rank=1,step=20,slowdown=0.3

The trainer (`--inject`, trainer/faults.py) and the fleet simulator (`--fault`,
trainvitals/simulate.py) parse it with `parse_fault` into the same `Fault`. Each declares
the kinds it can inject and their parameters (`Param`): they model different faults (a
crash needs a real process, a throttled clock a simulated one), and a kind both know may
take other parameters in each (a real SDC unit corrupts a fraction of one op's outputs; a
simulated one scales a gradient norm).

    KINDS = {"nan": {"step": Param("whole")}, ...}
    parse_fault("nan:step=40", KINDS) == Fault("nan", step=40)

`rank` and `step` are every fault's place (rank -1: the whole job); the rest are `params`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

_REQUIRED: Any = object()


@dataclass(frozen=True)
class Param:
    """One parameter of a fault kind.

    type: "whole" (a whole number >= 0; hexadecimal too, 0x20), "number" (a finite float)
    or "text". A number must lie in (low, high], said in `words` when it does not; text
    must be one of `choices` when there are some. No default: the parameter is required.
    """

    type: Literal["whole", "number", "text"]
    default: Any = _REQUIRED
    low: float = -math.inf
    high: float = math.inf
    words: str = ""
    choices: tuple[str, ...] = ()

    @property
    def required(self) -> bool:
        return self.default is _REQUIRED


Kinds = Mapping[str, Mapping[str, Param]]  # fault kind -> parameter name -> Param


@dataclass(frozen=True)
class Fault:
    """One injected fault: where (`step`, `rank`; -1 the whole job) and its other parameters."""

    kind: str
    step: int
    rank: int = -1
    params: dict[str, Any] = field(default_factory=dict)


def parse_fault(spec: str, kinds: Kinds, flag: str = "fault") -> Fault:
    """'straggler:rank=1,step=20,slowdown=0.3' -> Fault, by the declarations of `kinds`.

    ValueError names the spec (after `flag`, the option it came with) and what is wrong."""
    where = f"{flag} {spec!r}"
    kind, _, rest = spec.partition(":")
    if kind not in kinds:
        raise ValueError(f"{where}: unknown fault {kind!r}; one of {sorted(kinds)}")
    declared = kinds[kind]
    params = {k: p.default for k, p in declared.items() if not p.required}
    for item in filter(None, rest.split(",")):
        key, eq, text = item.partition("=")
        key = key.strip()
        if not eq or key not in declared:
            raise ValueError(f"{where}: unexpected {item!r}; {kind} takes {sorted(declared)}")
        params[key] = _value(where, kind, key, declared[key], text.strip())
    missing = {k for k, p in declared.items() if p.required} - set(params)
    if missing:
        raise ValueError(f"{where}: missing {sorted(missing)}")
    step = params.pop("step")
    rank = params.pop("rank", -1)
    return Fault(kind, step, rank, params)


def _value(where: str, kind: str, key: str, p: Param, text: str) -> Any:
    if p.type == "text":
        if p.choices and text not in p.choices:
            raise ValueError(
                f"{where}: {kind} {key} must be one of {list(p.choices)}, got {text!r}"
            )
        return text
    value: float
    if p.type == "whole":
        whole = _whole(text)
        if whole is None:
            raise ValueError(f"{where}: {key} must be a whole number >= 0, got {text!r}")
        value = whole
    else:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if math.isnan(value):
            raise ValueError(f"{where}: {key} must be a number, got {text!r}")
    # Finite and bounded where declared, so that no value overflows what it scales.
    if not p.low < value <= p.high:
        raise ValueError(f"{where}: {key} must be {p.words}, got {value:g}")
    return value


def _whole(text: str) -> int | None:
    """A whole number >= 0 written as an integer (0x20 too) or as a float (1e3); else None."""
    try:
        value = int(text, 0)
    except ValueError:
        try:
            number = float(text)
        except ValueError:
            return None
        if not number.is_integer():  # False for nan and inf too
            return None
        value = int(number)
    return value if value >= 0 else None


# The straggler's schedule: parameters both the trainer and the simulator take.
STRAGGLER_SCHEDULE = {
    "until": Param("whole", 0),  # the first step no longer slowed; 0: the run's end
    "ramp": Param("whole", 0),  # steps over which the slowdown grows to its full size
    "every": Param("whole", 0),  # slowed only every this many steps (hiccups); 0: each
}


def straggler_slowdown(f: Fault, step: int) -> float:
    """A straggler's slowdown at `step` (at or after its first): none from `until` on nor
    between its `every` steps, growing linearly over its first `ramp` steps."""
    p = f.params
    if p["until"] and step >= p["until"]:
        return 0.0
    if p["every"] and (step - f.step) % p["every"]:
        return 0.0
    grown = min(1.0, (step - f.step + 1) / p["ramp"]) if p["ramp"] else 1.0
    return float(p["slowdown"]) * grown
