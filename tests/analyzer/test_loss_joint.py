"""Small loss spikes judged on the loss's and the gradient norm's evidence together, over
one step or two; a loss that rises with a learning-rate warm-up is no divergence unless
the gradient norm grows too."""

from __future__ import annotations

import math
import random
from pathlib import Path

import numpy as np
import pytest

from trainvitals.analyzer.detectors import LossSpikeDetector, LossSpikeSettings
from trainvitals.analyzer.divergence import DivergenceDetector, DivergenceSettings
from trainvitals.analyzer.lr_schedule import WarmUp
from trainvitals.analyzer.views import StepView


def _series(
    n: int, seed: int, loss_noise: float, grad_noise: float
) -> tuple[list[float], list[float]]:
    """(loss, grad norm): a loss near 3 and a gradient norm near 1, log-normal noise."""
    rng = random.Random(seed)
    loss = [3.0 * math.exp(rng.gauss(0, loss_noise)) for _ in range(n)]
    grad = [math.exp(rng.gauss(0, grad_noise)) for _ in range(n)]
    return loss, grad


def _spikes(loss: list[float], grad: list[float]) -> list:
    detector = LossSpikeDetector()
    out = []
    for s, (x, g) in enumerate(zip(loss, grad, strict=True)):
        out += detector.observe(StepView("r", s, float(s), x, g))
    return out


def test_a_two_step_spike_is_judged_on_both_steps_together() -> None:
    # +15% for two steps with the gradient norm 1.9x on each: neither step alone reaches
    # a 2x gradient norm; their mean is twice the evidence and clears 1.8x. (A quiet
    # gradient norm, 2% noise, keeps its level's own error well inside those margins.)
    for seed in range(5):
        loss, grad = _series(600, seed, 0.02, 0.02)
        level = sorted(grad[390:400])[5]
        for s in (400, 401):
            loss[s] *= 1.15
            grad[s] = 1.9 * level
        (alert,) = _spikes(loss, grad)
        assert alert.step == 401
        assert "over the last 2 steps" in alert.message
        # One such step alone is not enough.
        loss, grad = _series(600, seed, 0.02, 0.02)
        loss[400] *= 1.15
        grad[400] = 1.9 * level
        assert _spikes(loss, grad) == []


def test_hard_batches_on_consecutive_steps_are_no_spike() -> None:
    # A hard batch moves the loss as much as a small spike, the gradient norm by 1.5x at
    # most: on a quiet gradient norm that is many deviations, but not a 1.8x jump.
    for seed in range(5):
        loss, grad = _series(600, seed, 0.02, 0.05)
        level = sorted(grad[390:400])[5]
        for s in (400, 401):
            loss[s] *= 1.15
            grad[s] = 1.5 * level
        assert _spikes(loss, grad) == []


def test_the_gradient_norm_jump_is_judged_against_its_own_noise() -> None:
    # Loss +12% at 2% noise with the gradient norm 2.2x: a spike when the gradient norm
    # is quiet (5% noise: 2.2x is ~16 deviations), not when it is noisy (50% noise: ~1.6
    # deviations, under `joint_min_grad_z`, although with the loss's ~6 the combined z
    # would clear the joint threshold).
    found = {}
    for grad_noise in (0.05, 0.5):
        hits = 0
        for seed in range(10):
            loss, grad = _series(600, seed, 0.02, grad_noise)
            loss[400] *= 1.12
            grad[400] = 2.2 * sorted(grad[390:400])[5]
            alerts = _spikes(loss, grad)
            assert [a.step for a in alerts] in ([], [400])
            hits += len(alerts)
        found[grad_noise] = hits
    # (2 of the 10 quiet ones measure under `joint_min_rise_ratio`, 10%, over a level
    # that sits high by chance.)
    assert found == {0.05: 8, 0.5: 0}


def test_a_gradient_norm_jump_without_a_loss_rise_is_no_loss_spike() -> None:
    loss, grad = _series(600, 3, 0.02, 0.05)
    grad[400] *= 4.0
    assert _spikes(loss, grad) == []


def _warmup_run(grad_growth: float, seed: int) -> list:
    """Divergence alerts on a loss that rises by 25% with a learning rate warmed up
    linearly over steps 0-300 (the loss lags it), flat after; the gradient norm's level
    grows by `grad_growth` over the same steps."""
    rng = random.Random(seed)
    detector = DivergenceDetector()
    out, smooth = [], 0.0
    for s in range(800):
        lr = 1e-3 * min(1.0, (s + 1) / 300)
        smooth += (lr - smooth) / 20
        loss = 3.0 * (1 + 0.25 * smooth / 1e-3) * math.exp(rng.gauss(0, 0.01))
        frac = min(1.0, s / 300)
        grad = math.exp(math.log(grad_growth) * frac + rng.gauss(0, 0.05))
        out += [a for a in detector.observe(StepView("r", s, float(s), loss, grad, lr=lr))]
    return [a for a in out if not a.resolves]


