"""The query client against a real HTTP server with canned answers (no mocked transport)."""

from __future__ import annotations

import math

import pytest

from trainvitals.dashboard.client import (
    CollectorClient,
    CollectorError,
    CollectorUnavailable,
    RunNotFound,
    RunSummary,
)

STEPS = {
    "bucket_steps": 1,
    "columns": {
        "step": [10, 11],
        "loss": [2.5, "NaN"],  # NaN and inf in the schema's wire form
        "loss_max": [2.5, "NaN"],
        "grad_norm": ["-Infinity", "Infinity"],
        "mfu_ratio": [None, None],  # null: not stored
    },
}


def test_nothing_listening_is_collector_unavailable(unused_url) -> None:
    client = CollectorClient(unused_url, timeout_s=2.0)
    with client, pytest.raises(CollectorUnavailable) as e:
        client.runs()
    assert unused_url in str(e.value)


def test_404_is_run_not_found_with_the_collectors_detail(canned_collector) -> None:
    path = "/api/v1/runs/gone/steps"
    canned_collector.routes[path] = (404, {"detail": "no run 'gone' in this store"})
    with CollectorClient(canned_collector.url) as client, pytest.raises(RunNotFound) as e:
        client.steps("gone")
    assert "no run 'gone'" in str(e.value)


def test_server_error_is_collector_error_not_run_not_found(canned_collector) -> None:
    canned_collector.routes["/api/v1/runs"] = (500, b"Internal Server Error")
    with CollectorClient(canned_collector.url) as client, pytest.raises(CollectorError) as e:
        client.runs()
    assert not isinstance(e.value, RunNotFound | CollectorUnavailable)
    assert "HTTP 500" in str(e.value)


def test_an_answer_that_is_not_json_is_collector_error(canned_collector) -> None:
    canned_collector.routes["/healthz"] = (200, b"<html>a proxy page</html>")
    with CollectorClient(canned_collector.url) as client, pytest.raises(CollectorError):
        client.healthz()


def test_runs_ignore_unknown_fields_and_null_metadata(canned_collector) -> None:
    canned_collector.routes["/api/v1/runs"] = (
        200,
        [{"run_id": "r1", "last_step": 5, "layer_names": None, "added_later": 1}],
    )
    with CollectorClient(canned_collector.url) as client:
        assert client.runs() == [RunSummary(run_id="r1", last_step=5)]


def test_steps_decode_nan_and_inf_nulls_become_nan_an_open_window_is_not_sent(
    canned_collector,
) -> None:
    canned_collector.routes["/api/v1/runs/r1/steps"] = (200, STEPS)
    with CollectorClient(canned_collector.url) as client:
        series = client.steps("r1", max_points=50)
        client.steps("r1", start=3, end=7)
    assert series.frame["step"].tolist() == [10, 11]
    assert str(series.frame["step"].dtype) == "int64"
    assert math.isnan(series.frame["loss"][1])
    assert series.frame["grad_norm"].tolist() == [-math.inf, math.inf]
    assert series.frame["mfu_ratio"].isna().all()
    assert [q for _, q in canned_collector.requests] == [
        {"max_points": "50"},
        {"start": "3", "end": "7", "max_points": "2000"},
    ]


def test_layers_are_named_even_without_layer_names(canned_collector) -> None:
    grid = {"bucket_steps": 2, "step": [0, 0], "layer": [0, 1], "value": [0.5, None]}
    canned_collector.routes["/api/v1/runs/r1/layers"] = (200, {"layer_names": ["emb"], **grid})
    canned_collector.routes["/api/v1/runs/r2/layers"] = (200, {"layer_names": None, **grid})
    with CollectorClient(canned_collector.url) as client:
        named = client.layers("r1")
        unnamed = client.layers("r2")
    assert named.bucket_steps == 2
    assert named.frame["layer_name"].tolist() == ["emb", "layer 1"]
    assert unnamed.frame["layer_name"].tolist() == ["layer 0", "layer 1"]
    defaults = {"metric": "grad_norm", "max_steps": "300", "agg": "max"}
    assert canned_collector.requests[0][1] == defaults


def test_alerts_keep_null_rank_and_layer(canned_collector) -> None:
    alert = {"kind": "loss_spike", "severity": "warning", "step": 7, "rank": None, "layer": 2}
    canned_collector.routes["/api/v1/runs/r1/alerts"] = (200, [alert])
    canned_collector.routes["/api/v1/runs/r2/alerts"] = (200, [])
    with CollectorClient(canned_collector.url) as client:
        alerts = client.alerts("r1")
        empty = client.alerts("r2")
    assert alerts["rank"].isna().all()
    assert alerts["layer"].tolist() == [2]
    assert empty.empty
    assert list(empty.columns) == list(alerts.columns)


def test_power_and_target_fields_are_read_when_the_collector_serves_them(
    canned_collector,
) -> None:
    run = {"run_id": "r1", "power_source": "", "power_unavailable": "nvml: no driver"}
    canned_collector.routes["/api/v1/runs"] = (200, [run | {"token_target": 10**12}])
    with CollectorClient(canned_collector.url) as client:
        [summary] = client.runs()
    assert summary.power_unavailable == "nvml: no driver"
    assert summary.token_target == 10**12


def test_events_are_typed_and_an_empty_list_keeps_the_columns(canned_collector) -> None:
    event = {"step": 80, "rank": 1, "kind": "fault:straggler", "detail": "{}", "time_unix_s": 1.0}
    canned_collector.routes["/api/v1/runs/r1/events"] = (200, [event])
    canned_collector.routes["/api/v1/runs/r2/events"] = (200, [])
    with CollectorClient(canned_collector.url) as client:
        events = client.events("r1")
        empty = client.events("r2")
    assert events["step"].tolist() == [80]
    assert str(events["rank"].dtype) == "int64"
    assert list(empty.columns) == list(events.columns)


def test_is_replay_reads_healthz(canned_collector) -> None:
    canned_collector.routes["/healthz"] = (200, {"status": "ok", "replay": True})
    with CollectorClient(canned_collector.url) as client:
        assert client.is_replay()
    canned_collector.routes["/healthz"] = (200, {"status": "ok", "replay": False})
    with CollectorClient(canned_collector.url) as client:
        assert not client.is_replay()
