"""Synthetic 4-rank runs as the hooks would report them, clean or with one injected fault.

A real 4-rank CPU run takes most of a minute on 2 cores; these batches take milliseconds
and carry what the detectors read: a noisy falling loss, per-rank timing (compute vs.
waiting at the step's collective) and a periodic SDC canary fingerprint per rank.
"""

from __future__ import annotations

import math
import time

import httpx

from trainvitals.schema import BatchBuilder

WORLD = 4
STEP_S = 0.5  # wall time of one step
CANARY_EVERY = 5  # steps between canary fingerprints
# That rank computes 20% longer: a straggler (20 of 25 steps) whose job loses 16% of its
# throughput, under the throughput_drop bar (20%), so that each fault raises its own alert.
STRAGGLER_RANK, STRAGGLER_SLOWDOWN = 3, 0.2
# That rank computes HICCUP_FACTOR times as long one step in HICCUP_EVERY: named at its
# third such step (3 of 25 slow steps, no straggler; throughput is low in 3 steps, not in
# a whole window). Three hiccups of 1.8 s are 5% of the 200 steps' time the share is of
# (a run this young counts the steps it has not run at the typical 0.48 s).
HICCUP_RANK, HICCUP_EVERY, HICCUP_FACTOR = 1, 8, 5
SDC_RANK = 2
POWER_W = 300.0  # each device's draw
# The collector of the end-to-end test requires a token, as the compose stack's does
# (servers.py): reads and writes, and Prometheus' scrapes, all carry it.
TOKEN = "e2e-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}


def _rank_rows(step: int, fault: str | None, fault_step: int = -1) -> list[dict]:
    compute = [0.45 * (1 + 0.01 * math.sin(step + r)) for r in range(WORLD)]
    if fault == "straggler":
        compute[STRAGGLER_RANK] *= 1 + STRAGGLER_SLOWDOWN
    if fault == "intermittent_straggler" and (step - fault_step) % HICCUP_EVERY == 0:
        compute[HICCUP_RANK] *= HICCUP_FACTOR
    step_time = max(compute) + 0.03  # everyone waits for the slowest at the all-reduce
    rows = []
    for r in range(WORLD):
        row = {
            "step": step,
            "rank": r,
            "step_time_s": step_time,
            "tokens_per_s": 1024 / step_time,
            "loss": 0.0,  # filled in by the caller
            "compute_time_s": compute[r],
            "wait_time_s": step_time - compute[r],
            "power_w": POWER_W,
        }
        if step % CANARY_EVERY == 0:
            # Every rank runs the same canary computation: equal bits unless one is faulty.
            fingerprint = (0x5DEECE66D * (step + 1)) & ((1 << 52) - 1)
            if fault == "sdc" and r == SDC_RANK:
                fingerprint ^= 1 << 17  # one flipped bit
            row["canary_fingerprint"] = fingerprint
        rows.append(row)
    return rows


def batch(
    run_id: str, steps: range, fault: str | None = None, fault_step: int = -1
) -> BatchBuilder:
    """Steps `steps` of a run; `fault` applies to the steps from `fault_step` on
    (a loss spike and a non-finite loss: to that one step only)."""
    b = BatchBuilder(run_id)
    end_unix_s = time.time()  # the last step happens now: the run looks alive
    for step in steps:
        active = fault if step >= fault_step else None
        if active in ("loss_spike", "nonfinite") and step != fault_step:
            active = None
        loss = 4.0 * math.exp(-step / 300) * (1 + 0.01 * math.sin(1.7 * step))
        grad_norm = 1.0 + 0.05 * math.sin(1.3 * step)
        if active == "loss_spike":
            loss, grad_norm = loss * 3, grad_norm * 5
        elif active == "nonfinite":
            loss, grad_norm = math.nan, math.nan
        ranks = _rank_rows(step, active, fault_step)
        step_time = ranks[0]["step_time_s"]
        b.append(
            "steps",
            step=step,
            time_unix_s=end_unix_s - (steps[-1] - step) * STEP_S,
            loss=loss,
            grad_norm=grad_norm,
            lr=1e-3,
            tokens=WORLD * 1024,
            step_time_s=step_time,
            tokens_per_s=WORLD * 1024 / step_time,
            tflops_per_s_per_device=0.05 * 0.48 / step_time,
            mfu_ratio=0.2 * 0.48 / step_time,
            power_w=WORLD * POWER_W,
            energy_j=WORLD * POWER_W * STEP_S * (step + 1),
        )
        for row in ranks:
            b.append("ranks", **{**row, "loss": loss})
    return b


def post(collector_url: str, b: BatchBuilder) -> None:
    r = httpx.post(
        f"{collector_url}/api/v1/ingest",
        content=b.to_json(),
        headers={"content-type": "application/json", **AUTH},
        timeout=60,  # a loaded collector
    )
    assert r.status_code == 202, r.text


def stored_last_step(collector_url: str, run_id: str) -> int:
    runs = httpx.get(f"{collector_url}/api/v1/runs", headers=AUTH, timeout=60).json()
    return next((r["last_step"] for r in runs if r["run_id"] == run_id), -1)


def analysis_caught_up(collector_url: str) -> bool:
    """Has the collector stored the alerts of every committed step? (Its analyzer runs about 1 s
    behind the writer, on its own thread.)"""
    text = httpx.get(f"{collector_url}/metrics", headers=AUTH, timeout=60).text
    for line in text.splitlines():
        if line.startswith("trainvitals_collector_analysis_lag_seconds "):
            return float(line.split()[1]) == 0.0
    raise AssertionError("the collector does not export its analysis lag")


def analyzer_alerts(collector_url: str, run_id: str) -> list[dict]:
    url = f"{collector_url}/api/v1/runs/{run_id}/alerts"
    return httpx.get(url, headers=AUTH, timeout=60).json()
