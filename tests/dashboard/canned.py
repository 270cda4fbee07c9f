"""Canned collector answers for a run that has steps only: no layer, rank or event data."""

from __future__ import annotations

from tests.dashboard.conftest import CannedCollector
from trainvitals.schema import RANKS


def steps_columns(n: int) -> dict[str, list]:
    """Columns of a steps answer for steps 0..n-1, with every field the views read."""
    return {
        "step": list(range(n)),
        "time_unix_s": [1000.0 + i for i in range(n)],
        "loss": [3.0] * n,
        "loss_max": [3.0] * n,
        "grad_norm": [1.0] * n,
        "grad_norm_max": [1.0] * n,
        "lr": [1e-3] * n,
        "tokens": [512] * n,
        "step_time_s": [1.0] * n,
        "tokens_per_s": [512.0] * n,
        "tflops_per_s_per_device": [0.1] * n,
        "mfu_ratio": [None] * n,
        "power_w": [None] * n,
        "energy_j": [None] * n,
    }


def canned_run(
    canned: CannedCollector, n_steps: int, alerts: list | None = None, **run_fields
) -> None:
    """A run with steps only: no layer, rank or event data."""
    empty_grid = {"bucket_steps": 1, "step": [], "value": []}
    run = {"run_id": "r1", "last_step": n_steps - 1, "started_unix_s": 999.0} | run_fields
    run["last_time_unix_s"] = 1000.0 + n_steps - 1
    canned.routes |= {
        "/healthz": (200, {"status": "ok", "replay": False}),
        "/api/v1/runs": (200, [run]),
        "/api/v1/runs/r1/steps": (200, {"bucket_steps": 1, "columns": steps_columns(n_steps)}),
        "/api/v1/runs/r1/layers": (200, {"layer_names": None, "layer": [], **empty_grid}),
        "/api/v1/runs/r1/ranks": (200, {"rank": [], **empty_grid}),
        "/api/v1/runs/r1/ranks/grid": (
            200,
            {"rank": [], **empty_grid}
            | {f"{agg}_{f.name}": [] for f in RANKS.fields for agg in ("max", "mean", "min")},
        ),
        "/api/v1/runs/r1/alerts": (200, alerts or []),
        "/api/v1/runs/r1/events": (200, []),
        "/api/v1/runs/r1/goodput": (200, {"run_id": "r1", "ratio": 0.5, "wall_s": 10.0}),
        "/api/v1/runs/r1/hosts": (200, {"hosts": None}),
        "/api/v1/runs/r1/nodes": (200, {"hosts": None, "node": [], **empty_grid}),
        "/api/v1/runs/r1/nodes/summary": (200, {"node": [], "host": [], "ranks": []}),
    }
