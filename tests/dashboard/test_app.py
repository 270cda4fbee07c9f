"""The Streamlit app, run headless by AppTest against real HTTP collectors.

Each view is checked against a collector holding a real 4-rank run (`collector_with_run`);
the empty states and the alert jump against canned answers, which can hold what that run
lacks (alerts with a culprit, a reason for missing power) or lack what it has.
"""

from __future__ import annotations

import json

import httpx
import pyarrow as pa
import pytest
from streamlit.testing.v1 import AppTest

from tests.dashboard.canned import canned_run
from trainvitals.dashboard.app import URL_ENV_VAR, collector_url, count_label
from trainvitals.dashboard.charts import INVALID_CELL_COLOR
from trainvitals.dashboard.launch import APP_PATH
from trainvitals.dashboard.layers import DRILL_KEY
from trainvitals.dashboard.state import (
    JUMP_WIDTH_STEPS,
    SLIDER_KEY,
    VIEW_KEY,
    VIEWS,
    WINDOWS_KEY,
)

# AppTest's default (3 s) is tight for a first run that imports altair on 2 busy cores;
# a hang guard, sized for load 20.
RUN_TIMEOUT_S = 300


def run_app(monkeypatch: pytest.MonkeyPatch, url: str, view: str | None = None) -> AppTest:
    monkeypatch.setenv(URL_ENV_VAR, url)
    at = AppTest.from_file(str(APP_PATH), default_timeout=RUN_TIMEOUT_S)
    if view:
        at.session_state[VIEW_KEY] = view
    return at.run()


def chart_specs(at: AppTest) -> list[dict]:
    """The Vega-Lite spec of every chart on the page (st.altair_chart elements)."""
    return [json.loads(chart.proto.spec) for chart in at.get("vega_lite_chart")]


def chart_rows(at: AppTest) -> list[int]:
    """Rows of data each chart on the page holds (its Arrow datasets, summed)."""
    return [
        sum(pa.ipc.open_stream(d.data.data).read_all().num_rows for d in chart.proto.datasets)
        for chart in at.get("vega_lite_chart")
    ]


def titles(at: AppTest) -> set[str]:
    return {spec.get("title") for spec in chart_specs(at)} - {None}


def y_fields(spec: dict) -> set[str]:
    """Fields on the y axis of a chart or of any of its layers."""
    layers = spec.get("layer", [spec])
    return {layer["encoding"]["y"]["field"] for layer in layers if "encoding" in layer}


def texts(elements) -> str:
    return " ".join(e.value for e in elements)


def api(url: str, path: str, **params) -> dict | list:
    return httpx.get(f"{url}/api/v1{path}", params=params, timeout=10).json()


# ------------------------------------------------------------------ a real run, each view


def test_overview_of_a_real_run(monkeypatch, collector_with_run) -> None:
    run = api(collector_with_run, "/runs")[0]
    at = run_app(monkeypatch, collector_with_run)
    assert not at.exception
    assert not at.error
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["last step"] == f"{run['last_step']:,}"
    assert metrics["MFU"].endswith(" %")
    # One goodput: the analyzer's, which `trainvitals replay` prints too.
    goodput = api(collector_with_run, f"/runs/{run['run_id']}/goodput")
    assert metrics["goodput"] == f"{100 * goodput['ratio']:.1f} %"
    expected = {"Loss", "Gradient norm, before clipping", "Throughput", "Learning rate"}
    expected |= {"Model FLOPs utilization", "Achieved FLOP rate per device"}
    assert expected <= titles(at)
    assert all(rows == run["last_step"] + 1 for rows in chart_rows(at))  # one point a step
    # The power panel: a chart when the run measured power, else a message saying why not.
    has_power = any(api(collector_with_run, f"/runs/{run['run_id']}/steps")["columns"]["power_w"])
    assert ("Power, all devices" in titles(at)) == has_power
    assert ("power" in texts(at.info)) != has_power


