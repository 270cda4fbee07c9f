"""Chart builders: what a reader of the heatmaps relies on."""

from __future__ import annotations

import math

import pandas as pd

from trainvitals.dashboard import charts


def layer_frame(values: list[float]) -> pd.DataFrame:
    # Rows deliberately out of model order: the y axis must follow the layer index.
    return pd.DataFrame(
        {"step": [0, 0, 0], "layer": [2, 0, 1], "layer_name": ["out", "emb", "h0"], "value": values}
    )


def test_layer_heatmap_orders_layers_by_index_on_a_log_scale() -> None:
    spec = charts.layer_heatmap(layer_frame([1.0, 0.5, 0.1]), 10, "grad norm").to_dict()
    assert spec["encoding"]["y"]["sort"] == ["emb", "h0", "out"]
    assert spec["encoding"]["color"]["scale"]["type"] == "log"
    assert spec["height"] >= charts.CHART_HEIGHT_PX


def test_layer_heatmap_draws_nan_and_zero_cells_in_red_instead_of_dropping_them() -> None:
    frame = layer_frame([math.nan, 0.0, 0.1])
    spec = charts.layer_heatmap(frame, 10, "grad norm").to_dict()
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
