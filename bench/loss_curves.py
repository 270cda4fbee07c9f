"""Loss detectors on loss-curve families that trainvitals' simulator does not make.

Each family is generated here, with seeds, as a user would see curves: a power-law
training loss with log-normal multiplicative noise (1-5% per step), a gradient norm that
falls early and then wanders (5-20% noise, partly correlated with the loss's: a hard
batch raises both), a warm-up then cosine learning rate, and benign one-step bumps (a
hard batch, 1 step in 250: loss x 1.03-1.15, gradient norm x 1.0-1.5). On top:

clean (every alert is false)
  drifting_noise   the loss's (and gradient norm's) noise drifts from one level to another
                   (each 1-5%) over the run
  plateau          the loss flattens early and stays flat, with later a second descent of
                   5-15% over 50-200 steps
  warm_restarts    SGDR: the learning rate returns to its (decaying) peak every 200-800
                   steps; the loss rises with it by 10-40% within 5-30 steps, then falls;
                   the gradient norm jumps 1.5-3x at the restart and decays in 3-15 steps
  data_shift       1-3 abrupt level changes of the loss of up to +-5% (a new data order or
                   mix), the gradient norm's level up to +-10%
  fast_fall        a loss falling from 8-11 to 2-3.5 within the first 5-50 steps' time
                   constant, the gradient norm falling with it
positive (labelled)
  slow_climb       from an onset at 30-60% of the run, the loss climbs by 10-100% over
                   100-1,000 steps (linear in log) and stays up; the gradient norm grows by
                   the loss's growth to a power of 0-4 (0: a data problem, flat gradients)
  fast_divergence  from an onset at 30-70% of the run, the loss climbs from its level (~3)
                   to 30-50 within 100-400 steps (log-loss ~ t^p, p in 1-2: steady or
                   accelerating), the gradient norm 50-200x with the same shape
  small_spikes     3-6 spikes per run of +12-30% for 1 or 2 steps, the gradient norm 2-5x
                   on those steps

Every run is 1,000-5,000 steps, all logged, and goes through the analyzer that
`trainvitals analyze` runs (offline.step_detectors), twice: with the grad_norm and lr
columns (as trainvitals' hooks report them) and with the loss alone.

Scoring: a divergence is found by a `loss_diverging` alert at or after its onset (latency
= alert step - onset; the issue's target: within 50 steps); a spike by a `loss_spike`
within 2 steps of it. An alert is false unless it finds a positive or falls inside a
divergence (from its onset on: a spike alert during a climb is a knock-on effect). False
alerts are counted per 10,000 steps of all runs. The headline (last line) is the run
with grad_norm and lr; it gives the latency from onset of every divergence, and of those
detectable by the deadline (oracle z >= DETECTABLE_Z, below).

For a divergence found late, its note gives the climb at onset+50 (without noise) and the
oracle z (oracle_z): how far those 50 steps stand out of the noise for a test that knows
the onset and the exact shape. Small as it often is, it says what no detector can do.

    python bench/loss_curves.py --out bench/results/loss_curves.txt

Two seed sets: TUNING (1000-1009 and 2000-2009; the defaults were chosen looking at these,
and at seeds 1-6 before) and HELD_OUT (4000-4019, scored after the defaults were fixed;
docs/benchmarks.md says how many times).
The last line, the headline, is the held-out set with grad_norm and lr. `--set
SECTION.FIELD=VALUE` tries another setting (on the tuning set: `--only tuning`).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa

from trainvitals.analyzer import Analyzer
from trainvitals.analyzer.config import AnalyzerConfig
from trainvitals.analyzer.offline import step_detectors

REPO = Path(__file__).resolve().parent.parent
DEADLINE_STEPS = 50  # the target for a divergence
ORACLE_BARS = (3.0, 5.0)  # oracle z levels at which divergences are counted (oracle_z)
# A divergence whose first DEADLINE_STEPS steps reach this oracle z is "detectable" by the
# deadline: a detector scanning thousands of steps for an unknown onset at a few false
# alerts per 100,000 steps needs about 4-5 (oracle_z); below it the target is out of reach.
DETECTABLE_Z = 5.0
# The largest level change of a clean curve's data-order shift (data_shift), in log: a climb
# no larger than this at the deadline cannot be told from one by its size.
SHIFT_LOSS, SHIFT_GRAD = 0.05, 0.10
SPIKE_WINDOW_STEPS = 2  # a spike of 1-2 steps is found at its first step or just after


@dataclass
class Positive:
    kind: str  # "divergence" or "spike"
    step: int  # onset (divergence) or first spike step
    label: str
    visible: int = 0  # divergence: first step at which the climb (without noise) is +10%
    # divergence: the climb alone (without noise or the base curve), in log, of the loss
    # and of the gradient norm over the steps onset+1 .. onset+DEADLINE_STEPS
    loss_climb: np.ndarray | None = None
    grad_climb: np.ndarray | None = None


@dataclass(frozen=True)
class Noise:
    """The log-normal noise a curve was drawn with: standard deviations of one step's
    log-loss and log gradient norm (means over the run) and their correlation."""

    loss_sigma: float = 0.0
    grad_sigma: float = 0.0
    rho: float = 0.0


@dataclass
class Curve:
    family: str
    seed: int
    loss: np.ndarray
    grad_norm: np.ndarray
    lr: np.ndarray
    positives: list[Positive] = field(default_factory=list)
    noise: Noise = Noise()


# ---------------------------------------------------------------------------- generation


def _base(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(loss, grad norm, lr) without noise: a power-law fall, an early-falling gradient
    norm, linear warm-up then cosine decay to a tenth of the peak."""
    t = np.arange(n, dtype=float)
    loss = rng.uniform(1.5, 3.0) + rng.uniform(1.0, 6.0) * (1 + t / rng.uniform(20, 300)) ** (
        -rng.uniform(0.3, 1.0)
    )
    grad = rng.uniform(0.2, 2.0) * (1 + rng.uniform(0.5, 4.0) * np.exp(-t / rng.uniform(20, 200)))
    peak, warm = rng.uniform(1e-4, 1e-3), int(rng.integers(50, 300))
    decay = np.clip((t - warm) / max(1, n - warm), 0, 1)
    lr = np.where(
        t < warm, peak * (t + 1) / warm, peak * (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * decay)))
    )
    return loss, grad, lr


