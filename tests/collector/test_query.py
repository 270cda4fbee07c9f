"""Query API and /metrics over a store filled through ingest."""

from __future__ import annotations

import math

import pytest
from prometheus_client.parser import text_string_to_metric_families

from trainvitals.schema import ALERTS, EVENTS, RUNS, STEPS, BatchBuilder

from .conftest import counts, make_batch


def _fill(client, **kw) -> None:
    assert client.post("/api/v1/ingest", content=make_batch(**kw).to_json()).status_code == 202
    counts(client)


def test_runs_and_series(client) -> None:
    _fill(client, steps=range(100))
    (run,) = client.get("/api/v1/runs").json()
    assert run["run_id"] == "r1" and run["last_step"] == 99
    steps = client.get("/api/v1/runs/r1/steps", params={"max_points": 10}).json()
    assert steps["bucket_steps"] == 10
    assert steps["columns"]["step"] == list(range(0, 100, 10))
    layers = client.get(
        "/api/v1/runs/r1/layers", params={"metric": "grad_norm", "max_steps": 5}
    ).json()
    assert set(layers["step"]) == {0, 20, 40, 60, 80} and set(layers["layer"]) == {0, 1}
    ranks = client.get("/api/v1/runs/r1/ranks", params={"start": 90, "end": 99}).json()
    assert ranks["value"][:2] == [0.4, 0.5]


def test_downsampling_keeps_a_spike_visible(client) -> None:
    losses = [2.0] * 1000
    losses[537] = 50.0
    _fill(client, steps=range(1000), losses=losses, n_layers=1, world=1)
    cols = client.get("/api/v1/runs/r1/steps", params={"max_points": 20}).json()["columns"]
    assert len(cols["step"]) == 20
    assert max(cols["loss_max"]) == 50.0


def test_nonfinite_values_are_served_in_the_schemas_wire_form(client) -> None:
    # A NaN loss at step 0; an inf gradient norm at step 1, and -inf activations in layer 0.
    b = BatchBuilder("r1")
    for step, loss, grad_norm in ((0, math.nan, 1.0), (1, 2.0, math.inf), (2, 2.0, 1.0)):
        b.append("steps", step=step, time_unix_s=1000.0 + step, loss=loss, grad_norm=grad_norm,
                 tokens=512, step_time_s=0.5, tokens_per_s=1024.0,
                 tflops_per_s_per_device=0.1, mfu_ratio=0.25)  # fmt: skip
        b.append("layers", step=step, layer=0, grad_norm=grad_norm,
                 act_rms=-math.inf if step == 1 else 1.0)  # fmt: skip
        b.append("ranks", step=step, rank=0, step_time_s=0.5, tokens_per_s=1024.0, loss=loss)
    assert client.post("/api/v1/ingest", content=b.to_json()).status_code == 202
    counts(client)
    cols = client.get("/api/v1/runs/r1/steps").json()["columns"]
    assert cols["loss"] == ["NaN", 2.0, 2.0] and cols["loss_max"] == ["NaN", 2.0, 2.0]
    assert cols["grad_norm"] == [1.0, "Infinity", 1.0] and cols["grad_norm_max"][1] == "Infinity"
    assert cols["step_time_s"] == [0.5] * 3  # a column without one is served as it is
    grads = client.get("/api/v1/runs/r1/layers").json()
    assert grads["value"] == [1.0, "Infinity", 1.0]
    acts = client.get("/api/v1/runs/r1/layers", params={"metric": "act_rms"}).json()
    assert acts["value"] == [1.0, "-Infinity", 1.0]
    ranks = client.get("/api/v1/runs/r1/ranks", params={"metric": "loss"}).json()
    assert ranks["value"] == ["NaN", 2.0, 2.0]
    # /openapi.json says so, for the fields declared to hold them.
    schemas = client.get("/openapi.json").json()["components"]["schemas"]
    loss = schemas["StepColumns"]["properties"]["loss"]
    assert {"type": "string", "enum": ["NaN", "Infinity", "-Infinity"]} in loss["items"]["anyOf"]
    assert '"Infinity"' in loss["description"]
    assert "enum" not in str(schemas["StepColumns"]["properties"]["step_time_s"])
    assert "enum" in str(schemas["AlertRow"]["properties"]["value"])


def test_unknown_run_and_bad_parameters(client) -> None:
    _fill(client)
    assert client.get("/api/v1/runs/nope/steps").status_code == 404
    r = client.get("/api/v1/runs/r1/layers", params={"metric": "drop table steps"})
    assert r.status_code == 422 and "metric must be one of" in r.json()["detail"]
    r = client.get("/api/v1/runs/r1/steps", params={"start": 5, "end": 2})
    assert r.status_code == 422 and "before start" in r.json()["detail"]
    r = client.get("/api/v1/runs/r1/steps", params={"max_points": "many"})
    assert r.status_code == 422 and "max_points" in r.json()["detail"]
    r = client.get("/api/v1/runs/r1/steps", params={"end": 10**40})
    assert r.status_code == 422 and "end" in r.json()["detail"]


