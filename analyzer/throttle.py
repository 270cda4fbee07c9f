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

import numpy as np

from .alerts import Alert
from .detectors import data_query, name_ranks
from .rolling import median as fast_median
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


@dataclass
class ThrottleDetector:
    reasons_mask: int = DEFAULT_MASK
    window: int = 10
    min_hits: int = 8
    max_fleet_fraction: float = 0.5
    clock_drop: float = 0.10
    clock_steps: int = 5
    baseline_weight: float = 0.05
    min_history: int = 10
    kind: str = "throttle"
    _ranks: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64), repr=False)

    def __post_init__(self) -> None:
        if not 1 <= self.min_hits <= self.window or self.clock_steps < 1:
            raise ValueError("ThrottleDetector: need 1 <= min_hits <= window, clock_steps >= 1")
        if not 0 < self.clock_drop < 1 or not 0 < self.baseline_weight <= 1:
            raise ValueError("ThrottleDetector: clock_drop and baseline_weight in (0, 1)")
        self._reset(np.zeros(0, np.int64))

    def _reset(self, ranks: np.ndarray) -> None:
        n = len(ranks)
        self._ranks = ranks.copy()
        self._hits = np.zeros((self.window, n), bool)
        self._count = np.zeros(n, np.int64)
        self._pos = 0
        self._baseline = np.full(n, math.nan)  # clock / fleet median, moving average
        self._history = np.zeros(n, np.int64)
        self._low_run = np.zeros(n, np.int64)
        self._flagged = np.zeros(n, bool)

    def observe(self, s: StepView) -> list[Alert]:
        r = s.ranks
        if r is None or len(r) < 2:
            return []
        if not np.array_equal(self._ranks, r.rank):
            self._reset(r.rank)
        reasons = r.throttle_reasons
        has = np.isfinite(reasons)
        bits = np.where(has, reasons, 0).astype(np.int64) & self.reasons_mask
        self._count -= self._hits[self._pos]
        self._hits[self._pos] = bits != 0
        self._count += self._hits[self._pos]
        self._pos = (self._pos + 1) % self.window
        persistent = self._count >= self.min_hits
        if persistent.mean() >= self.max_fleet_fraction:
            persistent[:] = False  # most of the fleet: a policy, not one bad device
        ratio = self._clock_ratio(r.sm_clock_mhz)
        clock_low = self._low_run >= self.clock_steps
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
                f"{self._count[first]} of its last {self.window} logged steps, while "
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
                    f"{name_ranks(ids)} throttled at step {s.step}: rank {ids[0]}: "
                    + "; ".join(parts)
                    + ". It slows the whole synchronous job; check its cooling, power "
                    "capping and the node's power supply. Data: "
                    + data_query(s.run_id, "ranks", "sm_clock_mhz", s.step - self.window, s.step)
                ),
                value=value,
                baseline=baseline,
                rank=ids[0],
            )
        ]

    def _clock_ratio(self, clock: np.ndarray) -> np.ndarray:
        """Each rank's clock over the fleet median; updates the baselines and low runs."""
        ok = np.isfinite(clock) & (clock > 0)
        if ok.sum() < 2:
            return np.full(len(clock), math.nan)
        ratio = np.where(ok, clock / fast_median(clock[ok]), math.nan)
        ready = self._history >= self.min_history
        with np.errstate(invalid="ignore"):
            low = ok & ready & (ratio < self._baseline * (1 - self.clock_drop))
        self._low_run = np.where(low, self._low_run + 1, 0)
        learn = ok & ~low
        first = learn & (self._history == 0)
        self._baseline[first] = ratio[first]
        more = learn & ~first
        self._baseline[more] += self.baseline_weight * (ratio[more] - self._baseline[more])
        self._history += learn
        return ratio