def _noise(
    rng: np.random.Generator, n: int, loss_sigma: np.ndarray | float, grad_sigma: float
) -> tuple[np.ndarray, np.ndarray, Noise]:
    """Multiplicative log-normal noise factors for loss and gradient norm, correlated."""
    rho = rng.uniform(0.2, 0.7)
    z1, z2 = rng.standard_normal(n), rng.standard_normal(n)
    zg = rho * z1 + math.sqrt(1 - rho * rho) * z2
    ratio = grad_sigma / np.mean(loss_sigma)  # the gradient norm is the noisier
    noise = Noise(float(np.mean(loss_sigma)), float(grad_sigma), float(rho))
    return np.exp(loss_sigma * z1), np.exp(np.asarray(loss_sigma) * ratio * zg), noise


def _bumps(rng: np.random.Generator, loss: np.ndarray, grad: np.ndarray, start: int = 50) -> None:
    """Benign one-step bumps (hard batches), 1 step in 250, in place."""
    n = len(loss)
    hit = np.flatnonzero(rng.random(n) < 1 / 250)
    hit = hit[hit >= start]
    loss[hit] *= rng.uniform(1.03, 1.15, len(hit))
    grad[hit] *= rng.uniform(1.0, 1.5, len(hit))


def _noisy(rng: np.random.Generator, loss, grad, loss_sigma=None, grad_sigma=None):
    """(noisy loss, noisy gradient norm, the noise's parameters)."""
    n = len(loss)
    ls = rng.uniform(0.01, 0.05) if loss_sigma is None else loss_sigma
    gs = rng.uniform(0.05, 0.2) if grad_sigma is None else grad_sigma
    nl, ng, noise = _noise(rng, n, ls, gs)
    loss, grad = loss * nl, grad * ng
    _bumps(rng, loss, grad)
    return loss, grad, noise


