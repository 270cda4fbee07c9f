"""Throttling: one rank's GPU slowed by power or heat while the others run at full clock.

Two per-rank signals:
- NVML clocks-event reasons (ranks.throttle_reasons, a bitmask): a rank is throttled at a
  step when any bit of `reasons_mask` is set; it is named when that held in at least
  `min_hits` of the last `window` logged steps, provided fewer than `max_fleet_fraction`
  of the ranks are in the same state (a fleet-wide power cap is policy, not a fault);
- SM clock (ranks.sm_clock_mhz) against the rank's own baseline: the clock is divided by
  the median clock of all ranks at the same step (so a fleet-wide change cancels out), and
  the rank is named when that ratio stays more than `clock_drop` below its own slow
  moving average (weight `baseline_weight` per step, frozen while low) for
  `clock_steps` consecutive logged steps.
A throttled rank usually turns into a straggler; this names the cause. Re-armed once both
signals are clear. Per step: O(ranks), vectorised.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from .alerts import Alert
from .detectors import data_query
from .rolling import median as fast_median
from .runinfo import name_rank, name_ranks
from .views import StepView

# NVML clocks-event (formerly "throttle") reasons, nvml.h: nvmlClocksEventReason*.
# Idle (0x1), application clock settings (0x2), sync boost (0x10) and display clock
# settings (0x100) are not slowdowns of a busy device and are left out of the default mask.
REASONS = {
    0x4: "SW power cap",
    0x8: "HW slowdown",
    0x20: "SW thermal slowdown",
    0x40: "HW thermal slowdown",
    0x80: "HW power brake",
}
DEFAULT_MASK = sum(REASONS)


def decode(bits: int) -> list[str]:
    """Names of the set bits that REASONS knows, lowest first."""
    return [name for bit, name in REASONS.items() if bits & bit]


@dataclass(frozen=True)
class ThrottleSettings:
    """Thresholds of the throttle detector (section `throttle`). Windows count logged steps."""

    # NVML clocks-event reason bits that count as throttling (a bitmask of REASONS): the
    # power and thermal slowdowns; idle, application clocks and sync boost are not faults.
    reasons_mask: int = DEFAULT_MASK
    # A rank is named when a masked reason was set in `min_hits` of its last `window`
    # logged steps: one NVML sample can catch a transient cap, 8 of 10 is a state.
    window: int = 10
    min_hits: int = 8
    # Fraction of the ranks (0-1) at or above which persistent throttling is fleet-wide,
    # a power policy rather than one bad device, and names nobody.
    max_fleet_fraction: float = 0.5
    # A rank's SM clock over the fleet median falling this fraction (0-1) below its own
    # moving average, for `clock_steps` consecutive logged steps, is a clock drop. 10%:
    # boost clocks of healthy devices of one model stay within a few percent of each other.
    clock_drop: float = 0.10
    clock_steps: int = 5
    # Weight (0-1] of each new logged step in that moving average: about 1 / 0.05 = 20
    # steps of memory, frozen while the clock is low so a drop does not become the norm.
    baseline_weight: float = 0.05
    # Logged steps of clock readings a rank needs before its clock is judged.
    min_history: int = 10

    def __post_init__(self) -> None:
        for name in ("window", "clock_steps", "min_history"):
            if getattr(self, name) < 1:
                raise ValueError(f"throttle.{name} must be >= 1, got {getattr(self, name)}")
        if not 1 <= self.min_hits <= self.window:
            raise ValueError(
                f"throttle.min_hits must be in [1, window={self.window}], got {self.min_hits}"
            )
        if self.reasons_mask <= 0:
            raise ValueError(f"throttle.reasons_mask must be > 0, got {self.reasons_mask}")
        if not 0 < self.max_fleet_fraction <= 1:
            raise ValueError(
                f"throttle.max_fleet_fraction must be in (0, 1], got {self.max_fleet_fraction}"
            )
        if not 0 < self.clock_drop < 1:
            raise ValueError(f"throttle.clock_drop must be in (0, 1), got {self.clock_drop}")
        if not 0 < self.baseline_weight <= 1:
            raise ValueError(
                f"throttle.baseline_weight must be in (0, 1], got {self.baseline_weight}"
            )


@dataclass
class ThrottleDetector:
    """Names throttled ranks (see the module docstring); thresholds in `settings`."""

    settings: ThrottleSettings = field(default_factory=ThrottleSettings)
    kind: ClassVar[str] = "throttle"
    _ranks: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64), repr=False)

    def __post_init__(self) -> None:
        self._reset(np.zeros(0, np.int64))

    def _reset(self, ranks: np.ndarray) -> None:
        n = len(ranks)
        self._ranks = ranks.copy()
        self._hits = np.zeros((self.settings.window, n), bool)
        self._count = np.zeros(n, np.int64)
        self._pos = 0
        self._baseline = np.full(n, math.nan)  # clock / fleet median, moving average
        self._history = np.zeros(n, np.int64)
        self._low_run = np.zeros(n, np.int64)
        self._flagged = np.zeros(n, bool)

    def observe(self, s: StepView) -> list[Alert]:
        cfg = self.settings
        r = s.ranks
        if r is None or len(r) < 2:
            return []
        if not np.array_equal(self._ranks, r.rank):
            self._reset(r.rank)
        reasons = r.throttle_reasons
        has = np.isfinite(reasons)
        bits = np.where(has, reasons, 0).astype(np.int64) & cfg.reasons_mask
        self._count -= self._hits[self._pos]
        self._hits[self._pos] = bits != 0
        self._count += self._hits[self._pos]
        self._pos = (self._pos + 1) % cfg.window
        persistent = self._count >= cfg.min_hits
        if persistent.mean() >= cfg.max_fleet_fraction:
            persistent[:] = False  # most of the fleet: a policy, not one bad device
        ratio = self._clock_ratio(r.sm_clock_mhz)
        clock_low = self._low_run >= cfg.clock_steps
        suspect = persistent | clock_low
        new = np.flatnonzero(suspect & ~self._flagged)
        self._flagged = suspect | (self._flagged & ((self._count > 0) | (self._low_run > 0)))
        if not len(new):
            return []
        first = int(new[0])
        parts = []
        if persistent[first]:
            names = ", ".join(decode(int(bits[first]))) or "a masked reason"
            parts.append(
                f"NVML reports {names} (reasons 0x{int(reasons[first]):x}) in "
                f"{self._count[first]} of its last {cfg.window} logged steps, while "
                f"{int(persistent.sum()) - 1} of the other {len(r) - 1} ranks are throttled"
            )
        value = baseline = None
        if clock_low[first]:
            fleet = float(np.nanmedian(r.sm_clock_mhz))
            value = float(r.sm_clock_mhz[first])
            baseline = float(self._baseline[first]) * fleet
            drop = 1 - ratio[first] / self._baseline[first]
            parts.append(
                f"its SM clock {value:.0f} MHz is {100 * drop:.0f}% "
                f"below its own baseline {baseline:.0f} MHz for {self._low_run[first]} logged "
                f"steps, while the fleet's median is {fleet:.0f} MHz"
            )
        ids = r.rank[new].tolist()
        return [
            Alert.at(
                s,
                kind=self.kind,
                severity="warning",
                message=(
                    f"{name_ranks(s.run, ids)} throttled at step {s.step}"
                    + ("" if len(ids) == 1 else f"; {name_rank(s.run, ids[0])}")
                    + ": "
                    + "; ".join(parts)
                    + ". It slows the whole synchronous job; check its cooling, power "
                    "capping and the node's power supply. Data: "
                    + data_query(s.run_id, "ranks", "sm_clock_mhz", s.step - cfg.window, s.step)
                ),
                value=value,
                baseline=baseline,
                rank=ids[0],
            )
        ]

    def _clock_ratio(self, clock: np.ndarray) -> np.ndarray:
        """Each rank's clock over the fleet median; updates the baselines and low runs."""
        cfg = self.settings
        ok = np.isfinite(clock) & (clock > 0)
        if ok.sum() < 2:
            return np.full(len(clock), math.nan)
        ratio = np.where(ok, clock / fast_median(clock[ok]), math.nan)
        ready = self._history >= cfg.min_history
        with np.errstate(invalid="ignore"):
            low = ok & ready & (ratio < self._baseline * (1 - cfg.clock_drop))
        self._low_run = np.where(low, self._low_run + 1, 0)
        learn = ok & ~low
        first = learn & (self._history == 0)
        self._baseline[first] = ratio[first]
        more = learn & ~first
        self._baseline[more] += cfg.baseline_weight * (ratio[more] - self._baseline[more])
        self._history += learn
        return ratio