def test_loss_spike_raises_an_alert_in_api_and_metrics(client) -> None:
    losses = [3.0 - 0.001 * s for s in range(60)]
    losses[45] = 9.0
    _fill(client, steps=range(60), losses=losses)
    alerts = client.get("/api/v1/runs/r1/alerts").json()
    assert [(a["kind"], a["step"]) for a in alerts] == [("loss_spike", 45)]
    families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
    (sample,) = families["trainvitals_alerts"].samples
    assert sample.labels == {"run_id": "r1", "kind": "loss_spike", "rank": ""}
    assert sample.value == 1


def test_metrics_hold_run_gauges(client) -> None:
    _fill(client, steps=range(5))
    families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
    (loss,) = families["trainvitals_loss"].samples
    assert loss.labels == {"run_id": "r1"} and loss.value == 3.0 - 0.04
    (mfu,) = families["trainvitals_mfu_ratio"].samples
    assert mfu.value == 0.25
    stats = {
        s.labels["stat"]: s.value for s in families["trainvitals_rank_step_time_seconds"].samples
    }
    assert stats["max"] == 0.5


def test_events_are_served_in_step_order(client) -> None:
    b = make_batch()
    b.append("events", step=2, rank=1, kind="fault:straggler", detail='{"slowdown": 0.2}',
             time_unix_s=1.0)  # fmt: skip
    b.append("events", step=1, rank=-1, kind="checkpoint", detail="{}", time_unix_s=0.5)
    assert client.post("/api/v1/ingest", content=b.to_json()).status_code == 202
    counts(client)
    events = client.get("/api/v1/runs/r1/events").json()
    assert [(e["step"], e["kind"]) for e in events] == [(1, "checkpoint"), (2, "fault:straggler")]


def test_replay_mode_serves_an_older_store_and_refuses_ingest(tmp_path) -> None:
    import duckdb
    from fastapi.testclient import TestClient

    from trainvitals.collector.main import create_app
    from trainvitals.collector.settings import Settings

    path = tmp_path / "old.duckdb"
    con = duckdb.connect(str(path))  # a store from before later fields and the events table
    con.execute("CREATE TABLE steps (run_id VARCHAR, step BIGINT, time_unix_s DOUBLE, loss DOUBLE)")
    con.execute("INSERT INTO steps VALUES ('old', 0, 1.0, 3.0), ('old', 1, 2.0, 2.9)")
    con.close()
    with TestClient(create_app(Settings(store_path=str(path), replay=True))) as client:
        (run,) = client.get("/api/v1/runs").json()
        assert run["run_id"] == "old" and run["last_step"] == 1 and run["power_source"] is None
        cols = client.get("/api/v1/runs/old/steps").json()["columns"]
        assert cols["loss"] == [3.0, 2.9] and cols["mfu_ratio"] == [None, None]
        assert client.get("/api/v1/runs/old/events").json() == []
        r = client.post("/api/v1/ingest", content=make_batch().to_json())
        assert r.status_code == 409 and "replay" in r.json()["detail"]


def test_a_stored_runs_row_with_bad_layer_names_fails_no_listing(client) -> None:
    """Ingest refuses such a row now; a store written before it checked may still hold one."""
    _fill(client)
    cur = client.app.state.store.cursor()
    cur.execute(
        "INSERT INTO runs (run_id, started_unix_s, model, model_config_json, n_params, "
        "n_layers, layer_names_json, world_size, dp, tp, device_type, device_name, hosts_json, "
        "flops_per_token, peak_flops_per_s, peak_flops_source) VALUES ('r1', 1.0, 'm', '{}', "
        "1, 2, 'not json', 1, 1, 1, 'cpu', 'cpu', '[]', 6.0, 1e12, 'given')"
    )
    (run,) = client.get("/api/v1/runs").json()
    assert run["run_id"] == "r1" and run["layer_names"] is None
    layers = client.get("/api/v1/runs/r1/layers")
    assert layers.status_code == 200 and layers.json()["layer_names"] is None