def drifting_noise(rng: np.random.Generator, n: int) -> Curve:
    loss, grad, lr = _base(rng, n)
    s0, s1 = rng.uniform(0.01, 0.05, 2)
    sigma = s0 * (s1 / s0) ** (np.arange(n) / n)
    loss, grad, noise = _noisy(rng, loss, grad, loss_sigma=sigma)
    return Curve("drifting_noise", 0, loss, grad, lr, noise=noise)


def plateau(rng: np.random.Generator, n: int) -> Curve:
    t = np.arange(n, dtype=float)
    _, grad, lr = _base(rng, n)
    loss = rng.uniform(1.5, 3.0) + rng.uniform(1.0, 6.0) * np.exp(-t / rng.uniform(10, 50))
    at, width = rng.uniform(0.3 * n, 0.8 * n), rng.uniform(50, 200)
    loss *= 1 - rng.uniform(0.05, 0.15) / (1 + np.exp(-(t - at) / (width / 6)))
    loss, grad, noise = _noisy(rng, loss, grad)
    return Curve("plateau", 0, loss, grad, lr, noise=noise)


def warm_restarts(rng: np.random.Generator, n: int) -> Curve:
    t = np.arange(n)
    loss, grad, _ = _base(rng, n)
    cycle, gamma, peak = int(rng.integers(200, 800)), rng.uniform(0.7, 1.0), 1e-3
    k, phase = t // cycle, (t % cycle) / cycle
    lr = peak * gamma**k * (0.05 + 0.95 * 0.5 * (1 + np.cos(np.pi * phase)))
    lr[: min(100, cycle)] = np.linspace(peak / 100, peak, min(100, cycle))  # warm-up
    tc, smooth = rng.uniform(5, 30), np.empty(n)
    smooth[0] = lr[0]
    for i in range(1, n):  # the loss follows the learning rate with a lag
        smooth[i] = smooth[i - 1] + (lr[i] - smooth[i - 1]) / tc
    loss = loss * (1 + rng.uniform(0.1, 0.4) * smooth / peak)
    since = t % cycle
    kick = np.where(k > 0, rng.uniform(0.5, 2.0) * np.exp(-since / rng.uniform(3, 15)), 0.0)
    grad = grad * (1 + kick)
    loss, grad, noise = _noisy(rng, loss, grad)
    return Curve("warm_restarts", 0, loss, grad, lr, noise=noise)