def test_a_loss_rising_with_the_warm_up_is_no_divergence() -> None:
    for seed in range(3):
        assert _warmup_run(1.0, seed) == [], seed


def test_a_divergence_during_the_warm_up_is_flagged_when_the_gradient_norm_grows() -> None:
    for seed in range(3):
        (alert,) = _warmup_run(3.0, seed)
        assert alert.kind == "loss_diverging" and alert.step < 300


@pytest.mark.parametrize(
    ("lrs", "warming"),
    [
        # a warm-up: new peaks, then 2 logged steps of grace
        ([1e-4, 2e-4, 3e-4, 3e-4, 3e-4, 3e-4], [True, True, True, True, True, False]),
        # a decay is no warm-up; nor is rounding of a constant learning rate
        ([1e-3, 9e-4, 8e-4, 1e-3 * (1 + 1e-4)], [True, True, True, False]),
        # a climb to new peaks after the schedule decayed (under 90% of its peak) is a
        # runaway, not a warm-up: only the first warm-up's grace is left
        ([1e-3, 8e-4, 7e-4, 6e-4, 1.2e-3, 1.5e-3], [True, True, True, False, False, False]),
        # an unreported learning rate changes nothing
        ([math.nan, math.nan, 1e-3, math.nan, math.nan], [False, False, True, True, True]),
    ],
)
def test_warm_up_is_a_learning_rate_at_new_peaks_and_a_grace_after(
    lrs: list[float], warming: list[bool]
) -> None:
    w = WarmUp(grace_steps=2)
    assert [w.is_warming(lr) for lr in lrs] == warming


def _climb_alerts(seed: int, rise: float, shift: float = 0.0, **settings) -> list[int]:
    """Steps of loss_diverging alerts on a loss at 3 with 2% noise that, from step 500,
    climbs by `rise` (a ratio - 1) over 400 steps, linear in log, with a gradient norm
    growing by the loss's growth squared (5% noise); or moves up by `shift` at once, with a
    flat gradient norm."""
    rng = random.Random(seed)
    detector = DivergenceDetector(DivergenceSettings(**settings))
    out = []
    for s in range(1200):
        climb = math.log1p(rise) * min(1.0, max(0, s - 500) / 400)
        level = math.log1p(shift) if s >= 500 else 0.0
        loss = 3.0 * math.exp(climb + level + rng.gauss(0, 0.02))
        grad = math.exp(2 * climb + rng.gauss(0, 0.05))
        out += [
            s for a in detector.observe(StepView("r", s, float(s), loss, grad)) if not a.resolves
        ]
    return out


