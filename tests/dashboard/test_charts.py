"""Chart builders: what a reader of the heatmaps relies on."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from trainvitals.dashboard import charts


def layer_frame(values: list[float]) -> pd.DataFrame:
    # Rows deliberately out of model order: the y axis must follow the layer index.
    return pd.DataFrame(
        {"step": [0, 0, 0], "layer": [2, 0, 1], "layer_name": ["out", "emb", "h0"], "value": values}
    )


def test_layer_heatmap_orders_layers_by_index_on_a_log_scale() -> None:
    spec = charts.layer_heatmap(layer_frame([1.0, 0.5, 0.1]), 10, "grad norm", (0, 10)).to_dict()
    assert spec["encoding"]["y"]["sort"] == ["emb", "h0", "out"]
    assert spec["encoding"]["color"]["scale"]["type"] == "log"
    assert spec["height"] >= charts.CHART_HEIGHT_PX


def test_layer_heatmap_draws_nan_and_zero_cells_in_red_instead_of_dropping_them() -> None:
    frame = layer_frame([math.nan, 0.0, 0.1])
    spec = charts.layer_heatmap(frame, 10, "grad norm", (0, 10)).to_dict()
    valid, invalid = spec["layer"]
    assert invalid["mark"]["color"] == charts.INVALID_CELL_COLOR
    assert len(spec["datasets"][invalid["data"]["name"]]) == 2
    assert len(spec["datasets"][valid["data"]["name"]]) == 1


def test_rank_mean_bar_marks_the_median_over_ranks() -> None:
    values = [1.0, 1.2, 3.0, 5.0]
    frame = pd.DataFrame({"step": [0, 0, 0, 5], "rank": [0, 1, 2, 2], "value": values})
    spec = charts.rank_mean_bar(frame, "mean step time (s)").to_dict()
    [median] = [d for d in spec["datasets"].values() if "median" in d[0]]
    assert median == [{"median": 1.2}]  # rank means 1.0, 1.2, 4.0


def test_rank_heatmap_colours_clamp_to_central_values_so_one_outlier_cannot_flatten_them() -> None:
    values = [1.0] * 99 + [1000.0]  # one start-up step, a hundred times slower than the rest
    frame = pd.DataFrame({"step": range(100), "rank": [0] * 100, "value": values})
    scale = charts.rank_heatmap(frame, 1, "compute time (s)", (0, 100)).to_dict()["encoding"][
        "color"
    ]
    assert scale["scale"]["clamp"] is True
    assert scale["scale"]["domain"][1] < 1000.0


def test_heatmaps_carry_only_the_columns_they_draw_in_narrow_types() -> None:
    # What a chart holds goes to the browser on every refresh.
    frame = pd.DataFrame({"step": [0, 1], "rank": [0, 0], "value": [1.0, 2.0], "extra": [0, 0]})
    data = charts.rank_heatmap(frame, 1, "s", (0, 2)).data
    assert list(data.columns) == ["step", "step_end", "rank", "value"]
    assert {str(t) for t in data.dtypes} == {"int32", "float32"}


def test_alert_timeline_has_a_row_per_kind_and_the_evidence_in_the_tooltip() -> None:
    alerts = pd.DataFrame(
        {
            "step": [49, 120],
            "kind": ["straggler", "sdc"],
            "severity": ["warning", "critical"],
            "message": ["rank 1 is slow", "rank 2 differs"],
            "value": [1.3, None],
            "baseline": [1.0, None],
        }
    )
    events = pd.DataFrame(
        {"step": [80], "rank": [1], "kind": ["fault:straggler"], "detail": ["{}"]}
    )
    spec = charts.alert_timeline(alerts, events, (0, 200)).to_dict()
    points = spec["layer"][0]
    tooltip = {t.get("title", t["field"]) for t in points["encoding"]["tooltip"]}
    assert {"observed", "expected", "message"} <= tooltip
    assert points["encoding"]["x"]["scale"]["domain"] == [0, 200]
    rows = {r["kind"] for d in spec["datasets"].values() for r in d}
    assert rows == {"straggler", "sdc", "fault:straggler"}
    assert spec["height"] > charts.AXES_PX + 2 * charts.TIMELINE_ROW_PX


def test_heatmap_steps_keep_wide_grids_within_the_cell_budget() -> None:
    assert charts.heatmap_steps(5) == charts.MAX_HEATMAP_STEPS
    assert charts.heatmap_steps(1024) * 1024 <= charts.MAX_HEATMAP_CELLS
    assert charts.heatmap_steps(10**6) == 1


def test_layer_heatmap_leaves_a_value_never_measured_blank_and_a_non_finite_one_red() -> None:
    # Update RMS: layer "out" was never measured at step 0, "h0" non-finite.
    frame = layer_frame([math.nan, 1e-3, math.nan]).assign(nonfinite=[False, False, True])
    spec = charts.layer_heatmap(frame, 1, "update RMS", (0, 10)).to_dict()
    valid, invalid = spec["layer"]
    assert [c["layer_name"] for c in spec["datasets"][invalid["data"]["name"]]] == ["h0"]
    assert [c["layer_name"] for c in spec["datasets"][valid["data"]["name"]]] == ["emb"]


def test_markers_keep_to_the_window_and_merge_one_kind_of_event_at_a_step() -> None:
    alerts = pd.DataFrame(
        {
            "step": [5, 50],
            "severity": ["critical", "warning"],
            "kind": ["sdc", "loss_spike"],
            "message": ["ranks differ", None],
        }
    ).astype({"step": "Int64"})
    events = pd.DataFrame(
        {
            "step": [20, 20, 80],
            "rank": [0, 1, 0],
            "kind": ["restart"] * 3,
            "detail": ["{}", "{}", '{"why": "oom"}'],
        }
    )
    marks = charts.markers("r 1", alerts, events, (10, 100))
    assert marks["step"].tolist() == [20, 50, 80]
    assert marks["severity"].tolist() == ["event", "warning", "event"]
    assert marks["message"].tolist() == ["restart (2 ranks)", "", 'restart: {"why": "oom"}']
    assert marks["href"][1] == "?run=r+1&view=Health&step=50"
    assert charts.markers("r", alerts, events, (60, 70)).empty  # nothing in the window


def test_heatmap_cells_span_to_the_next_logged_step_and_the_last_one_its_gap() -> None:
    ends = charts.step_ends(pd.Series([0, 0, 10, 20, 20]), bucket_steps=1)
    assert ends.tolist() == [10, 10, 20, 30, 30]
    assert charts.step_ends(pd.Series([7]), bucket_steps=4).tolist() == [11]


def _x_axes(spec: dict) -> list[dict]:
    """The step x encodings of a chart and of all its layers."""
    found = [spec["encoding"]["x"]] if spec.get("encoding", {}).get("x") else []
    for layer in spec.get("layer", []):
        found += _x_axes(layer)
    return [x for x in found if x.get("field") == "step"]


def test_every_time_series_chart_takes_the_views_steps_and_ticks() -> None:
    # A power row (three narrow charts) and a loss row (two wider ones) of one view, over
    # steps 0-299 (a window of 300 logged steps): the same domain and the same ticks in all.
    steps = (0, 300)
    frame = pd.DataFrame({"step": range(0, 300, 5), "loss": 3.0, "loss_max": 3.5, "power_w": 400.0})
    marks = pd.DataFrame(
        {"step": [100], "severity": ["warning"], "kind": ["loss_spike"], "message": [""],
         "href": ["?"]}
    )  # fmt: skip
    cells = pd.DataFrame({"step": [0, 150], "rank": [0, 0], "value": [1.0, 2.0]})
    specs = [
        charts.band_line(frame, "loss", "loss_max", "Loss", "loss", steps, marks),
        charts.line(frame, "power_w", "Power", "W", steps),
        charts.line(frame.iloc[:10], "power_w", "Power, first steps", "W", steps, marks),
        charts.rank_heatmap(cells, 150, "s", steps),
    ]
    axes = [x for chart in specs for x in _x_axes(chart.to_dict())]
    assert len(axes) >= 6
    assert {tuple(x["scale"]["domain"]) for x in axes} == {(0, 300)}
    assert {tuple(x["axis"]["values"]) for x in axes} == {(0, 50, 100, 150, 200, 250, 300)}


@pytest.mark.parametrize(
    "steps, ticks",
    [((0, 300), range(0, 301, 50)), ((50, 201), range(50, 201, 50)), ((7, 12), range(7, 13)),
     ((1000, 1010), range(1000, 1011, 2))],
)  # fmt: skip
def test_step_ticks_are_round_and_within_the_steps(steps, ticks) -> None:
    assert charts.step_ticks(steps) == list(ticks)


def test_a_step_axis_needs_an_end_after_its_first_step() -> None:
    with pytest.raises(ValueError, match="steps"):
        charts.step_x((10, 10))
