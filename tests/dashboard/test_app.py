"""The Streamlit app, run headless by AppTest against real HTTP collectors."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from streamlit.testing.v1 import AppTest

from trainvitals.dashboard.app import URL_ENV_VAR, alerts_view, collector_url, count_label
from trainvitals.dashboard.client import CollectorClient
from trainvitals.dashboard.launch import APP_PATH

# AppTest's default (3 s) is tight for a first run that imports altair on 2 busy cores.
RUN_TIMEOUT_S = 60


def run_app(monkeypatch: pytest.MonkeyPatch, url: str) -> AppTest:
    monkeypatch.setenv(URL_ENV_VAR, url)
    return AppTest.from_file(str(APP_PATH), default_timeout=RUN_TIMEOUT_S).run()


def chart_specs(at: AppTest) -> list[dict]:
    """The Vega-Lite spec of every chart on the page (st.altair_chart elements)."""
    return [json.loads(chart.proto.spec) for chart in at.get("vega_lite_chart")]


def y_fields(spec: dict) -> set[str]:
    """Fields on the y axis of a chart or of any of its layers."""
    layers = spec.get("layer", [spec])
    return {layer["encoding"]["y"]["field"] for layer in layers if "encoding" in layer}


def test_unreachable_collector_is_an_error_naming_the_url(monkeypatch, unused_url) -> None:
    at = run_app(monkeypatch, unused_url)
    assert not at.exception
    [error] = at.error
    assert unused_url in error.value
    assert "trainvitals collector" in error.value  # says how to start one
    assert not at.get("vega_lite_chart")


def test_no_runs_yet_is_an_info(monkeypatch, canned_collector) -> None:
    canned_collector.routes["/api/v1/runs"] = (200, [])
    at = run_app(monkeypatch, canned_collector.url)
    assert not at.exception
    assert "no runs yet" in at.info[0].value
    assert not at.get("vega_lite_chart")


def test_a_run_without_layer_or_rank_data_says_so(monkeypatch, canned_collector) -> None:
    empty_grid = {"bucket_steps": 1, "step": [], "value": []}
    steps = {"step": [0, 1], "loss": [3.0, 2.9], "loss_max": [3.0, 2.9], "lr": [1e-3, 1e-3]}
    steps |= {"grad_norm": [1.0, 0.9], "grad_norm_max": [1.0, 0.9], "tokens_per_s": [10, 11]}
    steps |= {"mfu_ratio": [None, None], "tflops_per_s_per_device": [0.1, 0.1]}
    canned_collector.routes |= {
        "/api/v1/runs": (200, [{"run_id": "r1", "last_step": 1}]),
        "/api/v1/runs/r1/steps": (200, {"bucket_steps": 1, "columns": steps}),
        "/api/v1/runs/r1/layers": (200, {"layer_names": None, "layer": [], **empty_grid}),
        "/api/v1/runs/r1/ranks": (200, {"rank": [], **empty_grid}),
        "/api/v1/runs/r1/alerts": (200, []),
    }
    at = run_app(monkeypatch, canned_collector.url)
    assert not at.exception
    infos = " ".join(info.value for info in at.info)
    assert "No per-layer statistics" in infos
    assert "No per-rank statistics" in infos
    assert "MFU unknown" in infos
    assert [s["title"] for s in chart_specs(at)] == ["Loss", "Throughput", "Gradient norm"]
    assert dict((m.label, m.value) for m in at.metric)["MFU"] == "n/a"


def test_a_finished_run_shows_its_metrics_and_charts(monkeypatch, collector_with_run) -> None:
    with CollectorClient(collector_with_run) as client:
        run = client.runs()[0]  # the newest: what the app shows first
    at = run_app(monkeypatch, collector_with_run)
    assert not at.exception
    assert not at.error
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["last step"] == f"{run.last_step:,}"
    specs = chart_specs(at)
    titles = {s.get("title") for s in specs}
    assert {"Loss", "Gradient norm", "Throughput", "Mean per rank"} <= titles
    assert any("layer_name" in y_fields(s) for s in specs)  # step x layer heatmap
    assert any("rank" in y_fields(s) for s in specs)  # step x rank heatmap


def test_the_step_window_is_remembered_and_follows_only_at_the_end(
    monkeypatch, collector_with_run
) -> None:
    at = run_app(monkeypatch, collector_with_run)
    [window] = at.sidebar.slider
    run_id = at.sidebar.selectbox[0].value
    last_step = window.value[1]
    at = window.set_value((1, last_step // 2)).run()
    assert not at.exception
    assert not at.error
    assert at.get("vega_lite_chart")
    assert at.session_state[f"window:{run_id}"] == (1, last_step // 2, False)
    at = at.sidebar.slider[0].set_value((1, last_step)).run()
    assert at.session_state[f"window:{run_id}"] == (1, last_step, True)


def test_collector_url_prefers_the_script_arg_then_the_env_var() -> None:
    env = {URL_ENV_VAR: "http://env:1"}
    assert collector_url(["--collector", "http://arg:2"], env) == "http://arg:2"
    assert collector_url(["--co"], env) == "http://env:1"  # pytest's flag, not ours
    assert collector_url([], {}) == "http://127.0.0.1:8000"


def test_alerts_view_names_layers_and_puts_the_newest_first() -> None:
    alerts = pd.DataFrame(
        {"time_unix_s": [1.0, 2.0], "step": [3, 9], "layer": [1, None], "message": ["a", "b"]}
    ).astype({"layer": "Int64"})
    view = alerts_view(alerts, ["emb", "layers.0"])
    assert view["message"].tolist() == ["b", "a"]
    assert view["layer"].isna().tolist() == [True, False]
    assert view["layer"].iloc[1] == "layers.0"
    assert view.columns[0] == "time"


def test_count_label() -> None:
    assert count_label(999) == "999"
    assert count_label(139_584) == "139.6 k"
    assert count_label(7_000_000_000) == "7.0 B"
