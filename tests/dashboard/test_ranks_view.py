"""The Ranks view's "Slowest ranks" on a recorded real run sent through ingest to a real
collector: the table names the rank the collector's straggler detector names, by the same
signal, from the view's one grid request."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import numpy as np

from tests.analyzer.test_intermittent import cohort
from tests.conftest import wait_until
from tests.dashboard.test_app import run_app
from trainvitals.dashboard import derive
from trainvitals.schema import BatchBuilder

RECORDED = Path(__file__).parents[1] / "analyzer" / "data" / "idle16_8rank_straggler.csv"
N_RANKS, TP = 8, 2


def recorded_batch(run_id: str) -> BatchBuilder:
    """A real dp=4 x tp=2 CPU run on an idle 16-core machine (tests/analyzer/data): each
    row a step's compute_time_s then wait_time_s of ranks 0-7, then its step_time_s. Rank
    5 works 15% more from step 10: inside its CPU time's noise, but it arrives late."""
    table = np.loadtxt(RECORDED, delimiter=",")
    b = BatchBuilder(run_id)
    b.append("runs", started_unix_s=1000.0, model="m", model_config_json="{}", n_params=1000,
             n_layers=1, layer_names_json='["emb"]', world_size=N_RANKS, dp=N_RANKS // TP,
             tp=TP, device_type="cpu", device_name="cpu",
             hosts_json=json.dumps(["node-a"] * N_RANKS), flops_per_token=6000.0,
             peak_flops_per_s=1e12, peak_flops_source="given")  # fmt: skip
    for step, row in enumerate(table):
        compute, waits, step_s = row[:N_RANKS], row[N_RANKS : 2 * N_RANKS], float(row[-1])
        b.append("steps", step=step, time_unix_s=1001.0 + step, loss=3.0, grad_norm=1.0,
                 lr=1e-3, tokens=512, step_time_s=step_s, tokens_per_s=512 / step_s,
                 tflops_per_s_per_device=1e-4, mfu_ratio=0.1)  # fmt: skip
        for rank in range(N_RANKS):
            times = {"compute_time_s": float(compute[rank]), "wait_time_s": float(waits[rank])}
            b.append("ranks", step=step, rank=rank, step_time_s=step_s,
                     tokens_per_s=64 / step_s, loss=3.0, **times)  # fmt: skip
    return b


def test_slowest_ranks_names_the_detectors_straggler_of_a_recorded_run(
    monkeypatch, collector
) -> None:
    body = recorded_batch("idle").to_json()
    sent = httpx.post(f"{collector.url}/api/v1/ingest", content=body, timeout=60)
    assert sent.status_code == 202, sent.text

    def straggler_alerts() -> list[dict]:
        alerts = httpx.get(f"{collector.url}/api/v1/runs/idle/alerts", timeout=60).json()
        return [a for a in alerts if a["kind"] == "straggler"]

    wait_until(lambda: bool(straggler_alerts()), timeout_s=60)
    named = {a["rank"] for a in straggler_alerts()}
    at = run_app(monkeypatch, collector.url, view="Ranks")
    assert not at.exception
    [slowest] = at.dataframe
    table = slowest.value
    assert named == {5}
    assert set(table.loc[table["straggler"], "rank"]) == named
    assert table["rank"].iloc[0] == 5
    # Named by its arrival: its CPU time is inside the others' noise.
    assert table["named_by"].iloc[0] == derive.ARRIVAL


def test_slowest_ranks_marks_the_rank_the_intermittent_detector_names(
    monkeypatch, collector
) -> None:
    """Rank 2 of 4 waits 0.5 s for one batch in 20 (the others compute ~0.1 s a step): too
    rarely slow to move the bucket means the table ranks by, so the table marks it from the
    collector's own `intermittent_straggler` alert, with the share of the time it cost."""
    b = BatchBuilder("hiccups")
    b.append("runs", started_unix_s=1000.0, model="m", model_config_json="{}", n_params=1000,
             n_layers=1, layer_names_json='["emb"]', world_size=4, dp=4, tp=1,
             device_type="cpu", device_name="cpu", hosts_json=json.dumps(["node-a"] * 4),
             flops_per_token=6000.0, peak_flops_per_s=1e12, peak_flops_source="given")  # fmt: skip
    for v in cohort(200, data={2: (40, 20, 0.5)}):
        step_s = float(v.step_time_s)
        b.append("steps", step=v.step, time_unix_s=1001.0 + v.step, loss=3.0, grad_norm=1.0,
                 lr=1e-3, tokens=512, step_time_s=step_s, tokens_per_s=512 / step_s,
                 tflops_per_s_per_device=1e-4, mfu_ratio=0.1)  # fmt: skip
        r = v.ranks
        for rank in range(4):
            b.append("ranks", step=v.step, rank=rank, step_time_s=step_s,
                     tokens_per_s=128 / step_s, loss=3.0,
                     compute_time_s=float(r.compute_time_s[rank]),
                     data_time_s=float(r.data_time_s[rank]),
                     wait_time_s=float(r.wait_time_s[rank]))  # fmt: skip
    sent = httpx.post(f"{collector.url}/api/v1/ingest", content=b.to_json(), timeout=60)
    assert sent.status_code == 202, sent.text

    def named() -> set[int]:
        alerts = httpx.get(f"{collector.url}/api/v1/runs/hiccups/alerts", timeout=60).json()
        return {a["rank"] for a in alerts if a["kind"] == "intermittent_straggler"}

    assert wait_until(named, timeout_s=60) == {2}
    at = run_app(monkeypatch, collector.url, view="Ranks")
    assert not at.exception
    [slowest] = at.dataframe
    table = slowest.value.set_index("rank")
    assert not table["straggler"].any()  # the averages see no straggler
    held_up = table["held_up"]
    assert held_up.notna().tolist() == [r == 2 for r in table.index], held_up
    assert 5 < held_up[2] < 25, held_up  # 0.5 s lost in each 20 steps of ~0.1 s: about 20%
