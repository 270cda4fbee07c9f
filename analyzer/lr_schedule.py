"""Warm restarts of the learning rate: a loss that rises by design, not by fault.

A cyclic schedule (SGDR, Loshchilov & Hutter 2017) sends the learning rate back up to a
peak it has used before; the loss then rises for a while and falls again. The loss
detectors stay quiet for a grace period after such a restart. They judge everything else:
a warm-up climbs to peaks never seen before, and a learning rate far above anything the
run used (an injected 30x step, a bad config) is the kind of fault they are there for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# A restart may return to the run's earlier peak give or take rounding and small
# schedule changes (a restart peak slightly above the last one); 5% covers those, while a
# runaway learning rate is many times the peak.
_PEAK_TOLERANCE = 0.05


@dataclass
class WarmRestarts:
    """Which logged steps begin a warm restart: the learning rate rose by `rise_ratio` or
    more over the previous logged one, to at most the highest one the run used before
    (x 1.05). An unreported learning rate (NaN, 0 at the start of a warm-up) is skipped."""

    rise_ratio: float
    _last_lr: float = math.nan
    _peak_lr: float = 0.0

    def is_restart(self, lr: float) -> bool:
        if not (math.isfinite(lr) and lr > 0):
            return False
        restart = lr >= self.rise_ratio * self._last_lr and lr <= self._peak_lr * (
            1 + _PEAK_TOLERANCE
        )  # a NaN _last_lr (first reported lr) compares False
        self._last_lr = lr
        self._peak_lr = max(self._peak_lr, lr)
        return restart