def test_layers_view_of_a_real_run(monkeypatch, collector_with_run) -> None:
    run = api(collector_with_run, "/runs")[0]
    at = run_app(monkeypatch, collector_with_run, view="Layers")
    assert not at.exception
    specs = chart_specs(at)
    assert specs
    assert all(y_fields(s) == {"layer_name"} for s in specs)
    headings = [h.value for h in at.subheader]
    assert headings[:2] == ["Gradient L2 norm per layer", "Activation RMS per layer"]
    grids = [
        api(collector_with_run, f"/runs/{run['run_id']}/layers", metric=m)["value"]
        for m in ("grad_norm", "act_rms", "update_rms")
    ]
    reported = [any(values) for values in grids]
    assert len(specs) == sum(reported)  # a heatmap per reported metric, a message otherwise
    assert len(at.info) == 3 - sum(reported)
    # A healthy run: every cell measured is drawn, and none is non-finite (red). The update
    # RMS of the first step, which no optimizer step precedes, is blank, not red.
    n_cells = (run["last_step"] + 1) * len(run["layer_names"])
    measured = [sum(v is not None for v in values) for values in grids if any(values)]
    assert chart_rows(at) == measured
    assert measured[0] == n_cells
    jumps = [c.value for c in at.caption if c.value.startswith("Earliest jump")]
    assert not any("non-finite" in jump for jump in jumps)


def test_ranks_view_of_a_real_run(monkeypatch, collector_with_run) -> None:
    run = api(collector_with_run, "/runs")[0]
    at = run_app(monkeypatch, collector_with_run, view="Ranks")
    assert not at.exception
    heatmaps = [s for s in chart_specs(at) if y_fields(s) == {"rank"}]
    assert len(heatmaps) == 2  # compute (or step) time, and waiting time
    assert [h.value for h in at.subheader][:2] == ["Compute time per rank", "Waiting time per rank"]
    [slowest] = at.dataframe
    table = slowest.value
    assert sorted(table["rank"]) == list(range(run["world_size"]))
    # Judged as the straggler detector judges: flagged ranks first, each with the signal
    # that named it; the table is derive.rank_costs' over the view's grid.
    flagged = table["straggler"].tolist()
    assert flagged == sorted(flagged, reverse=True)
    assert ((table["named_by"] != "") == table["straggler"]).all()
    # Collective traffic: a chart per collective the run reported, else a message.
    reported = [
        kind
        for kind in ("all_gather", "reduce_scatter", "all_reduce")
        if any(
            api(collector_with_run, f"/runs/{run['run_id']}/ranks", metric=f"{kind}_bytes")["value"]
        )
    ]
    collective_charts = {t for t in titles(at) if "bandwidth per rank" in t or "traffic per" in t}
    assert len(collective_charts) == len(reported)
    assert ("did not report its collectives" in texts(at.info)) == (not reported)


def test_health_view_of_a_real_run(monkeypatch, collector_with_run) -> None:
    run = api(collector_with_run, "/runs")[0]
    grid = api(collector_with_run, f"/runs/{run['run_id']}/ranks", metric="canary_fingerprint")
    at = run_app(monkeypatch, collector_with_run, view="Health")
    assert not at.exception
    if any(v is not None for v in grid["value"]):  # the hooks ran their SDC canary
        # Four healthy CPU ranks compute the same canary, bit for bit.
        assert f"All {run['world_size']} ranks agree" in texts(at.success)
        assert any(y_fields(s) == {"rank"} for s in chart_specs(at))
    else:
        assert "No SDC fingerprints" in texts(at.info)
    assert "No injected faults" in texts(at.info)


# ------------------------------------------------------------------ state across views


def test_moving_between_views_keeps_the_run_and_the_window(monkeypatch, collector_with_run) -> None:
    at = run_app(monkeypatch, collector_with_run)
    run_id = at.sidebar.selectbox[0].value
    at = at.sidebar.slider[0].set_value((2, 6)).run()
    for view in (*VIEWS[1:], VIEWS[0]):
        at = at.segmented_control[0].set_value(view).run()
        assert not at.exception
        assert at.sidebar.selectbox[0].value == run_id
        assert at.sidebar.slider[0].value == (2, 6)
        assert at.caption[0].value.startswith("Steps 2 to 6 of")
    assert at.session_state[WINDOWS_KEY][run_id] == (2, 6, False)


