"""Altair charts of the dashboard, built from the query client's DataFrames.

Pure functions of their input: no Streamlit, no network, so each chart can be built and
checked in a test. Every value axis names its unit.
"""

from __future__ import annotations

import math

import altair as alt
import pandas as pd

STEP_AXIS = alt.X("step:Q", title="step", axis=alt.Axis(format="d"))
CHART_HEIGHT_PX = 220
# A heatmap row per layer or rank; beyond ~50 rows the cells get thin but stay readable.
ROW_HEIGHT_PX = 14
MAX_HEATMAP_HEIGHT_PX = 800
# Cells whose value a log colour scale cannot show: NaN/inf (sent as null) or <= 0.
INVALID_CELL_COLOR = "#d62728"
SEVERITY_COLORS = {"critical": "#d62728", "warning": "#ff7f0e"}
EVENT_COLOR = "#1f77b4"
LINEAR_COLOR_QUANTILES = (0.01, 0.99)
AXES_PX = 90
TIMELINE_ROW_PX = 36
# Cells per heatmap: the collector merges steps into buckets so that a grid holds at most
# this many, and 1,024 ranks cost the browser what 100 do (about 0.4 MB of chart data).
MAX_HEATMAP_CELLS = 30_000
# Columns of a heatmap with few rows: about one per 3 px of a laptop-wide chart.
MAX_HEATMAP_STEPS = 300
# Beyond this many ranks on an axis, label every k-th one only.
MAX_RANK_LABELS = 64