def data_shift(rng: np.random.Generator, n: int) -> Curve:
    loss, grad, lr = _base(rng, n)
    for at in rng.integers(n // 5, n, int(rng.integers(1, 4))):
        loss[at:] *= math.exp(rng.uniform(-SHIFT_LOSS, SHIFT_LOSS))
        grad[at:] *= math.exp(rng.uniform(-SHIFT_GRAD, SHIFT_GRAD))
    loss, grad, noise = _noisy(rng, loss, grad)
    return Curve("data_shift", 0, loss, grad, lr, noise=noise)


def fast_fall(rng: np.random.Generator, n: int) -> Curve:
    t = np.arange(n, dtype=float)
    _, _, lr = _base(rng, n)
    floor = rng.uniform(2.0, 3.5)
    tau = rng.uniform(5, 50)
    loss = floor + (rng.uniform(8, 11) - floor) * np.exp(-t / tau)
    grad = rng.uniform(0.2, 2.0) * (1 + rng.uniform(3, 20) * np.exp(-t / tau))
    loss, grad, noise = _noisy(rng, loss, grad)
    return Curve("fast_fall", 0, loss, grad, lr, noise=noise)


def slow_climb(rng: np.random.Generator, n: int) -> Curve:
    loss, grad, lr = _base(rng, n)
    rise, span = rng.uniform(0.1, 1.0), int(rng.integers(100, 1001))
    onset = int(rng.uniform(0.3, 0.6) * n)
    n = max(n, onset + span + 200)  # the run goes on past the climb's top
    loss, grad, lr = _base_extended(rng, loss, grad, lr, n)
    frac = np.clip((np.arange(n) - onset) / span, 0, 1)
    power = rng.uniform(0, 4)
    climb = math.log1p(rise) * frac
    loss = loss * np.exp(climb)
    grad = grad * np.exp(power * climb)
    loss, grad, noise = _noisy(rng, loss, grad)
    label = f"+{rise:.0%} over {span} steps, grad x{(1 + rise) ** power:.2g}"
    visible = _first(climb >= math.log1p(0.1))
    early = climb[onset + 1 : onset + 1 + DEADLINE_STEPS]
    positive = Positive("divergence", onset, label, visible, early, power * early)
    return Curve("slow_climb", 0, loss, grad, lr, [positive], noise)


def _first(hit: np.ndarray) -> int:
    """First index where `hit` holds; len(hit) if it never does."""
    where = np.flatnonzero(hit)
    return int(where[0]) if len(where) else len(hit)


def _base_extended(rng, loss, grad, lr, n):
    """The base curves continued to `n` steps at their last values' trend (flat)."""
    if n == len(loss):
        return loss, grad, lr
    pad = n - len(loss)
    return (
        np.r_[loss, np.full(pad, loss[-1])],
        np.r_[grad, np.full(pad, grad[-1])],
        np.r_[lr, np.full(pad, lr[-1])],
    )


def fast_divergence(rng: np.random.Generator, n: int) -> Curve:
    loss, grad, lr = _base(rng, n)
    onset = int(rng.uniform(0.3, 0.7) * n)
    span, shape = int(rng.integers(100, 401)), rng.uniform(1.0, 2.0)
    end = min(n, onset + span + 10)  # a user stops the run soon after
    loss, grad, lr = loss[:end], grad[:end], lr[:end]
    frac = np.clip((np.arange(end) - onset) / span, 0, 1) ** shape
    top = rng.uniform(30, 50)
    climb = math.log(top / loss[onset]) * frac
    grad_climb = math.log(rng.uniform(50, 200)) * frac
    loss = loss * np.exp(climb)
    grad = grad * np.exp(grad_climb)
    loss, grad, noise = _noisy(rng, loss, grad)
    label = f"{loss[onset]:.3g} -> {top:.0f} over {span} steps, shape t^{shape:.2f}"
    early = slice(onset + 1, onset + 1 + DEADLINE_STEPS)
    positive = Positive(
        "divergence", onset, label, _first(climb >= math.log1p(0.1)), climb[early],
        grad_climb[early],
    )  # fmt: skip
    return Curve("fast_divergence", 0, loss, grad, lr, [positive], noise)


def small_spikes(rng: np.random.Generator, n: int) -> Curve:
    loss, grad, lr = _base(rng, n)
    loss, grad, noise = _noisy(rng, loss, grad)
    positives = []
    count = int(rng.integers(3, 7))
    slots = np.sort(rng.choice(np.arange(200, n - 10, 150), size=count, replace=False))
    for at in slots:
        at = int(at + rng.integers(0, 100))
        width, up, jump = int(rng.integers(1, 3)), rng.uniform(1.12, 1.30), rng.uniform(2, 5)
        if at >= n:  # drawn past the run's end: not in the curve, so no positive
            continue
        loss[at : at + width] *= up
        grad[at : at + width] *= jump
        positives.append(Positive("spike", at, f"+{up - 1:.0%} x{width} steps, grad x{jump:.1f}"))
    return Curve("small_spikes", 0, loss, grad, lr, positives, noise)


CLEAN = (drifting_noise, plateau, warm_restarts, data_shift, fast_fall)
POSITIVE = (slow_climb, fast_divergence, small_spikes)


# Seed sets. The detectors' defaults were chosen looking at TUNING only (and at seeds 1-6
# before); HELD_OUT is scored after, with nothing changed, and is the headline.
TUNING = (*range(1000, 1010), *range(2000, 2010))
HELD_OUT = tuple(range(4000, 4020))


def make_curves(seeds: list[int] | tuple[int, ...]) -> list[Curve]:
    curves = []
    for i, family in enumerate(CLEAN + POSITIVE):
        for seed in seeds:
            rng = np.random.default_rng([seed, i])
            curve = family(rng, int(rng.integers(1000, 5001)))
            curve.seed = seed
            curves.append(curve)
    return curves


# ---------------------------------------------------------------------------- scoring


def oracle_z(p: Positive, noise: Noise, with_grad: bool) -> float:
    """How far the first DEADLINE_STEPS steps of a climb stand out of the noise for a test
    that knows its onset and exact shape: sqrt(sum_i s_i' C^-1 s_i), s_i the climb of
    (log-loss, log gradient norm) at onset+i, C their noise covariance (a matched filter;
    Neyman-Pearson's most powerful test of a known signal in white Gaussian noise). No
    detector does better; one that must scan thousands of steps for an unknown onset at
    a few false alerts per 100,000 steps needs about 4-5 of it."""
    lc, gc = p.loss_climb, p.grad_climb
    sl, sg, rho = noise.loss_sigma, noise.grad_sigma, noise.rho
    if not with_grad:
        return float(np.sqrt(np.sum(lc**2)) / sl)
    det = (1 - rho * rho) * sl * sl * sg * sg
    q = (sg * sg * lc**2 - 2 * rho * sl * sg * lc * gc + sl * sl * gc**2) / det
    return float(np.sqrt(np.sum(q)))


def analyze(curve: Curve, with_grad: bool, config: AnalyzerConfig) -> list:
    n = len(curve.loss)
    missing = pa.nulls(n, pa.float64())
    steps = pa.table(
        {
            "step": np.arange(n),
            "time_unix_s": np.arange(n, dtype=float),
            "loss": curve.loss,
            "grad_norm": curve.grad_norm if with_grad else missing,
            "lr": curve.lr if with_grad else missing,
        }
    )
    alerts = Analyzer(lambda: step_detectors(config)).observe(
        f"{curve.family}-{curve.seed}", {"steps": steps}
    )
    return [a for a in alerts if not a.resolves]


@dataclass
class Score:
    found: dict = field(default_factory=lambda: defaultdict(int))  # family -> positives found
    total: dict = field(default_factory=lambda: defaultdict(int))
    false: dict = field(default_factory=lambda: defaultdict(int))
    steps: dict = field(default_factory=lambda: defaultdict(int))
    latencies: list = field(default_factory=list)  # (latency, curve, label) of divergences
    oracle: list = field(default_factory=list)  # (oracle z at the deadline, latency)
    small: list = field(default_factory=list)  # latencies of climbs no larger than a shift
    after_visible: list = field(default_factory=list)  # steps after the climb reached +10%
    onset_errors: list = field(default_factory=list)  # alert's start_step - true onset
    notes: list = field(default_factory=list)


def score(curve: Curve, alerts: list, out: Score, with_grad: bool) -> None:
    fam = curve.family
    out.steps[fam] += len(curve.loss)
    used = set()
    for p in curve.positives:
        out.total[fam] += 1
        if p.kind == "divergence":
            hits = [a for a in alerts if a.kind == "loss_diverging" and a.step >= p.step]
        else:
            hits = [
                a
                for a in alerts
                if a.kind == "loss_spike" and p.step <= a.step <= p.step + SPIKE_WINDOW_STEPS
            ]
        if hits:
            out.found[fam] += 1
            used.add(id(hits[0]))
        if p.kind == "divergence":
            latency = hits[0].step - p.step if hits else None
            out.latencies.append((latency, f"{fam} seed {curve.seed}", p.label))
            z = oracle_z(p, curve.noise, with_grad)
            out.oracle.append((z, latency))
            if p.loss_climb[-1] <= SHIFT_LOSS and (not with_grad or p.grad_climb[-1] <= SHIFT_GRAD):
                out.small.append(latency)
            if hits:
                out.after_visible.append(hits[0].step - p.visible)
                out.onset_errors.append(hits[0].start_step - p.step)
            if latency is None or latency > DEADLINE_STEPS:
                when = "missed" if latency is None else f"found {latency} steps after onset"
                out.notes.append(
                    f"{fam} seed {curve.seed}: {p.label}, onset {p.step}, +10% at "
                    f"{p.visible}: {when}; at onset+{DEADLINE_STEPS} the climb was loss "
                    f"{math.expm1(p.loss_climb[-1]):+.1%}, gradient norm "
                    f"{math.expm1(p.grad_climb[-1]):+.0%} (noise per step "
                    f"{curve.noise.loss_sigma:.1%}, {curve.noise.grad_sigma:.0%}), oracle z "
                    f"{z:.1f}"
                )
        elif not hits:
            out.notes.append(f"{fam} seed {curve.seed}: spike {p.label} at {p.step}: missed")
    onsets = [p.step for p in curve.positives if p.kind == "divergence"]
    for a in alerts:
        if id(a) in used or (onsets and a.step >= min(onsets)):
            continue
        out.false[fam] += 1
        out.notes.append(
            f"{fam} seed {curve.seed}: FALSE {a.kind} at step {a.step}: {a.message[:160]}"
        )


def report(curves: list[Curve], with_grad: bool, config: AnalyzerConfig, title: str) -> list[str]:
    s = Score()
    for c in curves:
        score(c, analyze(c, with_grad, config), s, with_grad)
    what = f"{title}, " + ("loss, grad_norm and lr" if with_grad else "loss alone")
    lines = [f"== {what} =="]
    for fam in dict.fromkeys(c.family for c in curves):
        pos = f"recall {s.found[fam]}/{s.total[fam]}" if s.total[fam] else "clean"
        per = 1e4 * s.false[fam] / s.steps[fam]
        lines.append(
            f"{fam:16s} {s.steps[fam]:7d} steps  {pos:14s} false alerts {s.false[fam]:3d} "
            f"({per:.2f} per 10,000 steps)"
        )
    lat = sorted(x for x, _, _ in s.latencies if x is not None)
    within = sum(1 for x in lat if x <= DEADLINE_STEPS)
    if lat:
        lines.append(
            f"divergence latency (steps after onset): median {lat[len(lat) // 2]}, "
            f"worst {lat[-1]}; within {DEADLINE_STEPS}: {within}/{len(s.latencies)}"
        )
        seen = sorted(s.after_visible)
        lines.append(
            f"divergence latency after the climb (without noise) reached +10%: median "
            f"{seen[len(seen) // 2]}, worst {seen[-1]}"
        )
        errors = sorted(s.onset_errors)
        lines.append(
            f"onset named (start_step - true onset): median {errors[len(errors) // 2]:+d}, "
            f"range {errors[0]:+d} .. {errors[-1]:+d} steps"
        )
        quick = sum(1 for lat in s.small if lat is not None and lat <= DEADLINE_STEPS)
        grad = f", gradient norm <= {SHIFT_GRAD:+.0%}" if with_grad else ""
        lines.append(
            f"divergences no larger at onset+{DEADLINE_STEPS} than a clean data-order shift "
            f"(loss <= {SHIFT_LOSS:+.0%}{grad}): {len(s.small)}/{len(s.oracle)}, flagged "
            f"within {DEADLINE_STEPS}: {quick}"
        )
        for bar in ORACLE_BARS:
            able = [lat for z, lat in s.oracle if z >= bar]
            quick = sum(1 for lat in able if lat is not None and lat <= DEADLINE_STEPS)
            lines.append(
                f"divergences whose first {DEADLINE_STEPS} steps reach oracle z >= {bar:g}: "
                f"{len(able)}/{len(s.oracle)}, flagged within {DEADLINE_STEPS}: {quick}"
            )
    lines += [f"  note: {n}" for n in s.notes]
    found, total = sum(s.found.values()), sum(s.total.values())
    false, steps = sum(s.false.values()), sum(s.steps.values())
    worst = "none found" if not lat else f"{lat[-1]}"
    missed = len(s.latencies) - len(lat)
    lines.append(
        f"{what}: recall {found / total:.3f} ({found}/{total}), false alerts "
        f"{1e4 * false / steps:.2f} per 10,000 steps ({false} in {steps:,} steps), worst "
        f"divergence latency {worst} steps{f' ({missed} missed)' if missed else ''}, "
        f"within {DEADLINE_STEPS} steps of onset: {within}/{len(s.latencies)}, "
        f"{_detectable(s.oracle)}"
    )
    return lines


def _detectable(oracle: list) -> str:
    """Latency restricted to the divergences detectable by the deadline: those whose first
    DEADLINE_STEPS steps reach oracle z >= DETECTABLE_Z."""
    able = sorted(lat if lat is not None else math.inf for z, lat in oracle if z >= DETECTABLE_Z)
    if not able:
        return f"none detectable (oracle z >= {DETECTABLE_Z:g})"
    quick = sum(1 for lat in able if lat <= DEADLINE_STEPS)
    median = able[len(able) // 2]
    return (
        f"of those detectable at onset+{DEADLINE_STEPS} (oracle z >= {DETECTABLE_Z:g}): "
        f"{quick}/{len(able)}, median latency "
        + ("(missed)" if median == math.inf else f"{median:.0f}")
        + " steps"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--seeds", type=int, default=0, help="runs per family from --first-seed, instead of "
        "the tuning and held-out sets",
    )  # fmt: skip
    p.add_argument("--first-seed", type=int, default=1000)
    p.add_argument("--only", choices=("tuning", "held-out"), help="score one of the two seed sets")
    p.add_argument(
        "--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
        help="a detector setting other than its default (analyzer/config.py)",
    )  # fmt: skip
    p.add_argument("--out", default="", help="also write the output here")
    args = p.parse_args()
    try:
        config = AnalyzerConfig.load(overrides=args.set)
    except ValueError as e:  # a bad --set: a usage error, not a traceback
        p.error(str(e))
    if args.seeds:
        sets = {f"seeds {args.first_seed}-{args.first_seed + args.seeds - 1}": range(
            args.first_seed, args.first_seed + args.seeds)}  # fmt: skip
    else:
        sets = {"tuning": TUNING, "held-out": HELD_OUT}
        if args.only:
            sets = {args.only: sets[args.only]}
    command = " ".join(["python bench/loss_curves.py", *sys.argv[1:]])
    lines = [f"$ {command}"]
    for title, seeds in sets.items():
        curves = make_curves(seeds)
        lines.append(f"{title}: {len(curves)} runs, {len(seeds)} seeds per family ({_span(seeds)})")
        lines += [*report(curves, False, config, title), ""]
        lines += [*report(curves, True, config, title), ""]
    lines.pop()
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


def _span(seeds) -> str:
    """1000-1009, 2000-2009: a list of seeds as runs of consecutive ones."""
    runs, seeds = [], sorted(seeds)
    start = prev = seeds[0]
    for x in [*seeds[1:], None]:
        if x is not None and x == prev + 1:
            prev = x
            continue
        runs.append(f"{start}-{prev}" if prev != start else f"{start}")
        if x is not None:
            start = prev = x
    return ", ".join(runs)


if __name__ == "__main__":
    main()