def test_the_step_window_follows_the_live_end_only_from_the_end(
    monkeypatch, collector_with_run
) -> None:
    at = run_app(monkeypatch, collector_with_run)
    run_id = at.sidebar.selectbox[0].value
    last_step = at.sidebar.slider[0].value[1]
    at = at.sidebar.slider[0].set_value((1, last_step // 2)).run()
    assert at.session_state[WINDOWS_KEY][run_id] == (1, last_step // 2, False)
    at = at.sidebar.slider[0].set_value((1, last_step)).run()
    assert at.session_state[WINDOWS_KEY][run_id] == (1, last_step, True)
    assert at.caption[0].value.startswith("Steps 1 to the latest")


# ------------------------------------------------------------------ canned collectors


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


def test_a_run_with_no_step_yet_says_so(monkeypatch, canned_collector) -> None:
    canned_run(canned_collector, n_steps=1)
    canned_collector.routes["/api/v1/runs"] = (200, [{"run_id": "r1", "last_step": None}])
    at = run_app(monkeypatch, canned_collector.url)
    assert not at.exception
    assert "has not logged a step yet" in texts(at.info)
    assert not at.get("vega_lite_chart")


def test_every_view_of_a_run_missing_data_says_what_is_missing(
    monkeypatch, canned_collector
) -> None:
    tried = "nvml: NVML Shared Library Not Found; rapl: /sys/class/powercap is missing"
    canned_run(canned_collector, n_steps=5, power_source="", power_unavailable=tried)
    at = run_app(monkeypatch, canned_collector.url)
    assert not at.exception
    assert "MFU unknown" in texts(at.info)
    assert f"No power source on this host. Tried: {tried}" in texts(at.info)
    assert dict((m.label, m.value) for m in at.metric)["power"] == "n/a"
    assert "No alerts for this run" in texts(at.success)
    expected = {
        "Layers": ["No per-layer statistics"],
        "Ranks": ["No per-rank statistics"],
        "Nodes": ["did not send its ranks' host names"],
        "Health": ["No SDC fingerprints", "No injected faults"],
        "Compare": ["Only one run in this collector"],
    }
    for view, messages in expected.items():
        at = at.segmented_control[0].set_value(view).run()
        assert not at.exception
        assert all(m in texts(at.info) for m in messages), view
        assert not at.get("vega_lite_chart"), view  # a message, never an empty chart


def alert(step: int, layer: int | None = None) -> dict:
    return {
        "step": step,
        "kind": "nonfinite" if layer is not None else "loss_spike",
        "severity": "critical",
        "layer": layer,
        "rank": None,
        "message": "what happened",
        "value": None,
        "baseline": None,
        "time_unix_s": 1000.0 + step,
    }


def select_row(at: AppTest, table_key: str, row: int) -> AppTest:
    """What clicking a row of a selectable st.dataframe does, then the rerun it causes."""
    at.session_state[table_key] = {"selection": {"rows": [row], "columns": [], "cells": []}}
    return at.run()


def test_dropped_telemetry_is_a_warning(monkeypatch, canned_collector) -> None:
    canned_run(canned_collector, n_steps=5)
    steps = canned_collector.routes["/api/v1/runs/r1/steps"][1]
    steps["columns"]["telemetry_dropped"] = [0, 0, 3, 3, 7]
    at = run_app(monkeypatch, canned_collector.url)
    assert "dropped 7 logged steps or batches" in texts(at.warning)


def test_selecting_an_alert_jumps_to_its_step_and_the_culprits_view(
    monkeypatch, canned_collector
) -> None:
    canned_run(canned_collector, n_steps=1000, alerts=[alert(500, layer=1)])
    at = run_app(monkeypatch, canned_collector.url, view="Health")
    assert at.sidebar.slider[0].value == (0, 999)
    at = select_row(at, "alerts:health", 0)
    assert not at.exception
    assert at.session_state[VIEW_KEY] == "Layers"
    first, last = 500 - JUMP_WIDTH_STEPS // 2, 500 - JUMP_WIDTH_STEPS // 2 + JUMP_WIDTH_STEPS - 1
    assert at.session_state[SLIDER_KEY] == (first, last)
    assert at.caption[0].value.startswith(f"Steps {first} to {last} of")
    path, query = canned_collector.requests[-1]  # the layers view asked for the new window
    assert path.endswith("/layers")
    assert (query["start"], query["end"]) == (str(first), str(last))


def test_an_alert_without_culprit_moves_the_window_and_the_page_settles(
    monkeypatch, canned_collector
) -> None:
    canned_run(canned_collector, n_steps=1000, alerts=[alert(900), alert(100)])
    at = run_app(monkeypatch, canned_collector.url)  # the overview lists the newest first
    at = select_row(at, "alerts:overview", 1)
    assert not at.exception
    assert at.session_state[VIEW_KEY] == "Overview"
    assert at.session_state[SLIDER_KEY] == (0, JUMP_WIDTH_STEPS - 1)
    # The table is drawn again with the jump done: a selection left standing would jump
    # on every rerun, and the page would never settle.
    assert at.session_state["alerts:overview"]["selection"]["rows"] == []
    requests = len(canned_collector.requests)
    at = at.run()
    assert at.session_state[SLIDER_KEY] == (0, JUMP_WIDTH_STEPS - 1)
    assert len(canned_collector.requests) - requests < 10  # one rerun's worth, no loop


def test_a_replaying_collector_is_said_to_be_and_a_live_one_refreshes(
    monkeypatch, canned_collector
) -> None:
    canned_run(canned_collector, n_steps=5)
    at = run_app(monkeypatch, canned_collector.url)
    assert "refreshes every 2 s" in texts(at.sidebar.caption)
    canned_collector.routes["/healthz"] = (200, {"status": "ok", "replay": True})
    at = at.run()
    assert "Replay: a stored run" in texts(at.sidebar.caption)


def layer_answers(values: dict[str, list[float | str | None]], n_layers: int = 2):
    """A layers route answering each metric with its values, step by step (layer 0, 1, ...);
    a metric not in `values` comes back null, as from a run that did not report it."""
    n_cells = len(next(iter(values.values())))

    def answer(query: dict[str, str]) -> tuple[int, dict]:
        return 200, {
            "layer_names": ["emb", "out"][:n_layers],
            "bucket_steps": 1,
            "step": [i // n_layers for i in range(n_cells)],
            "layer": [i % n_layers for i in range(n_cells)],
            "value": values.get(query["metric"], [None] * n_cells),
        }

    return answer


def chart_data(at: AppTest, title: str | None = None) -> list[tuple[dict, dict[str, list]]]:
    """(spec, {dataset name: rows}) of every chart on the page, or of those titled `title`."""
    out = []
    for chart in at.get("vega_lite_chart"):
        spec = json.loads(chart.proto.spec)
        if title is None or spec.get("title") == title:
            data = {
                d.name: pa.ipc.open_stream(d.data.data).read_all().to_pylist()
                for d in chart.proto.datasets
            }
            out.append((spec, data))
    return out


def heatmap_cells(at: AppTest) -> list[tuple[int, int]]:
    """Per heatmap on the page: (cells drawn in colour, cells drawn red)."""
    out = []
    for spec, data in chart_data(at):
        layers = spec.get("layer", [spec])
        red = [lay for lay in layers if lay["mark"].get("color") == INVALID_CELL_COLOR]
        n_red = sum(len(data[lay["data"]["name"]]) for lay in red)
        out.append((sum(map(len, data.values())) - n_red, n_red))
    return out


def test_layers_of_a_clean_run_show_no_non_finite_update_at_its_first_step(
    monkeypatch, canned_collector
) -> None:
    # Update RMS is null at step 0: no optimizer step precedes the run's first step.
    canned_run(canned_collector, n_steps=3)
    canned_collector.routes["/api/v1/runs/r1/layers"] = layer_answers(
        {"grad_norm": [1.0] * 6, "act_rms": [1.0] * 6, "update_rms": [None, None] + [1e-3] * 4}
    )
    at = run_app(monkeypatch, canned_collector.url, view="Layers")
    assert not at.exception
    assert heatmap_cells(at) == [(6, 0), (6, 0), (4, 0)]  # step 0 of the update: blank
    assert not any("Earliest jump" in c.value for c in at.caption)


def test_layers_show_a_non_finite_gradient_and_its_update_in_red(
    monkeypatch, canned_collector
) -> None:
    canned_run(canned_collector, n_steps=3)
    canned_collector.routes["/api/v1/runs/r1/layers"] = layer_answers(
        {
            "grad_norm": [1.0, 1.0, 1.0, "NaN", 1.0, 1.0],  # NaN at step 1, layer "out"
            "act_rms": [1.0] * 6,
            "update_rms": [None, None, 1e-3, "NaN", 1e-3, 1e-3],  # step 0: not measured
        }
    )
    at = run_app(monkeypatch, canned_collector.url, view="Layers")
    assert not at.exception
    assert heatmap_cells(at) == [(5, 1), (6, 0), (3, 1)]
    jumps = [c.value for c in at.caption if "Earliest jump" in c.value]
    assert jumps == ["Earliest jump: **out** at step 1, non-finite."] * 2


def test_layers_of_a_run_non_finite_everywhere_are_red_not_missing(
    monkeypatch, canned_collector
) -> None:
    canned_run(canned_collector, n_steps=3)
    canned_collector.routes["/api/v1/runs/r1/layers"] = layer_answers(
        {"grad_norm": ["NaN"] * 6, "act_rms": ["NaN"] * 6}  # NaN everywhere; no update RMS
    )
    at = run_app(monkeypatch, canned_collector.url, view="Layers")
    assert not at.exception
    assert "No per-layer statistics" not in texts(at.info)
    assert heatmap_cells(at) == [(0, 6), (0, 6)]
    assert "did not report the update RMS" in texts(at.info)


def test_energy_and_tokens_per_joule_after_a_resume_that_restarted_the_counter(
    monkeypatch, canned_collector
) -> None:
    # 500 W, 100 tokens a step; the counter restarted from 0 when the run resumed at
    # step 20. The run used 40 x 500 J = 20 kJ for 4,000 tokens.
    canned_run(canned_collector, n_steps=40)
    columns = canned_collector.routes["/api/v1/runs/r1/steps"][1]["columns"]
    columns["tokens"] = [100] * 40
    columns["power_w"] = [500.0] * 40
    columns["energy_j"] = [500.0 * (s + 1 if s < 20 else s - 19) for s in range(40)]
    at = run_app(monkeypatch, canned_collector.url)
    assert not at.exception
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["energy so far"] == "20 kJ"
    assert metrics["tokens per joule"] == "0.2"
    [(_, energy)] = chart_data(at, "Energy so far")
    [curve] = energy.values()
    joules = [row["energy_so_far_j"] for row in curve]
    assert joules == sorted(joules)  # no drop to zero at the restart
    assert joules[-1] == pytest.approx(20_000)


def rank_grid_answers(values: dict[str, list[float | None]], n_ranks: int = 2):
    """A ranks/grid route answering each (metric, agg) asked with one bucket per rank (the
    window's mean); a metric not in `values` comes back null."""

    def answer(query: dict[str, str | list[str]]) -> tuple[int, dict]:
        metrics, aggs = query["metric"], query["agg"]
        pairs = zip(*(([x] if isinstance(x, str) else x) for x in (metrics, aggs)), strict=True)
        doc = {"bucket_steps": 1, "step": [0] * n_ranks, "rank": list(range(n_ranks))}
        return 200, doc | {f"{a}_{m}": values.get(m, [None] * n_ranks) for m, a in pairs}

    return answer


def test_ranks_view_shows_collective_bandwidth_and_traffic(monkeypatch, canned_collector) -> None:
    canned_run(canned_collector, n_steps=3)
    canned_collector.routes["/api/v1/runs/r1/ranks/grid"] = rank_grid_answers(
        {
            "compute_time_s": [1.0, 1.5],
            "all_gather_bytes": [4e9, 4e9],
            "all_gather_time_s": [2.0, 1.0],
            "all_reduce_bytes": [16.0, 16.0],  # the backend did not time it
        }
    )
    at = run_app(monkeypatch, canned_collector.url, view="Ranks")
    assert not at.exception
    assert "did not report its collectives" not in texts(at.info)
    # The all-reduce is untimed: every collective chart shows bytes per step, one unit.
    assert {"All-gather traffic per rank", "All-reduce traffic per rank"} <= titles(at)
    assert not any("bandwidth" in t for t in titles(at))
    assert "did not time the all-reduce" in texts(at.caption)
    [(_, traffic)] = chart_data(at, "All-gather traffic per rank")
    [bars] = [rows for rows in traffic.values() if "rank" in rows[0]]
    assert [b["value"] for b in bars] == [4e9, 4e9]


def test_ranks_view_shows_bandwidth_when_every_collective_is_timed_and_hides_idle_ones(
    monkeypatch, canned_collector
) -> None:
    canned_run(canned_collector, n_steps=3)
    canned_collector.routes["/api/v1/runs/r1/ranks/grid"] = rank_grid_answers(
        {
            "compute_time_s": [1.0, 1.5],
            "all_gather_bytes": [0.0, 0.0],  # DDP: reported, never used
            "all_reduce_bytes": [4e9, 4e9],
            "all_reduce_time_s": [2.0, 1.0],
        }
    )
    at = run_app(monkeypatch, canned_collector.url, view="Ranks")
    assert not at.exception
    [(_, bandwidth)] = chart_data(at, "All-reduce bandwidth per rank")
    [bars] = [rows for rows in bandwidth.values() if "rank" in rows[0]]
    assert [b["value"] for b in bars] == [2e9, 4e9]  # B/s: 4 GB in 2 s and in 1 s
    assert not any("All-gather" in t for t in titles(at))  # no empty chart for it
    assert "No all-gather traffic" in texts(at.caption)


# ------------------------------------------------------------------ helpers


def test_collector_url_prefers_the_script_arg_then_the_env_var() -> None:
    env = {URL_ENV_VAR: "http://env:1"}
    assert collector_url(["--collector", "http://arg:2"], env) == "http://arg:2"
    assert collector_url(["--co"], env) == "http://env:1"  # pytest's flag, not ours
    assert collector_url([], {}) == "http://127.0.0.1:8000"


def test_count_label() -> None:
    assert count_label(999) == "999"
    assert count_label(139_584) == "139.6 k"
    assert count_label(7_000_000_000) == "7.0 B"


def test_mfu_is_labelled_by_where_its_flops_per_token_came_from(
    monkeypatch, canned_collector
) -> None:
    source = "estimate: 6 x non-embedding parameters per token (dense transformer rule)"
    canned_run(canned_collector, n_steps=3, peak_flops_per_s=1e12, flops_source=source)
    columns = canned_collector.routes["/api/v1/runs/r1/steps"][1]["columns"]
    columns["mfu_ratio"] = [0.05] * 3
    at = run_app(monkeypatch, canned_collector.url)
    assert not at.exception
    [mfu] = [m for m in at.metric if m.label.startswith("MFU")]
    assert mfu.label == "MFU (estimate)" and mfu.value == "5.0 %"
    assert "Model FLOPs utilization (estimate)" in titles(at)
    assert source in texts(at.caption)
    canned_run(canned_collector, n_steps=3, peak_flops_per_s=1e12, flops_source="configured")
    at = run_app(monkeypatch, canned_collector.url)
    assert [m.label for m in at.metric if m.label.startswith("MFU")] == ["MFU"]
    counted = "counted: torch FlopCounterMode over step 0's forward and backward, 1.4e+04 FLOPs"
    canned_run(canned_collector, n_steps=3, peak_flops_per_s=1e12, flops_source=counted)
    canned_collector.routes["/api/v1/runs/r1/steps"][1]["columns"]["mfu_ratio"] = [0.05] * 3
    at = run_app(monkeypatch, canned_collector.url)
    assert [m.label for m in at.metric if m.label.startswith("MFU")] == ["MFU (counted)"]
    assert "Model FLOPs utilization" in titles(at)
    assert f"FLOPs per token {counted}." in texts(at.caption)


def test_the_drill_down_draws_each_layers_update_over_its_parameter_norm(
    monkeypatch, canned_collector
) -> None:
    canned_run(canned_collector, n_steps=3, layer_names=["emb", "out"])
    canned_collector.routes["/api/v1/runs/r1/layers"] = layer_answers(
        {
            "grad_norm": [1.0] * 6,
            "act_rms": [1.0] * 6,
            "update_rms": [None, None, 1e-3, 2e-3, 4e-3, 6e-3],  # no update before step 1
            "param_norm": [2.0, 4.0, 2.0, 4.0, 2.0, 0.0],  # a zero norm: no ratio
        }
    )
    at = run_app(monkeypatch, canned_collector.url, view="Layers")
    at = at.multiselect(key=DRILL_KEY).set_value([0, 1]).run()
    assert not at.exception
    [(spec, data)] = chart_data(at, "Update / parameter ratio")
    [rows] = data.values()
    ratios = {(r["step"], r["layer"]): r["value"] for r in rows if r["value"] is not None}
    assert ratios == pytest.approx({(1, "emb"): 5e-4, (1, "out"): 5e-4, (2, "emb"): 2e-3})
    assert spec["encoding"]["color"]["field"] == "layer"
    assert "update RMS / parameter L2 norm" in texts(at.caption)


def test_the_drill_down_says_why_a_run_without_parameter_norms_has_no_update_ratio(
    monkeypatch, canned_collector
) -> None:
    canned_run(canned_collector, n_steps=3, layer_names=["emb", "out"])
    canned_collector.routes["/api/v1/runs/r1/layers"] = layer_answers(
        {"grad_norm": [1.0] * 6, "act_rms": [1.0] * 6, "update_rms": [1e-3] * 6}
    )
    at = run_app(monkeypatch, canned_collector.url, view="Layers")
    at = at.multiselect(key=DRILL_KEY).set_value([1]).run()
    assert not at.exception
    assert chart_data(at, "Update RMS") and not chart_data(at, "Update / parameter ratio")
    assert any("update / parameter ratio of these layers" in i.value for i in at.info)
