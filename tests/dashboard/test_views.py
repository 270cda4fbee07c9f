"""Markers, deep links, run comparison, layer drill-down and the node view, in AppTest
against a real collector (subprocess, DuckDB store) holding two runs sent through ingest
(tests/dashboard/two_runs.py, fixture `two_runs`)."""

from __future__ import annotations

import pytest

from tests.dashboard.test_app import chart_data, chart_specs, run_app, texts, titles
from tests.dashboard.two_runs import LOG_EVERY, SPIKE_STEP, STEPS
from trainvitals.dashboard.charts import ROW_AXIS_PX
from trainvitals.dashboard.compare import AXIS_KEY, SMOOTH_KEY
from trainvitals.dashboard.layers import DRILL_KEY
from trainvitals.dashboard.nodes import NODE_KEY
from trainvitals.dashboard.state import SLIDER_KEY, VIEW_KEY, jump_for


def all_layers(spec: dict) -> list[dict]:
    """A chart's layers, nested ones included (a chart with markers nests its own)."""
    out = [spec]
    for layer in spec.get("layer", []):
        out += all_layers(layer)
    return out


def marker_layers(spec: dict) -> list[dict]:
    """The layers of a chart that carry a link: its markers."""
    return [layer for layer in all_layers(spec) if "href" in layer.get("encoding", {})]


def test_every_time_series_chart_carries_the_alert_and_event_markers(monkeypatch, two_runs) -> None:
    at = run_app(monkeypatch, two_runs)
    assert not at.exception
    assert at.sidebar.selectbox[0].value == "faulty"
    charts = chart_data(at)
    assert len(charts) >= 8  # loss, grad norm, throughput, lr, MFU, FLOP/s, power, energy...
    for spec, data in charts:
        layers = marker_layers(spec)
        assert layers, spec.get("title")
        marks = data[layers[0]["data"]["name"]]
        by_kind = {m["kind"]: m for m in marks}
        spike = by_kind["loss_spike"]
        assert spike["step"] == SPIKE_STEP and spike["severity"] == "warning"
        assert spike["message"]  # the analyzer's message, shown on hover
        assert spike["href"] == f"?run=faulty&view=Health&step={SPIKE_STEP}"
        assert by_kind["fault:straggler"]["severity"] == "event"
        colors = layers[0]["encoding"]["color"]["scale"]
        assert dict(zip(colors["domain"], colors["range"], strict=True))["warning"] == "#ff7f0e"
        assert {"message", "severity"} <= {t["field"] for t in layers[0]["encoding"]["tooltip"]}


def test_every_time_series_chart_of_a_view_shares_one_step_axis(monkeypatch, two_runs) -> None:
    at = run_app(monkeypatch, two_runs)
    at = at.sidebar.slider[0].set_value((50, 200)).run()
    for view in ("Overview", "Layers", "Ranks", "Nodes", "Health"):
        at.session_state[VIEW_KEY] = view
        at = at.run()
        domains, ticks = set(), set()
        for spec in chart_specs(at):
            for layer in all_layers(spec):
                x = layer.get("encoding", {}).get("x", {})
                if x.get("field") == "step":
                    domains.add(tuple(x["scale"]["domain"]))
                    ticks.add(tuple(x["axis"]["values"]))
        # The Overview's power row (three charts to a row) too: the same steps and ticks
        # as the two-to-a-row charts above it, whatever their widths.
        assert domains == {(50, 201)}, view
        assert ticks == {(50, 100, 150, 200)}, view
        if view in ("Layers", "Health"):
            # Stacked heatmaps and the timeline: one row-axis width and legends above, so
            # their plots start and end at the same pixel, not only at the same step.
            for spec in chart_specs(at):
                rows = [layer["encoding"]["y"] for layer in all_layers(spec)
                        if "y" in layer.get("encoding", {})]  # fmt: skip
                assert {y["axis"]["minExtent"] for y in rows} == {ROW_AXIS_PX}, view
                legends = [layer["encoding"]["color"].get("legend") for layer in all_layers(spec)
                           if "color" in layer.get("encoding", {})]  # fmt: skip
                assert all(legend and legend["orient"] == "top" for legend in legends), view


def test_a_deep_link_opens_the_health_view_at_its_step(monkeypatch, two_runs) -> None:
    monkeypatch.setenv("TRAINVITALS_COLLECTOR_URL", two_runs)
    from streamlit.testing.v1 import AppTest

    from tests.dashboard.test_app import RUN_TIMEOUT_S
    from trainvitals.dashboard.launch import APP_PATH

    at = AppTest.from_file(str(APP_PATH), default_timeout=RUN_TIMEOUT_S)
    at.query_params["run"] = "baseline"
    at.query_params["step"] = str(SPIKE_STEP)
    at = at.run()
    assert not at.exception and not at.warning
    assert at.session_state[VIEW_KEY] == "Health"
    assert at.sidebar.selectbox[0].value == "baseline"
    jump = jump_for("baseline", SPIKE_STEP, STEPS[-1])
    assert at.session_state[SLIDER_KEY] == (jump.start, jump.end)
    # The URL now says what the page shows, so the address bar can be shared.
    assert at.query_params["view"] == "Health" and at.query_params["run"] == "baseline"
    # Choosing another view rewrites it.
    at.session_state[VIEW_KEY] = "Layers"
    at = at.run()
    assert at.query_params["view"] == "Layers"


