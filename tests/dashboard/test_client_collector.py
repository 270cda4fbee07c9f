"""The dashboard's client against the real collector app, served over HTTP from a thread:
NaN and inf arrive as stored, and the SDC canary vote the dashboard shows is the one the
collector's detector made."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pandas as pd
import pytest
import uvicorn
from fastapi import FastAPI

from tests.conftest import free_port, wait_until
from trainvitals.collector.main import create_app
from trainvitals.collector.settings import Settings
from trainvitals.dashboard import derive
from trainvitals.dashboard.client import CollectorClient
from trainvitals.schema import BatchBuilder, encode_json
from trainvitals.simulate import FleetSpec, simulate


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[str, FastAPI]]:
    """(URL, app) of a collector on a store in tmp_path, served by uvicorn in a thread: the
    HTTP the dashboard reads, without starting a process."""
    app = create_app(Settings(store_path=str(tmp_path / "store.duckdb")))
    config = uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, timeout_s=60)
    yield f"http://127.0.0.1:{config.port}", app
    server.should_exit = True
    thread.join(timeout=60)


def _ingest(url: str, app: FastAPI, docs: list[bytes]) -> None:
    """Send batches through ingest; return once stored and analysed (Store.flush)."""
    for body in docs:
        r = httpx.post(f"{url}/api/v1/ingest", content=body, timeout=60)
        assert r.status_code == 202, r.text
    app.state.store.flush(60)


def test_a_stored_nan_loss_and_inf_grad_norm_reach_the_dashboard_as_nan_and_inf(served) -> None:
    url, app = served
    b = BatchBuilder("r1")
    # Step 0: a NaN loss, and no update RMS (no optimizer step before it: not measured).
    # Step 1: an inf gradient norm, and the NaN update it made.
    for step, loss, grad_norm, update_rms in (
        (0, math.nan, 1.0, None),
        (1, 2.0, math.inf, math.nan),
        (2, 2.0, 1.0, 1e-3),
    ):
        b.append("steps", step=step, time_unix_s=1000.0 + step, loss=loss, grad_norm=grad_norm,
                 tokens=512, step_time_s=0.5, tokens_per_s=1024.0,
                 tflops_per_s_per_device=0.1, mfu_ratio=0.25)  # fmt: skip
        b.append("layers", step=step, layer=0, grad_norm=grad_norm, act_rms=1.0,
                 update_rms=update_rms)  # fmt: skip
    _ingest(url, app, [b.to_json()])
    with CollectorClient(url) as client:
        steps = client.steps("r1").frame
        grads = client.layers("r1", "grad_norm").frame
        updates = client.layers("r1", "update_rms").frame
        goodput = client.goodput("r1")
    assert math.isnan(steps["loss"][0]) and steps["loss"][1:].tolist() == [2.0, 2.0]
    assert steps["grad_norm"].tolist() == [1.0, math.inf, 1.0]
    assert steps["loss_max"].isna().tolist() == [True, False, False]
    assert grads["value"].tolist() == [1.0, math.inf, 1.0]
    assert grads["nonfinite"].tolist() == [False, True, False]
    # NaN twice, told apart: measured NaN at step 1, nothing measured at step 0.
    assert updates["value"].isna().tolist() == [True, True, False]
    assert updates["nonfinite"].tolist() == [False, True, False]
    jump = derive.first_jump(updates)
    assert (jump["step"], jump["layer"]) == (1, 0)
    assert 0 < goodput["ratio"] <= 1


def test_views_of_a_run_with_nan_and_inf_draw_them_without_an_infinite_axis(
    served, monkeypatch
) -> None:
    """inf reaches the browser as a gap in a line (an axis cannot hold it) and as a red
    cell in a layer heatmap, and no view fails on it."""
    from tests.dashboard.test_app import chart_data, heatmap_cells, run_app

    url, app = served
    b = BatchBuilder("r1")
    for step in range(6):
        bad = step == 3
        b.append("steps", step=step, time_unix_s=1000.0 + step, loss=math.inf if bad else 2.0,
                 grad_norm=math.nan if bad else 1.0, tokens=512, step_time_s=0.5,
                 tokens_per_s=1024.0, tflops_per_s_per_device=0.1, mfu_ratio=0.25)  # fmt: skip
        for layer in range(2):
            b.append("layers", step=step, layer=layer, act_rms=1.0,
                     grad_norm=math.inf if bad and layer == 1 else 1.0)  # fmt: skip
    _ingest(url, app, [b.to_json()])
    overview = run_app(monkeypatch, url)
    assert not overview.exception
    drawn = [v for _, data in chart_data(overview) for rows in data.values() for row in rows
             for v in row.values() if isinstance(v, float)]  # fmt: skip
    assert drawn and not any(math.isinf(v) for v in drawn)
    layers = run_app(monkeypatch, url, view="Layers")
    assert not layers.exception
    assert heatmap_cells(layers)[0] == (11, 1)  # the gradient norms: one red, layer 1 at step 3


def _dashboard_episodes(status: pd.DataFrame) -> set[tuple[int, int | None]]:
    """(step, rank) where the dashboard's fingerprint view starts showing a rank outvoted,
    and (step, None) where it starts showing no majority: the episodes that the detector
    raises one alert each for."""
    out: set[tuple[int, int | None]] = set()
    differs: set[int] = set()
    was_split = False
    for step, rows in status.sort_values(["step", "rank"]).groupby("step"):
        split = bool((rows["status"] == derive.SPLIT).any())
        if split and not was_split:
            out.add((int(step), None))
        was_split = split
        if split:  # a step without a majority names nobody and clears nobody
            continue
        now = set(rows.loc[rows["status"] == derive.DIFFERS, "rank"].astype(int))
        out |= {(int(step), rank) for rank in now - differs}
        differs = now
    return out


def test_the_dashboards_sdc_vote_is_the_detectors_on_a_stored_run(served) -> None:
    url, app = served
    # 8 ranks: rank 3 corrupt from step 100, rank 5 from step 200, each outvoted; 2 ranks,
    # one corrupt from step 150: no strict majority. Logged, and a canary, every 50 steps.
    every = {"log_every": 50, "canary_every": 50}
    runs = {
        "eight": FleetSpec(ranks=8, layers=2, step_time_s=1.0, steps=300, seed=3, **every,
                           faults=("sdc:rank=3,step=100", "sdc:rank=5,step=200"),
                           run_id="eight"),
        "pair": FleetSpec(ranks=2, layers=2, step_time_s=1.0, steps=300, seed=4, **every,
                          faults=("sdc:rank=1,step=150",), run_id="pair"),
    }  # fmt: skip
    _ingest(url, app, [encode_json(doc) for spec in runs.values() for doc in simulate(spec)])
    found = {}
    with CollectorClient(url) as client:
        for run_id, spec in runs.items():
            grid = client.ranks(run_id, "canary_fingerprint", max_steps=spec.steps, agg="mean")
            assert grid.bucket_steps == 1  # each canary step a bucket of its own
            assert grid.frame["value"].notna().sum() == 6 * spec.ranks
            dashboard = _dashboard_episodes(derive.fingerprint_agreement(grid.frame))
            alerts = client.alerts(run_id)
            sdc = alerts[alerts["kind"] == "sdc"]
            detector = {(int(s), None if pd.isna(r) else int(r))
                        for s, r in zip(sdc["step"], sdc["rank"], strict=True)}  # fmt: skip
            assert dashboard == detector, run_id
            found[run_id] = detector
    # Each injected fault, where it was injected.
    assert found == {"eight": {(100, 3), (200, 5)}, "pair": {(150, None)}}
