"""Small synthetic fleets, step by step, with hooks to inject a fault into any column.

Each logged step of `fleet(...)` carries what the hooks report: a falling loss with 2%
noise, per-rank local losses and local gradient norms scattering 3-5% around it, compute
times with 3% noise, SM clocks, canary fingerprints every 10 steps, replica fingerprints
per group, and per-layer statistics with 5% noise. `fault(step, cols)` may change the
step's columns in place before the view is built: cols["steps"] (scalars),
cols["layers"] and cols["ranks"] (numpy arrays).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import numpy as np

from trainvitals.analyzer.views import LayerView, RankView, StepView

CANARY_EVERY = 10


def fleet(
    steps: int,
    ranks: int = 8,
    layers: int = 4,
    seed: int = 0,
    tp: int = 1,
    replica_groups: int = 2,
    step_s: float = 1.0,
    fault: Callable[[int, dict], None] | None = None,
) -> Iterator[StepView]:
    rng = np.random.default_rng(seed)
    speed = rng.normal(1.0, 0.01, ranks)
    clock_base = rng.normal(1980.0, 10.0, ranks)
    t = 1.7e9
    for step in range(steps):
        loss = (2.0 + 3.0 * math.exp(-step / 60)) * math.exp(rng.normal(0, 0.02))
        compute = 0.9 * step_s / speed * rng.lognormal(0, 0.03, ranks)
        cols = {
            "steps": {"loss": loss, "grad_norm": 1.0 * rng.lognormal(0, 0.05), "dt": step_s},
            "layers": {
                "grad_norm": 0.5 * rng.lognormal(0, 0.05, layers),
                "update_rms": 1e-3 * rng.lognormal(0, 0.05, layers),
                "act_rms": (1 + 0.1 * np.arange(layers)) * rng.lognormal(0, 0.02, layers),
                "act_max_abs": 20 * rng.lognormal(0, 0.1, layers),
                "nonfinite_count": np.zeros(layers),
                "act_nonfinite_count": np.zeros(layers),
            },
            "ranks": {
                "compute_time_s": compute,
                "loss": loss * rng.lognormal(0, 0.03, ranks),
                "grad_norm_local": 1.3 * rng.lognormal(0, 0.05, ranks),
                "sm_clock_mhz": clock_base - np.abs(rng.normal(0, 8, ranks)),
                "throttle_reasons": np.zeros(ranks),
                "canary_fingerprint": np.full(ranks, math.nan),
                "replica_fingerprint": np.full(ranks, math.nan),
                "replica_group": (np.arange(ranks) % replica_groups).astype(float),
            },
        }
        if step % CANARY_EVERY == 0:
            cols["ranks"]["canary_fingerprint"][:] = 1234 + step
            cols["ranks"]["replica_fingerprint"] = 1000.0 * step + cols["ranks"]["replica_group"]
        if fault is not None:
            fault(step, cols)
        r = cols["ranks"]
        end = r["compute_time_s"].max()
        r["wait_time_s"] = end - r["compute_time_s"]
        t += cols["steps"]["dt"] + end - 0.9 * step_s
        yield StepView(
            "r",
            step,
            t,
            cols["steps"]["loss"],
            cols["steps"]["grad_norm"],
            step_time_s=end,
            layers=LayerView.of(**cols["layers"]),
            ranks=RankView.of(tp=tp, **r),
        )


def run(detector, views) -> list:
    return [a for v in views for a in detector.observe(v)]