def heatmap_steps(n_rows: int) -> int:
    """Step buckets to ask for so that a grid of `n_rows` rows stays within the cell budget."""
    return max(1, min(MAX_HEATMAP_STEPS, MAX_HEATMAP_CELLS // max(1, n_rows)))


def band_line(
    frame: pd.DataFrame, mean_col: str, max_col: str, title: str, y_title: str
) -> alt.LayerChart:
    """The bucket mean as a line, with a band up to the bucket's max (e.g. loss spikes)."""
    base = alt.Chart(frame[["step", mean_col, max_col]]).encode(x=STEP_AXIS)
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
        alt.Chart(frame[["step", col]])
        .mark_line()
        .encode(
            x=STEP_AXIS,
            y=alt.Y(f"{col}:Q", title=y_title, scale=alt.Scale(zero=False)),
            tooltip=["step:Q", f"{col}:Q"],
        )
        .properties(title=title, height=CHART_HEIGHT_PX)
    )


def layer_heatmap(
    frame: pd.DataFrame,
    bucket_steps: int,
    value_title: str,
    steps: tuple[int, int] | None = None,
) -> alt.Chart | alt.LayerChart:
    """Step x layer heatmap on a log colour scale, layers in model order on the y axis.

    `frame` has columns step, layer, layer_name, value (the client's `layers()`) and,
    optionally, `nonfinite` (derive.nonfinite_cells). Cells a log scale cannot show
    (non-finite or <= 0) are drawn in red rather than dropped: a NaN gradient in one layer
    is exactly what this chart is for. A null cell that `nonfinite` does not flag was
    never measured and is left blank; without `nonfinite`, every null is non-finite.
    `steps` (first, end) fixes the x range, so that heatmaps stacked above each other
    line up.
    """
    order = list(frame.sort_values("layer")["layer_name"].unique())
    y = alt.Y("layer_name:N", title="layer", sort=order)
    if "nonfinite" in frame:
        frame = frame[frame["value"].notna() | frame["nonfinite"]]
    cells = _cells(frame, "layer_name").astype({"layer_name": "category"})
    return _heatmap(
        cells, bucket_steps, y, value_title, log_scale=True, steps=steps, n_rows=len(order)
    )


def rank_heatmap(
    frame: pd.DataFrame,
    bucket_steps: int,
    value_title: str,
    steps: tuple[int, int] | None = None,
) -> alt.Chart | alt.LayerChart:
    """Step x rank heatmap (linear colour scale): a straggler is a bright row."""
    n_ranks = frame["rank"].nunique()
    y = alt.Y("rank:O", title="rank", axis=_rank_axis(n_ranks))
    cells = _cells(frame, "rank").astype({"rank": "int32"})
    return _heatmap(
        cells, bucket_steps, y, value_title, log_scale=False, steps=steps, n_rows=n_ranks
    )


def status_heatmap(
    frame: pd.DataFrame, bucket_steps: int, colors: dict[str, str], title: str
) -> alt.Chart:
    """Step x rank heatmap of a categorical `status` column, one colour per status."""
    n_ranks = frame["rank"].nunique()
    cells = frame[["step", "rank", "status"]].astype(
        {"step": "int32", "rank": "int32", "status": "category"}
    )
    scale = alt.Scale(domain=list(colors), range=list(colors.values()))
    return (
        alt.Chart(cells)
        .transform_calculate(step_end=f"datum.step + {bucket_steps}")
        .mark_rect()
        .encode(
            x=alt.X("step:Q", title="step", axis=alt.Axis(format="d")),
            x2="step_end:Q",
            y=alt.Y("rank:O", title="rank", axis=_rank_axis(n_ranks)),
            color=alt.Color("status:N", title=title, scale=scale),
            tooltip=["step:Q", "rank:O", "status:N"],
        )
        .properties(height=_heatmap_height(n_ranks))
    )


def alert_timeline(alerts: pd.DataFrame, events: pd.DataFrame, steps: tuple[int, int]) -> alt.Chart:
    """Alerts (points, by severity) and run events (ticks) on one step axis.

    `alerts` has step, kind, severity, message, value, baseline; `events` has step, rank,
    kind. The tooltip carries each alert's evidence: what was observed, what was expected.
    """
    x = alt.X("step:Q", title="step", axis=alt.Axis(format="d"), scale=alt.Scale(domain=steps))
    y = alt.Y("kind:N", title=None)
    points = (
        alt.Chart(alerts)
        .mark_point(filled=True, size=90)
        .encode(
            x=x,
            y=y,
            color=alt.Color(
                "severity:N",
                scale=alt.Scale(domain=list(SEVERITY_COLORS), range=list(SEVERITY_COLORS.values())),
            ),
            tooltip=[
                "step:Q",
                "kind:N",
                "severity:N",
                alt.Tooltip("value:Q", title="observed", format=".4g"),
                alt.Tooltip("baseline:Q", title="expected", format=".4g"),
                "message:N",
            ],
        )
    )
    ticks = (
        alt.Chart(events)
        .mark_tick(thickness=2, color=EVENT_COLOR)
        .encode(x=x, y=y, tooltip=["step:Q", "rank:Q", "kind:N", "detail:N"])
    )
    n_rows = alerts["kind"].nunique() + events["kind"].nunique()
    # Streamlit fits title and axes into the height: AXES_PX of it is not plot.
    height_px = AXES_PX + TIMELINE_ROW_PX * n_rows
    return (points + ticks).properties(height=height_px, title="Alerts and events")


def rank_mean_bar(
    frame: pd.DataFrame, value_title: str, title: str = "Mean per rank"
) -> alt.LayerChart:
    """Mean of `value` per rank as bars, with a dashed rule at the median over ranks.

    A straggler stands above the rule; the median (not the mean) keeps one slow rank
    from pulling the reference up to itself.
    """
    means = frame.groupby("rank", as_index=False)["value"].mean()
    bars = (
        alt.Chart(means)
        .mark_bar()
        .encode(
            x=alt.X("rank:O", title="rank", axis=_rank_axis(len(means), labelAngle=0)),
            y=alt.Y("value:Q", title=value_title),
            tooltip=["rank:O", alt.Tooltip("value:Q", title=value_title, format=".4g")],
        )
    )
    median = alt.Chart(pd.DataFrame({"median": [means["value"].median()]})).mark_rule(
        strokeDash=[4, 4]
    )
    rule = median.encode(y="median:Q")
    return (bars + rule).properties(title=title, height=CHART_HEIGHT_PX)


def _cells(frame: pd.DataFrame, row: str) -> pd.DataFrame:
    """The columns a heatmap draws, in the narrowest types that hold them.

    What a chart holds travels to the browser on every refresh: a 30,000-cell grid takes
    about 0.5 MB this way, three times that as float64 with a column of end steps.
    """
    return frame[["step", row, "value"]].astype({"step": "int32", "value": "float32"})


def _heatmap(
    cells: pd.DataFrame,
    bucket_steps: int,
    y: alt.Y,
    value_title: str,
    *,
    log_scale: bool,
    steps: tuple[int, int] | None,
    n_rows: int,
) -> alt.Chart | alt.LayerChart:
    valid = cells["value"].notna()
    if log_scale:
        valid &= cells["value"] > 0
    if log_scale:
        scale = alt.Scale(type="log", scheme="viridis")
    else:
        # Clamped to the central 98 % of values: one slow start-up step would otherwise
        # take the whole colour range and leave a straggler's row as dark as the rest.
        low, high = cells.loc[valid, "value"].quantile(LINEAR_COLOR_QUANTILES)
        scale = alt.Scale(scheme="inferno", domain=[low, high], clamp=True)
    x_scale = alt.Scale(domain=steps) if steps else alt.Undefined
    x = alt.X("step:Q", title="step", axis=alt.Axis(format="d"), scale=x_scale)
    tooltip = ["step:Q", y.shorthand, alt.Tooltip("value:Q", title=value_title, format=".4g")]
    # Each cell spans its bucket of steps: x from the bucket's step to the next bucket's.
    step_end = {"step_end": f"datum.step + {bucket_steps}"}
    chart = (
        alt.Chart(cells[valid])
        .transform_calculate(**step_end)
        .mark_rect()
        .encode(
            x=x,
            x2="step_end:Q",
            y=y,
            color=alt.Color(
                "value:Q", title=value_title, scale=scale, legend=alt.Legend(format=".3g")
            ),
            tooltip=tooltip,
        )
    )
    if not valid.all():
        invalid = alt.Chart(cells[~valid]).transform_calculate(**step_end)
        chart += invalid.mark_rect(color=INVALID_CELL_COLOR).encode(
            x=x, x2="step_end:Q", y=y, tooltip=tooltip
        )
    return chart.properties(height=_heatmap_height(n_rows))


def _heatmap_height(n_rows: int) -> int:
    return min(MAX_HEATMAP_HEIGHT_PX, max(CHART_HEIGHT_PX, ROW_HEIGHT_PX * n_rows))


def _rank_axis(n_ranks: int, **kwargs) -> alt.Axis:
    """A rank axis that labels every rank while they fit, and every k-th beyond."""
    every = max(1, math.ceil(n_ranks / MAX_RANK_LABELS))
    return alt.Axis(labelExpr=f"datum.value % {every} == 0 ? datum.label : ''", **kwargs)
