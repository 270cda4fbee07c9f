"""Two runs sent through ingest to a real collector, for the views that need more than the
trained 4-rank run: alerts and events to mark, two runs to compare, named layers to follow,
ranks on hosts. They log every LOG_EVERY steps, as hooks do by default; "faulty" has a
loss spike the collector's analyzer turns into an alert, and an injected-fault event.
"""

from __future__ import annotations

import json

import httpx

from tests.conftest import CollectorProcess, wait_until
from trainvitals.schema import BatchBuilder

LOG_EVERY = 5
STEPS = range(0, 300, LOG_EVERY)
SPIKE_STEP, FAULT_STEP = 225, 100
HOSTS = ["node-b", "node-a", "node-b", "node-a"]
LAYER_NAMES = ["emb", "block.0", "block.1"]


def run_batch(run_id: str, spike: bool, started: float) -> BatchBuilder:
    b = BatchBuilder(run_id)
    b.append("runs", started_unix_s=started, model="m", model_config_json="{}", n_params=1000,
             n_layers=3, layer_names_json=json.dumps(LAYER_NAMES), world_size=4, dp=4, tp=1,
             device_type="cpu", device_name="cpu", hosts_json=json.dumps(HOSTS),
             flops_per_token=6000.0, peak_flops_per_s=1e12, peak_flops_source="given")  # fmt: skip
    for step in STEPS:
        loss = 3.0 - 0.001 * step + (6.0 if spike and step == SPIKE_STEP else 0.0)
        b.append("steps", step=step, time_unix_s=started + 1 + step, loss=loss, grad_norm=1.0,
                 lr=1e-3, tokens=512, step_time_s=1.0, tokens_per_s=512.0,
                 tflops_per_s_per_device=1.9e-4, mfu_ratio=0.2, power_w=400.0,
                 energy_j=400.0 * (step + 1))  # fmt: skip
        for layer in range(3):
            b.append("layers", step=step, layer=layer, grad_norm=0.1 * (layer + 1), act_rms=1.0)
        for rank in range(4):
            b.append("ranks", step=step, rank=rank, step_time_s=1.0, tokens_per_s=128.0,
                     loss=loss, compute_time_s=0.5 + 0.1 * rank, wait_time_s=0.1,
                     power_w=100.0)  # fmt: skip
    if spike:
        b.append("events", step=FAULT_STEP, rank=1, kind="fault:straggler", detail="{}",
                 time_unix_s=started + 1 + FAULT_STEP)  # fmt: skip
    return b


def start_two_runs(store) -> CollectorProcess:
    """A live collector on `store` holding runs "baseline" (older) and "faulty" (newer),
    once the faulty run's alert is stored."""
    c = CollectorProcess(store)
    for run_id, spike, started in (("baseline", False, 1000.0), ("faulty", True, 5000.0)):
        body = run_batch(run_id, spike, started).to_json()
        assert httpx.post(f"{c.url}/api/v1/ingest", content=body, timeout=60).status_code == 202

    def stored() -> bool:
        alerts = httpx.get(f"{c.url}/api/v1/runs/faulty/alerts", timeout=60)
        runs = httpx.get(f"{c.url}/api/v1/runs", timeout=60).json()
        return alerts.status_code == 200 and bool(alerts.json()) and len(runs) == 2

    wait_until(stored, timeout_s=60)
    return c
