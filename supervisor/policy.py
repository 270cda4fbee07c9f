"""What the supervisor does about each kind of alert: the policy, read from TOML.

    [limits]
    max_restarts_per_hour = 3     # relaunches in any 3,600 s, after which it only observes
    max_fenced_fraction = 0.5     # never fence more than this share of the nodes
    cooldown_s = 300              # least time between two actions
    failure_wait_s = 60           # after the job fails, how long to wait for the alert
                                  # naming the culprit before relaunching without fencing

    [kinds.sdc]
    mode = "act"                  # "observe" (the default): recommend, do nothing

    [kinds.loss_diverging]
    mode = "act"
    skip_data = true              # the re-run skips the data the diverged run trained on

Each alert kind has one response (RESPONSES); the policy says only whether to carry it
out. A file that does not parse, an unknown kind or setting, or `act` for a kind whose
response is not automated is refused, naming what is wrong.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

# The response to each alert kind the analyzer raises (analyzer/: detectors, liveness).
FENCE_RESUME = "fence the node, resume from the latest checkpoint on the others"
FENCE_ROLLBACK = "fence the node, roll back to the last checkpoint before the first evidence"
ROLLBACK = "roll back to the last checkpoint before the onset"
RERUN = "re-run the step on another replica: data (reproduces) or hardware (does not)"
NONE = "none: look at the alert"
RESPONSES = {
    "rank_lost": FENCE_RESUME,
    "hang": FENCE_RESUME,
    "sdc": FENCE_ROLLBACK,
    "sdc_replica": FENCE_ROLLBACK,
    "sdc_outlier": FENCE_ROLLBACK,
    "loss_diverging": ROLLBACK,
    "loss_spike": RERUN,
    "nonfinite": RERUN,
    "straggler": NONE,
    "intermittent_straggler": NONE,
    "throttle": NONE,
    "stall": NONE,
    "throughput_drop": NONE,
    "ranks_missing": NONE,
}
AUTOMATED = {FENCE_RESUME, FENCE_ROLLBACK, ROLLBACK, RERUN}  # responses `act` may carry out
MODES = ("observe", "act")


class PolicyError(ValueError):
    """A policy that cannot be used; the message names the file, section and field."""


@dataclass(frozen=True)
class KindPolicy:
    mode: str = "observe"
    skip_data: bool = False  # loss_diverging only: skip the data since the checkpoint


@dataclass(frozen=True)
class Limits:
    max_restarts_per_hour: int = 3
    max_fenced_fraction: float = 0.5
    cooldown_s: float = 300.0
    failure_wait_s: float = 60.0

    def __post_init__(self) -> None:
        if self.max_restarts_per_hour < 0:
            raise PolicyError("limits.max_restarts_per_hour must be >= 0")
        if not 0 <= self.max_fenced_fraction < 1:
            raise PolicyError(
                "limits.max_fenced_fraction must be in [0, 1): fencing every node ends the job"
            )
        if self.cooldown_s < 0 or self.failure_wait_s < 0:
            raise PolicyError("limits.cooldown_s and limits.failure_wait_s must be >= 0")


@dataclass(frozen=True)
class Policy:
    limits: Limits = field(default_factory=Limits)
    kinds: dict[str, KindPolicy] = field(default_factory=dict)

    def for_kind(self, kind: str) -> KindPolicy:
        """The policy of an alert kind; PolicyError for a kind nobody knows."""
        check_kind(kind)
        return self.kinds.get(kind, KindPolicy())

    @classmethod
    def load(cls, path: str | Path | None) -> Policy:
        """The policy in a TOML file; None: the defaults (observe everything)."""
        if path is None:
            return cls()
        p = Path(path)
        try:
            doc = tomllib.loads(p.read_text())
        except OSError as e:
            raise PolicyError(f"policy {str(p)!r}: cannot read it ({e.strerror})") from e
        except tomllib.TOMLDecodeError as e:
            raise PolicyError(f"policy {str(p)!r}: not valid TOML: {e}") from e
        try:
            return cls.from_dict(doc)
        except PolicyError as e:
            raise PolicyError(f"policy {str(p)!r}: {e}") from e

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> Policy:
        unknown = set(doc) - {"limits", "kinds"}
        if unknown:
            raise PolicyError(f"unknown sections {sorted(unknown)}; expected [limits], [kinds.*]")
        limits = Limits(**_typed(Limits, doc.get("limits", {}), "limits"))
        kinds = {}
        for kind, values in doc.get("kinds", {}).items():
            check_kind(kind)
            kp = KindPolicy(**_typed(KindPolicy, values, f"kinds.{kind}"))
            if kp.mode not in MODES:
                raise PolicyError(f"kinds.{kind}.mode must be one of {MODES}, got {kp.mode!r}")
            if kp.mode == "act" and RESPONSES[kind] not in AUTOMATED:
                raise PolicyError(
                    f"kinds.{kind}.mode = 'act': its response ({RESPONSES[kind]}) is not "
                    "automated; use 'observe'"
                )
            if kp.skip_data and kind != "loss_diverging":
                raise PolicyError(f"kinds.{kind}.skip_data: only loss_diverging takes it")
            kinds[kind] = kp
        return cls(limits, kinds)


def check_kind(kind: str) -> None:
    if kind not in RESPONSES:
        raise PolicyError(f"unknown alert kind {kind!r}; known: {sorted(RESPONSES)}")


def _typed(cls: type, values: Any, where: str) -> dict[str, Any]:
    """values checked against the dataclass's fields: names and types."""
    if not isinstance(values, dict):
        raise PolicyError(f"[{where}] must be a table of settings")
    declared = {f.name: f.type for f in fields(cls)}
    out = {}
    for name, value in values.items():
        if name not in declared:
            raise PolicyError(f"{where}.{name}: unknown setting; known: {sorted(declared)}")
        want = {"int": int, "float": (int, float), "bool": bool, "str": str}[declared[name]]
        if (isinstance(value, bool) and declared[name] != "bool") or not isinstance(value, want):
            raise PolicyError(f"{where}.{name} must be {declared[name]}, got {value!r}")
        out[name] = float(value) if declared[name] == "float" else value
    return out
