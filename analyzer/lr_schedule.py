"""The learning-rate schedule: when a rising loss is expected, not a fault.

A cyclic schedule (SGDR, Loshchilov & Hutter 2017) sends the learning rate back up to a
peak it has used before; the loss then rises for a while and falls again. The loss
detectors stay quiet for a grace period after such a restart.

A warm-up climbs to peaks never seen before, and the loss may rise with it too (it lags
the learning rate by tens of steps). That is also where a too-high learning rate makes a
run diverge, so the detectors are not paused there: the divergence detector only asks for
more evidence (the gradient norm's growth) while the learning rate is at a new peak or
was within a grace period. A warm-up comes before the schedule's decay: once the learning
rate has fallen to `_DECAYED` of its peak, a climb to new peaks is no warm-up but a
runaway (the learning rate tipping a run into divergence, a bad config, a schedule
resumed wrong), and the loss that rises with it is judged as any other. On the reference
trainer, a learning rate growing 2% a step from step 150 (past its peak, decaying) took
the loss up 25-50% over 250 steps while its gradient norm fell; read as a warm-up that
never ended, it raised no `loss_diverging` (bench/real_divergence.py). A learning rate
far above anything the run used during a warm-up (an injected 30x step) is a new peak
too: a divergence it causes is flagged once the gradient norm grows with it, or on the
loss alone after the grace period.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# A restart may return to the run's earlier peak give or take rounding and small
# schedule changes (a restart peak slightly above the last one); 5% covers those, while a
# runaway learning rate is many times the peak.
_PEAK_TOLERANCE = 0.05
# A new peak must clear the old by this fraction: rounding of a constant learning rate is
# no warm-up (a linear warm-up over 1,000 logged steps still rises by 0.1% a step).
_NEW_PEAK = 1e-3
# The warm-up is over once the learning rate fell below this share of its peak: a decay
# under way (cosine, linear, step, WSD's decay), not a constant one's rounding.
_DECAYED = 0.9


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


@dataclass
class WarmUp:
    """Whether the learning rate is warming up: at a logged step where it rose above every
    earlier one (by 0.1%), or within `grace_steps` logged steps after such a step, until
    it first decayed (fell under `_DECAYED` of its peak): a new peak after that is not a
    warm-up. An unreported learning rate (NaN) changes nothing."""

    grace_steps: int
    _peak_lr: float = 0.0
    _left: int = 0
    _decayed: bool = False

    def is_warming(self, lr: float) -> bool:
        if math.isfinite(lr) and lr < _DECAYED * self._peak_lr:
            self._decayed = True
        if math.isfinite(lr) and lr > self._peak_lr * (1 + _NEW_PEAK):
            self._peak_lr = lr
            if not self._decayed:
                self._left = self.grace_steps
                return True
        if self._left > 0:
            self._left -= 1
            return True
        return False