def test_a_deep_link_with_a_window_keeps_it_in_the_url(monkeypatch, two_runs) -> None:
    monkeypatch.setenv("TRAINVITALS_COLLECTOR_URL", two_runs)
    from streamlit.testing.v1 import AppTest

    from tests.dashboard.test_app import RUN_TIMEOUT_S
    from trainvitals.dashboard.launch import APP_PATH

    at = AppTest.from_file(str(APP_PATH), default_timeout=RUN_TIMEOUT_S)
    for key, value in {"run": "faulty", "view": "Ranks", "start": "100", "end": "150"}.items():
        at.query_params[key] = value
    at = at.run()
    assert not at.exception and not at.warning
    assert at.session_state[VIEW_KEY] == "Ranks"
    assert at.session_state[SLIDER_KEY] == (100, 150)
    assert (at.query_params["start"], at.query_params["end"]) == ("100", "150")


@pytest.mark.parametrize(
    ("params", "says"),
    [
        ({"run": "nope"}, "names run 'nope', which this collector does not hold"),
        ({"run": "faulty", "step": "abc"}, "step 'abc' is not a step number"),
        ({"run": "faulty", "view": "Secret"}, "view 'Secret' is not one of"),
        ({"run": "faulty", "start": "200", "end": "100"}, "window 200 to 100 is empty"),
        ({"run": "faulty", "step": "99999"}, "has no step 99,999 yet"),
    ],
)
def test_a_bad_deep_link_says_what_is_wrong_and_shows_a_run(
    monkeypatch, two_runs, params, says
) -> None:
    monkeypatch.setenv("TRAINVITALS_COLLECTOR_URL", two_runs)
    from streamlit.testing.v1 import AppTest

    from tests.dashboard.test_app import RUN_TIMEOUT_S
    from trainvitals.dashboard.launch import APP_PATH

    at = AppTest.from_file(str(APP_PATH), default_timeout=RUN_TIMEOUT_S)
    for key, value in params.items():
        at.query_params[key] = value
    at = at.run()
    assert not at.exception
    assert says in texts(at.warning)
    assert at.get("vega_lite_chart")  # a view is shown all the same


def test_runs_are_compared_on_the_step_or_the_wall_time_axis_with_smoothing(
    monkeypatch, two_runs
) -> None:
    at = run_app(monkeypatch, two_runs, view="Compare")
    assert not at.exception
    assert {"Loss", "Gradient norm, before clipping", "Throughput", "Power, all devices"} <= (
        titles(at)
    )
    assert "Model FLOPs utilization" in titles(at)
    [(spec, loss)] = chart_data(at, "Loss")
    [rows] = loss.values()
    assert {r["run"] for r in rows} == {"faulty", "baseline"}
    assert spec["encoding"]["x"]["field"] == "step"
    raw_peak = max(r["value"] for r in rows)
    # Wall time: each run from its own start, in hours.
    at = at.radio(key=AXIS_KEY).set_value("wall time").run()
    [(spec, loss)] = chart_data(at, "Loss")
    assert spec["encoding"]["x"]["field"] == "wall_h"
    [rows] = loss.values()
    first = min(r["wall_h"] for r in rows if r["run"] == "faulty")
    assert first == pytest.approx(1 / 3600)
    # Smoothing flattens the spike.
    at = at.slider(key=SMOOTH_KEY).set_value(0.9).run()
    [(_, loss)] = chart_data(at, "Loss")
    [rows] = loss.values()
    assert max(r["value"] for r in rows) < raw_peak


def test_layer_drill_down_draws_the_chosen_layers_as_lines(monkeypatch, two_runs) -> None:
    at = run_app(monkeypatch, two_runs, view="Layers")
    assert not at.exception
    assert "Pick up to" in texts(at.caption)
    at = at.multiselect(key=DRILL_KEY).set_value([1, 2]).run()
    assert not at.exception
    [(spec, grads)] = chart_data(at, "Gradient L2 norm")
    [rows] = grads.values()
    assert {r["layer"] for r in rows} == {"block.0", "block.1"}
    assert spec["encoding"]["color"]["field"] == "layer"
    assert sorted({r["value"] for r in rows}) == pytest.approx([0.2, 0.3])


def test_heatmap_cells_reach_the_next_logged_step(monkeypatch, two_runs) -> None:
    at = run_app(monkeypatch, two_runs, view="Layers")
    [(_, data)] = chart_data(at, None)[:1]
    [cells] = [d for d in data.values() if d and "step_end" in d[0]]
    ends = {c["step"]: c["step_end"] for c in cells}
    assert all(ends[s] == s + LOG_EVERY for s in STEPS)  # no blank column in between


def test_nodes_view_groups_ranks_by_host_and_lists_a_nodes_ranks(monkeypatch, two_runs) -> None:
    at = run_app(monkeypatch, two_runs, view="Nodes")
    assert not at.exception
    table = at.dataframe[0].value
    assert table["host"].tolist() == ["node-a", "node-b"]  # slowest first (rank 3: 0.8 s)
    assert table["ranks"].tolist() == [2, 2]
    assert table["power"].tolist() == ["200 W", "200 W"]
    assert "Not reported by this run: network in" in texts(at.caption)
    assert "Step time per node" in [h.value for h in at.subheader]
    at = at.selectbox(key=NODE_KEY).set_value("node-a").run()
    ranks = at.dataframe[1].value
    assert ranks["rank"].tolist() == [1, 3]