@pytest.mark.slow
def test_parquet_export_is_served_in_replay_mode(settings, tmp_path) -> None:
    import subprocess
    import sys

    from fastapi.testclient import TestClient

    from trainvitals.collector.main import create_app
    from trainvitals.collector.settings import Settings

    with TestClient(create_app(settings)) as live:  # stopped on leaving: it owns the file
        _fill(live, steps=range(50))
        _fill(live, run_id="r2", steps=range(5))
        live_steps = live.get("/api/v1/runs/r1/steps").json()
    out = tmp_path / "export"
    argv = [sys.executable, "-m", "trainvitals", "export", settings.store_path, str(out)]
    r = subprocess.run([*argv, "--run", "r1"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "50 steps" in r.stdout and "100 ranks" in r.stdout
    assert [p.name for p in (out / "steps").iterdir()] == ["run_id=r1"]
    again = subprocess.run([*argv, "--run", "r1"], capture_output=True, text=True, timeout=300)
    assert again.returncode != 0 and "already holds an export" in again.stderr
    with TestClient(create_app(Settings(store_path=str(out), replay=True))) as replay:
        assert [run["run_id"] for run in replay.get("/api/v1/runs").json()] == ["r1"]
        assert replay.get("/api/v1/runs/r1/steps").json() == live_steps


def test_retention_drops_old_runs_everywhere(tmp_path) -> None:
    import time

    from fastapi.testclient import TestClient

    from trainvitals.collector.main import create_app
    from trainvitals.collector.settings import Settings
    from trainvitals.schema import BatchBuilder

    settings = Settings(store_path=str(tmp_path / "s.duckdb"), retention_days=7)
    with TestClient(create_app(settings)) as client:
        _fill(client, run_id="old", steps=range(3))  # logged in 1970
        fresh = BatchBuilder("fresh")
        fresh.append("steps", step=0, time_unix_s=time.time(), loss=2.0, grad_norm=1.0,
                     tokens=1, step_time_s=1.0, tokens_per_s=1.0, tflops_per_s_per_device=0.1,
                     mfu_ratio=0.1)  # fmt: skip
        assert client.post("/api/v1/ingest", content=fresh.to_json()).status_code == 202
        store = client.app.state.store
        assert store.drop_expired() == ["old"]
        assert [r["run_id"] for r in client.get("/api/v1/runs").json()] == ["fresh"]
        assert counts(client, "old") == {"steps": 0, "layers": 0, "ranks": 0}
        assert 'run_id="old"' not in client.get("/metrics").text
        assert store.drop_expired() == []


def test_a_window_after_the_last_step_is_empty(client) -> None:
    _fill(client)  # steps 0..2
    r = client.get("/api/v1/runs/r1/steps", params={"start": 5})
    assert r.status_code == 200, r.text
    assert r.json()["columns"]["step"] == []
    r = client.get("/api/v1/runs/r1/ranks", params={"start": 5})
    assert r.status_code == 200 and r.json()["step"] == []
    r = client.get("/api/v1/runs/r1/steps", params={"start": 2})
    assert r.json()["columns"]["step"] == [2]


def test_a_run_with_ranks_rows_only_says_why_it_is_not_served(client) -> None:
    from trainvitals.schema import BatchBuilder

    b = BatchBuilder("early")
    b.append("ranks", step=0, rank=0, step_time_s=0.5, tokens_per_s=1.0, loss=2.0)
    assert client.post("/api/v1/ingest", content=b.to_json()).status_code == 202
    counts(client, "early")
    r = client.get("/api/v1/runs/early/ranks")
    assert r.status_code == 404
    assert r.json()["detail"] == (
        "no run 'early' in this store: it has ranks rows only; a run is served once its "
        "runs or steps rows are stored"
    )
    assert client.get("/api/v1/runs/nope/ranks").json()["detail"] == "no run 'nope' in this store"
    _fill(client, run_id="early", steps=range(1))
    assert client.get("/api/v1/runs/early/ranks").json()["rank"] == [0, 1]


def test_openapi_documents_the_answers_with_the_schemas_fields(client) -> None:
    """The typed answers follow the table declarations: every field a table declares is
    in the model that mirrors it, and an answer holds exactly the documented keys."""
    doc = client.get("/openapi.json").json()
    models = doc["components"]["schemas"]

    def props(name: str) -> set[str]:
        return set(models[name]["properties"])

    assert props("AlertRow") == {"run_id", *(f.name for f in ALERTS.fields)}
    assert props("EventRow") == {"run_id", *(f.name for f in EVENTS.fields)}
    assert {f.name for f in RUNS.fields if f.json is None} < props("RunSummary")
    numeric = {f.name for f in STEPS.fields if f.dtype != "string"}
    assert numeric < props("StepColumns")
    for path, model in [
        ("/api/v1/runs", "RunSummary"),
        ("/api/v1/runs/{run_id}/alerts", "AlertRow"),
        ("/api/v1/runs/{run_id}/events", "EventRow"),
    ]:
        answer = doc["paths"][path]["get"]["responses"]["200"]["content"]["application/json"]
        assert answer["schema"]["items"]["$ref"] == f"#/components/schemas/{model}"
    _fill(client, steps=range(30))
    (run,) = client.get("/api/v1/runs").json()
    assert set(run) == props("RunSummary")
    assert set(client.get("/api/v1/runs/r1/steps").json()["columns"]) == props("StepColumns")
    assert set(client.get("/api/v1/runs/r1/goodput").json()) == props("GoodputAnswer")