def test_a_slow_climb_is_flagged_sooner_by_summing_every_step() -> None:
    # +30% over 400 steps: +3.3% at onset+50, within the noise of a 10-step median for a
    # while yet; the CUSUM adds up every step's excess, the loss's and the gradient norm's.
    gains = []
    for seed in range(6):
        (summed,) = _climb_alerts(seed, 0.3)
        (level_only,) = _climb_alerts(seed, 0.3, cusum_threshold=1e9)
        assert 500 < summed <= 590 and summed < level_only, (summed, level_only)
        gains.append(level_only - summed)
    assert sorted(gains)[len(gains) // 2] >= 20, gains  # 13-55 steps sooner


def test_a_small_level_shift_with_a_flat_gradient_norm_is_no_climb() -> None:
    # +4.5%, within the allowance of a data-order shift: it accrues nothing.
    for seed in range(6):
        assert _climb_alerts(seed, 0.0, shift=0.045) == [], seed


# Steps 440-526 of a recorded clean 4-rank run of the reference trainer (dp=2 x tp=2, CPU,
# 8 busy processes on 2 cores): loss noise about 6% a step, a gradient norm that often
# doubles from one step to the next. At step 520 a hard batch: loss 1.06x, gradient norm
# 3.3x. Columns: loss, grad_norm.
REAL_RUN = Path(__file__).parent / "data" / "loaded_hard_batch.csv"


def _spike_steps(loss: list[float], grad: list[float], first_step: int = 0, **settings) -> list:
    detector = LossSpikeDetector(LossSpikeSettings(**settings))
    out = []
    for i, (x, g) in enumerate(zip(loss, grad, strict=True)):
        out += detector.observe(StepView("r", first_step + i, float(i), x, g))
    return [a.step for a in out]


def test_a_real_hard_batch_is_no_spike() -> None:
    # Loss +6%, gradient norm 3.3x: 5.8 deviations together, over the joint threshold, but
    # under the 7% rise a small spike makes. With a 5% floor it would be raised.
    loss, grad = np.loadtxt(REAL_RUN, delimiter=",").T.tolist()
    assert _spike_steps(loss, grad, first_step=440) == []
    assert _spike_steps(loss, grad, first_step=440, joint_min_rise_ratio=0.05) == [520]


# The joint rule before the gradient norm's level was a median of 15: a median of 5, a
# joint threshold of 6, no floor on the gradient norm's own deviations.
BEFORE = {"joint_z_threshold": 6.0, "grad_level_window": 5, "joint_min_grad_z": 0.0}


def test_small_spikes_on_a_noisy_gradient_norm_are_found_more_often() -> None:
    # +15% with the gradient norm 3x, on a loss with 3% noise and a gradient norm with 20%:
    # the gradient norm's level, a median of 15, misplaces it less than one of 5, and the
    # joint threshold of 5 finds more of these spikes, with no other alert.
    found, found_before = 0, 0
    for seed in range(30):
        loss, grad = _series(600, seed, 0.03, 0.2)
        loss[400] *= 1.15
        grad[400] *= 3.0
        now, before = _spike_steps(loss, grad), _spike_steps(loss, grad, **BEFORE)
        assert set(now) <= {400} and set(before) <= {400}
        found, found_before = found + len(now), found_before + len(before)
    assert (found, found_before) == (26, 21)  # (27, 22) with a 7% floor on the loss's rise


def test_a_large_spike_in_a_small_alerts_quiet_is_raised() -> None:
    # A +15% hard batch with the gradient norm 3x is alerted (the joint rule); an Adam
    # spike 2x, 10 steps later, came in that alert's quiet and went unflagged, in the blind
    # loss-curve families. A spike the loss alone makes, twice the rise, is a new episode;
    # the steps of its decay (smaller) raise nothing more.
    for seed in range(5):
        loss, grad = _series(600, seed, 0.02, 0.05)
        level = sorted(grad[390:400])[5]
        loss[400] *= 1.15
        grad[400] = 3.0 * level
        for k, factor in enumerate((2.0, 1.8, 1.5, 1.3)):
            loss[410 + k] *= factor
            grad[410 + k] = 30 * level
        assert [a.step for a in _spikes(loss, grad)] == [400, 410]


def test_where_the_gradient_norm_routinely_jumps_on_hard_batches_a_small_rise_is_no_spike() -> None:
    """Hard batches at steps 200, 300, 400: the gradient norm 2.5x, the loss +5%, no alert.
    A +12% step with the same jump at 600 is then the tail of the run's habit, not a
    spike; a +20% one is. Without the three hard batches, the +12% step is a spike; a
    fourth hard batch 3,000 steps later no longer counts."""

    def run(hard: tuple[int, ...], rise: float, at: int = 600) -> list[int]:
        loss, grad = _series(at + 50, 0, 0.01, 0.05)
        for s in (*hard, at):
            level = sorted(grad[s - 15 : s])[7]
            loss[s] *= 1 + (0.05 if s != at else rise)
            grad[s] = 2.5 * level
        return [a.step for a in _spikes(loss, grad)]

    assert run((200, 300, 400), 0.12) == []
    assert run((200, 300, 400), 0.20) == [600]
    assert run((), 0.12) == [600]
    assert run((200, 300), 0.12) == [600]  # two jumps: no habit yet
    assert run((200, 300, 400), 0.12, at=3250) == [3250]  # 200 left the window


REAL_CLEAN = Path(__file__).parent / "data" / "loaded_clean_loss.csv"


def test_a_real_runs_warm_up_jumps_are_no_habit_and_its_small_spikes_are_raised() -> None:
    """A recorded clean 1,000-step run of the reference trainer: its gradient norm jumped
    2x at 3 steps of its 100-step warm-up and 2 after. Those of the warm-up are no habit, so
    a small spike multiplied in at step 680 (+15%, the gradient norm 3x; measured +13% over
    the level of a loss that moves 5% a step) is raised. Where
    the learning rate is not reported, the warm-up cannot be told and its jumps count: the
    same spike is then the run's habit and is not raised. The clean run raises nothing
    either way."""
    loss, grad, lr = np.loadtxt(REAL_CLEAN, delimiter=",").T.tolist()

    def spikes(at: int | None, lr_reported: bool = True) -> tuple[list[int], list[int]]:
        detector = LossSpikeDetector()
        steps = []
        for s, (x, g, rate) in enumerate(zip(loss, grad, lr, strict=True)):
            x, g = (x * 1.15, g * 3) if s == at else (x, g)
            view = StepView("r", s, float(s), x, g, lr=rate if lr_reported else math.nan)
            steps += [a.step for a in detector.observe(view)]
        return steps, list(detector._routine)

    clean, habit = spikes(None)
    assert clean == [] and len(habit) == 2, habit
    assert spikes(680)[0] == [680]
    assert spikes(None, lr_reported=False)[0] == []
    without_lr, habit = spikes(680, lr_reported=False)
    assert len(habit) >= 3 and without_lr == [], (without_lr, habit)


@pytest.mark.parametrize(
    "field, value",
    [("routine_window", 0), ("routine_jumps", -1), ("routine_min_rise_ratio", 0.05),
     ("routine_warmup_grace_steps", -1)],
)  # fmt: skip
def test_routine_settings_out_of_range_are_refused_naming_the_field(field: str, value) -> None:
    with pytest.raises(ValueError, match=f"loss_spike.{field} must be"):
        LossSpikeSettings(**{field: value})
