"""Altair charts of the dashboard, built from the query client's DataFrames.

Pure functions of their input: no Streamlit, no network, so each chart can be built and
checked in a test. Every value axis names its unit.
"""

from __future__ import annotations

import altair as alt
import pandas as pd

STEP_AXIS = alt.X("step:Q", title="step", axis=alt.Axis(format="d"))
CHART_HEIGHT_PX = 220
# A heatmap row per layer or rank; beyond ~50 rows the cells get thin but stay readable.
ROW_HEIGHT_PX = 14
MAX_HEATMAP_HEIGHT_PX = 800
# Cells whose value a log colour scale cannot show: NaN/inf (sent as null) or <= 0.
INVALID_CELL_COLOR = "#d62728"


def band_line(
    frame: pd.DataFrame, mean_col: str, max_col: str, title: str, y_title: str
) -> alt.LayerChart:
    """The bucket mean as a line, with a band up to the bucket's max (e.g. loss spikes)."""
    base = alt.Chart(frame).encode(x=STEP_AXIS)
    band = base.mark_area(opacity=0.25).encode(
        y=alt.Y(f"{mean_col}:Q", title=y_title, scale=alt.Scale(zero=False)),
        y2=f"{max_col}:Q",
    )
    line = base.mark_line().encode(
        y=f"{mean_col}:Q", tooltip=["step:Q", f"{mean_col}:Q", f"{max_col}:Q"]
    )
    return (band + line).properties(title=title, height=CHART_HEIGHT_PX)


def line(frame: pd.DataFrame, col: str, title: str, y_title: str) -> alt.Chart:
    """One metric over steps."""
    return (
        alt.Chart(frame)
        .mark_line()
        .encode(
            x=STEP_AXIS,
            y=alt.Y(f"{col}:Q", title=y_title, scale=alt.Scale(zero=False)),
            tooltip=["step:Q", f"{col}:Q"],
        )
        .properties(title=title, height=CHART_HEIGHT_PX)
    )


def layer_heatmap(
    frame: pd.DataFrame, bucket_steps: int, value_title: str
) -> alt.Chart | alt.LayerChart:
    """Step x layer heatmap on a log colour scale, layers in model order on the y axis.

    `frame` has columns step, layer, layer_name, value (the client's `layers()`). Cells a
    log scale cannot show (non-finite or <= 0) are drawn in red rather than dropped: a
    NaN gradient in one layer is exactly what this chart is for.
    """
    order = list(frame.sort_values("layer")["layer_name"].unique())
    y = alt.Y("layer_name:N", title="layer", sort=order)
    return _heatmap(frame, bucket_steps, y, value_title, log_scale=True, n_rows=len(order))


def rank_heatmap(
    frame: pd.DataFrame, bucket_steps: int, value_title: str
) -> alt.Chart | alt.LayerChart:
    """Step x rank heatmap (linear colour scale): a straggler is a bright row."""
    n_ranks = frame["rank"].nunique()
    y = alt.Y("rank:O", title="rank")
    return _heatmap(frame, bucket_steps, y, value_title, log_scale=False, n_rows=n_ranks)


def rank_mean_bar(frame: pd.DataFrame, value_title: str) -> alt.LayerChart:
    """Mean of `value` per rank as bars, with a dashed rule at the median over ranks.

    A straggler stands above the rule; the median (not the mean) keeps one slow rank
    from pulling the reference up to itself.
    """
    means = frame.groupby("rank", as_index=False)["value"].mean()
    bars = (
        alt.Chart(means)
        .mark_bar()
        .encode(
            x=alt.X("rank:O", title="rank", axis=alt.Axis(labelAngle=0)),
            y=alt.Y("value:Q", title=value_title),
            tooltip=["rank:O", alt.Tooltip("value:Q", title=value_title, format=".4g")],
        )
    )
    median = alt.Chart(pd.DataFrame({"median": [means["value"].median()]})).mark_rule(
        strokeDash=[4, 4]
    )
    rule = median.encode(y="median:Q")
    return (bars + rule).properties(title="Mean per rank", height=CHART_HEIGHT_PX)


def _heatmap(
    frame: pd.DataFrame,
    bucket_steps: int,
    y: alt.Y,
    value_title: str,
    *,
    log_scale: bool,
    n_rows: int,
) -> alt.Chart | alt.LayerChart:
    # Each cell spans its bucket of steps: x from the bucket's step to the next bucket's.
    cells = frame.assign(step_end=frame["step"] + bucket_steps)
    valid = cells["value"].notna()
    if log_scale:
        valid &= cells["value"] > 0
    scale = alt.Scale(type="log", scheme="viridis") if log_scale else alt.Scale(scheme="inferno")
    x = alt.X("step:Q", title="step", axis=alt.Axis(format="d"))
    tooltip = ["step:Q", y.shorthand, alt.Tooltip("value:Q", title=value_title, format=".4g")]
    chart = (
        alt.Chart(cells[valid])
        .mark_rect()
        .encode(
            x=x,
            x2="step_end:Q",
            y=y,
            color=alt.Color("value:Q", title=value_title, scale=scale),
            tooltip=tooltip,
        )
    )
    if not valid.all():
        invalid = alt.Chart(cells[~valid]).mark_rect(color=INVALID_CELL_COLOR)
        chart += invalid.encode(x=x, x2="step_end:Q", y=y, tooltip=tooltip)
    height_px = min(MAX_HEATMAP_HEIGHT_PX, max(CHART_HEIGHT_PX, ROW_HEIGHT_PX * n_rows))
    return chart.properties(height=height_px)
