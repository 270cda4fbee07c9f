"""Altair charts of the dashboard, built from the query client's DataFrames.

Pure functions of their input: no Streamlit, no network, so each chart can be built and
checked in a test. Every value axis names its unit and labels its ticks with SI prefixes
(d3-format's "s": 0.00019 -> "190u", 1.2e9 -> "1.2G"), so a value reads the same whatever
its magnitude. Time-series charts take the view's step range (`steps`), so that the charts
of one view share one step axis, and the run's alert and event markers (`marks`).
"""

from __future__ import annotations

import math
from urllib.parse import urlencode

import altair as alt
import pandas as pd

STEP_AXIS = alt.X("step:Q", title="step", axis=alt.Axis(format="d"))
# Value axes and tooltips: three significant digits with an SI prefix, trailing zeros off.
SI_FORMAT = ".3~s"
CHART_HEIGHT_PX = 220
# A heatmap row per layer or rank; beyond ~50 rows the cells get thin but stay readable.
ROW_HEIGHT_PX = 14
MAX_HEATMAP_HEIGHT_PX = 800
# Cells whose value a log colour scale cannot show: NaN, inf or <= 0.
INVALID_CELL_COLOR = "#d62728"
SEVERITY_COLORS = {"critical": "#d62728", "warning": "#ff7f0e"}
EVENT_COLOR = "#1f77b4"
# Marker colours: alerts by severity, run events (faults, restarts, checkpoints) in blue.
MARKER_COLORS = {**SEVERITY_COLORS, "event": EVENT_COLOR}
# Markers per chart: beyond this many in a window, the newest are drawn (a rule per pixel
# column of a half-width chart would hide the line under it).
MAX_MARKERS = 200
MARKER_COLUMNS = ["step", "severity", "kind", "message", "href"]
LINEAR_COLOR_QUANTILES = (0.01, 0.99)
AXES_PX = 90
TIMELINE_ROW_PX = 36
# Cells per heatmap: the collector merges steps into buckets so that a grid holds at most
# this many, and 1,024 ranks cost the browser what 100 do (about 0.4 MB of chart data).
MAX_HEATMAP_CELLS = 30_000
# Columns of a heatmap with few rows: about one per 3 px of a laptop-wide chart.
MAX_HEATMAP_STEPS = 300
# Width of the row axis (labels and title) of every heatmap and of the alert timeline, and
# their legends above the plot: stacked charts then start and end their step axis at the
# same pixel whatever their labels and legends (layer names are cut to fit).
ROW_AXIS_PX = 130
TOP_LEGEND = alt.Legend(orient="top", format=SI_FORMAT)
# Ticks on a step axis: about this many (at 1, 2 or 5 x 10^k steps apart), as many on a
# third-of-a-row chart as on a whole-row one.
STEP_TICKS = 6
# Beyond this many ranks on an axis, label every k-th one only.
MAX_RANK_LABELS = 64


def heatmap_steps(n_rows: int) -> int:
    """Step buckets to ask for so that a grid of `n_rows` rows stays within the cell budget."""
    return max(1, min(MAX_HEATMAP_STEPS, MAX_HEATMAP_CELLS // max(1, n_rows)))


def step_x(steps: tuple[int, int]) -> alt.X:
    """The step axis of a view: `steps` (first, end), the same for every chart of the view
    (common.view_steps), so that they line up whatever steps each of them holds, with the
    same ticks (step_ticks) whatever each chart's width."""
    first, end = steps
    if not end > first:
        raise ValueError(f"steps: the end must be after the first step, got {steps}")
    axis = alt.Axis(format="d", values=step_ticks(steps))
    return alt.X(
        "step:Q", title="step", axis=axis, scale=alt.Scale(domain=[first, end], nice=False)
    )


def step_ticks(steps: tuple[int, int]) -> list[int]:
    """About STEP_TICKS round steps (1, 2 or 5 x 10^k apart) within `steps` (first, end).

    Vega-Lite picks ticks by the chart's width: a third-of-a-row chart got 50 steps apart
    where a half-row one got 20, under the same range. Given here, they are one axis.
    """
    first, end = steps
    wanted = max(1.0, (end - first) / STEP_TICKS)
    magnitude = 10 ** math.floor(math.log10(wanted))
    interval = next(int(m * magnitude) for m in (1, 2, 5, 10) if m * magnitude >= wanted)
    return list(range(-(-first // interval) * interval, end + 1, interval))


def value_y(col: str, title: str) -> alt.Y:
    """A value axis with SI-prefixed ticks, not forced to include zero."""
    return alt.Y(
        f"{col}:Q", title=title, scale=alt.Scale(zero=False), axis=alt.Axis(format=SI_FORMAT)
    )


def band_line(
    frame: pd.DataFrame,
    mean_col: str,
    max_col: str,
    title: str,
    y_title: str,
    steps: tuple[int, int],
    marks: pd.DataFrame | None = None,
) -> alt.LayerChart:
    """The bucket mean as a line, with a band up to the bucket's max (e.g. loss spikes)."""
    x = step_x(steps)
    base = alt.Chart(_drawable(frame[["step", mean_col, max_col]])).encode(x=x)
    band = base.mark_area(opacity=0.25).encode(y=value_y(mean_col, y_title), y2=f"{max_col}:Q")
    line = base.mark_line().encode(
        y=f"{mean_col}:Q",
        tooltip=[
            "step:Q",
            alt.Tooltip(f"{mean_col}:Q", format=SI_FORMAT),
            alt.Tooltip(f"{max_col}:Q", format=SI_FORMAT),
        ],
    )
    return with_markers(band + line, marks, x).properties(title=title, height=CHART_HEIGHT_PX)


def line(
    frame: pd.DataFrame,
    col: str,
    title: str,
    y_title: str,
    steps: tuple[int, int],
    marks: pd.DataFrame | None = None,
) -> alt.Chart | alt.LayerChart:
    """One metric over steps."""
    x = step_x(steps)
    chart = (
        alt.Chart(_drawable(frame[["step", col]]))
        .mark_line()
        .encode(
            x=x,
            y=value_y(col, y_title),
            tooltip=["step:Q", alt.Tooltip(f"{col}:Q", title=y_title, format=SI_FORMAT)],
        )
    )
    return with_markers(chart, marks, x).properties(title=title, height=CHART_HEIGHT_PX)


def multi_line(
    frame: pd.DataFrame,
    series: str,
    title: str,
    y_title: str,
    x: alt.X,
    marks: pd.DataFrame | None = None,
) -> alt.Chart | alt.LayerChart:
    """Several series of `value` over `x` (the view's step_x, or wall time), one colour
    per `series` (a run of a comparison, a layer of a drill-down)."""
    chart = (
        alt.Chart(_drawable(frame[[x.shorthand.split(":")[0], series, "value"]]))
        .mark_line()
        .encode(
            x=x,
            y=value_y("value", y_title),
            color=alt.Color(f"{series}:N", title=series, sort=None),
            tooltip=[
                x.shorthand,
                f"{series}:N",
                alt.Tooltip("value:Q", title=y_title, format=SI_FORMAT),
            ],
        )
    )
    return with_markers(chart, marks, x).properties(title=title, height=CHART_HEIGHT_PX)


def _drawable(frame: pd.DataFrame) -> pd.DataFrame:
    """The frame with inf and -inf as NaN: an axis cannot reach them, and a line breaks
    there as it does at a NaN (a non-finite loss has its alert marked on the chart)."""
    return frame.replace([math.inf, -math.inf], math.nan)


def health_link(run_id: str, step: int) -> str:
    """The dashboard's deep link to the Health view at `step`, relative to the page."""
    return "?" + urlencode({"run": run_id, "view": "Health", "step": int(step)})


def markers(
    run_id: str, alerts: pd.DataFrame, events: pd.DataFrame, steps: tuple[int, int]
) -> pd.DataFrame:
    """Alerts and run events between `steps` (first, end) as markers (MARKER_COLUMNS).

    `alerts` has step, severity, kind, message (client.alerts); `events` has step, rank,
    kind, detail (client.events). Events of one kind at one step (every rank's restart)
    make one marker. At most MAX_MARKERS, the newest. Each carries the deep link that
    opens the Health view at its step.
    """
    first, end = steps
    columns = ["step", "severity", "kind", "message"]
    alert_marks = alerts.loc[alerts["step"].between(first, end - 1), columns]
    alert_marks["message"] = alert_marks["message"].fillna("")
    shown = events[events["step"].between(first, end - 1)]
    event_marks = (
        shown.groupby(["step", "kind"], as_index=False)
        .agg(ranks=("rank", "nunique"), detail=("detail", "first"))
        .assign(severity="event")
    )
    event_marks["message"] = [
        f"{k} ({n} ranks)" if n > 1 else f"{k}: {d}" if isinstance(d, str) and d != "{}" else k
        for k, n, d in zip(
            event_marks["kind"], event_marks["ranks"], event_marks["detail"], strict=True
        )
    ]
    marks = pd.concat(
        [
            alert_marks.astype({"step": "int64"}),
            event_marks[["step", "severity", "kind", "message"]],
        ],
        ignore_index=True,
    )
    marks = marks.sort_values("step").tail(MAX_MARKERS).reset_index(drop=True)
    marks["href"] = [health_link(run_id, s) for s in marks["step"]]
    return marks[MARKER_COLUMNS]


def with_markers(
    chart: alt.Chart | alt.LayerChart, marks: pd.DataFrame | None, x: alt.X
) -> alt.Chart | alt.LayerChart:
    """`chart` with a vertical rule per marker, coloured by severity (MARKER_COLORS).

    Hovering a rule (or the triangle on top of it) shows the alert's message; clicking it
    follows its deep link: the Health view at that step.
    """
    if marks is None or marks.empty:
        return chart
    color = alt.Color(
        "severity:N",
        scale=alt.Scale(domain=list(MARKER_COLORS), range=list(MARKER_COLORS.values())),
        legend=None,
    )
    tooltip = ["step:Q", "severity:N", "kind:N", "message:N"]
    base = alt.Chart(marks).encode(x=x, color=color, tooltip=tooltip, href="href:N")
    rules = base.mark_rule(strokeWidth=2, opacity=0.7)
    tips = base.mark_point(shape="triangle-down", filled=True, size=80, opacity=1).encode(
        y=alt.value(4)
    )
    return alt.layer(chart, rules, tips)


def layer_heatmap(
    frame: pd.DataFrame,
    bucket_steps: int,
    value_title: str,
    steps: tuple[int, int],
) -> alt.Chart | alt.LayerChart:
    """Step x layer heatmap on a log colour scale, layers in model order on the y axis.

    `frame` has columns step, layer, layer_name, value (the client's `layers()`) and,
    optionally, `nonfinite` (the client's `layers()`). Cells a log scale cannot show
    (non-finite or <= 0) are drawn in red rather than dropped: a NaN gradient in one layer
    is exactly what this chart is for. A null cell that `nonfinite` does not flag was
    never measured and is left blank; without `nonfinite`, every null is non-finite.
    `steps` (first, end) fixes the x range, so that heatmaps stacked above each other
    line up.
    """
    order = list(frame.sort_values("layer")["layer_name"].unique())
    y = alt.Y("layer_name:N", title="layer", sort=order, axis=_row_axis())
    frame = frame.assign(step_end=step_ends(frame["step"], bucket_steps))
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
    steps: tuple[int, int],
) -> alt.Chart | alt.LayerChart:
    """Step x rank heatmap (linear colour scale): a straggler is a bright row."""
    n_ranks = frame["rank"].nunique()
    y = alt.Y("rank:O", title="rank", axis=_rank_axis(n_ranks))
    frame = frame.assign(step_end=step_ends(frame["step"], bucket_steps))
    cells = _cells(frame, "rank").astype({"rank": "int32"})
    return _heatmap(
        cells, bucket_steps, y, value_title, log_scale=False, steps=steps, n_rows=n_ranks
    )


def node_heatmap(
    frame: pd.DataFrame,
    bucket_steps: int,
    value_title: str,
    steps: tuple[int, int],
) -> alt.Chart | alt.LayerChart:
    """Step x node heatmap (linear colour scale), a row per host: a slow node is a bright
    row. `frame` has step, node, host, value (client.nodes)."""
    n_nodes = frame["node"].nunique()
    y = alt.Y("host:N", title="node", axis=_row_axis(labelOverlap=True), sort=None)
    frame = frame.assign(step_end=step_ends(frame["step"], bucket_steps))
    cells = frame[["step", "step_end", "host", "value"]].astype(
        {"step": "int32", "step_end": "int32", "value": "float32", "host": "category"}
    )
    return _heatmap(
        cells, bucket_steps, y, value_title, log_scale=False, steps=steps, n_rows=n_nodes
    )


def status_heatmap(
    frame: pd.DataFrame,
    bucket_steps: int,
    colors: dict[str, str],
    title: str,
    steps: tuple[int, int],
) -> alt.Chart:
    """Step x rank heatmap of a categorical `status` column, one colour per status."""
    n_ranks = frame["rank"].nunique()
    cells = frame[["step", "rank", "status"]].assign(
        step_end=step_ends(frame["step"], bucket_steps)
    )
    cells = cells.astype(
        {"step": "int32", "step_end": "int32", "rank": "int32", "status": "category"}
    )
    scale = alt.Scale(domain=list(colors), range=list(colors.values()))
    return (
        alt.Chart(cells)
        .mark_rect(clip=True)  # a bucket that runs past the window's end stops at it
        .encode(
            x=step_x(steps),
            x2="step_end:Q",
            y=alt.Y("rank:O", title="rank", axis=_rank_axis(n_ranks)),
            color=alt.Color("status:N", title=title, scale=scale, legend=alt.Legend(orient="top")),
            tooltip=["step:Q", "rank:O", "status:N"],
        )
        .properties(height=_heatmap_height(n_ranks))
    )


def alert_timeline(alerts: pd.DataFrame, events: pd.DataFrame, steps: tuple[int, int]) -> alt.Chart:
    """Alerts (points, by severity) and run events (ticks) on one step axis.

    `alerts` has step, kind, severity, message, value, baseline; `events` has step, rank,
    kind. The tooltip carries each alert's evidence: what was observed, what was expected.
    """
    x = step_x(steps)
    y = alt.Y("kind:N", title=None, axis=_row_axis())
    points = (
        alt.Chart(alerts)
        .mark_point(filled=True, size=90)
        .encode(
            x=x,
            y=y,
            color=alt.Color(
                "severity:N",
                scale=alt.Scale(domain=list(SEVERITY_COLORS), range=list(SEVERITY_COLORS.values())),
                legend=alt.Legend(orient="top"),
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
            y=alt.Y("value:Q", title=value_title, axis=alt.Axis(format=SI_FORMAT)),
            tooltip=["rank:O", alt.Tooltip("value:Q", title=value_title, format=SI_FORMAT)],
        )
    )
    median = alt.Chart(pd.DataFrame({"median": [means["value"].median()]})).mark_rule(
        strokeDash=[4, 4]
    )
    rule = median.encode(y="median:Q")
    return (bars + rule).properties(title=title, height=CHART_HEIGHT_PX)


def step_ends(step: pd.Series, bucket_steps: int) -> pd.Series:
    """Where each cell of a heatmap ends: at the next step (bucket) that holds any row.

    Hooks log every `log_every` steps (10 by default): a cell one bucket wide would leave
    blank columns between logged steps, a barcode. A cell instead spans up to the next
    logged bucket, which is what it stands for. The last one spans the median gap between
    the others (`bucket_steps` when alone).
    """
    starts = pd.Series(sorted(step.unique()), dtype="int64")
    nexts = starts.shift(-1)
    gap = starts.diff().median() if len(starts) > 1 else bucket_steps
    nexts.iloc[-1:] = starts.iloc[-1:] + max(bucket_steps, int(gap))
    return step.map(pd.Series(nexts.to_numpy(), index=starts)).astype("int64")


def _cells(frame: pd.DataFrame, row: str) -> pd.DataFrame:
    """The columns a heatmap draws, in the narrowest types that hold them.

    What a chart holds travels to the browser on every refresh: a 30,000-cell grid takes
    about 0.6 MB this way, three times that as float64.
    """
    return frame[["step", "step_end", row, "value"]].astype(
        {"step": "int32", "step_end": "int32", "value": "float32"}
    )


def _heatmap(
    cells: pd.DataFrame,
    bucket_steps: int,
    y: alt.Y,
    value_title: str,
    *,
    log_scale: bool,
    steps: tuple[int, int],
    n_rows: int,
) -> alt.Chart | alt.LayerChart:
    valid = cells["value"].abs() < math.inf  # not NaN, not inf
    if log_scale:
        valid &= cells["value"] > 0
    if log_scale:
        scale = alt.Scale(type="log", scheme="viridis")
    else:
        # Clamped to the central 98 % of values: one slow start-up step would otherwise
        # take the whole colour range and leave a straggler's row as dark as the rest.
        low, high = cells.loc[valid, "value"].quantile(LINEAR_COLOR_QUANTILES)
        scale = alt.Scale(scheme="inferno", domain=[low, high], clamp=True)
    x = step_x(steps)
    tooltip = ["step:Q", y.shorthand, alt.Tooltip("value:Q", title=value_title, format=".4g")]
    # Each cell spans its bucket of steps, up to the next logged one (step_ends).
    chart = (
        alt.Chart(cells[valid])
        .mark_rect(clip=True)  # a bucket that runs past the window's end stops at it
        .encode(
            x=x,
            x2="step_end:Q",
            y=y,
            color=alt.Color("value:Q", title=value_title, scale=scale, legend=TOP_LEGEND),
            tooltip=tooltip,
        )
    )
    if not valid.all():
        invalid = alt.Chart(cells[~valid])
        chart += invalid.mark_rect(color=INVALID_CELL_COLOR, clip=True).encode(
            x=x, x2="step_end:Q", y=y, tooltip=tooltip
        )
    return chart.properties(height=_heatmap_height(n_rows))


def _heatmap_height(n_rows: int) -> int:
    return min(MAX_HEATMAP_HEIGHT_PX, max(CHART_HEIGHT_PX, ROW_HEIGHT_PX * n_rows))


def _rank_axis(n_ranks: int, **kwargs) -> alt.Axis:
    """A rank axis that labels every rank while they fit, and every k-th beyond."""
    every = max(1, math.ceil(n_ranks / MAX_RANK_LABELS))
    labels = f"datum.value % {every} == 0 ? datum.label : ''"
    if "labelAngle" in kwargs:  # an x axis (bars), not a heatmap's row axis
        return alt.Axis(labelExpr=labels, **kwargs)
    return _row_axis(labelExpr=labels, **kwargs)


def _row_axis(**kwargs) -> alt.Axis:
    """The row axis of a heatmap or timeline: ROW_AXIS_PX wide, labels cut to fit."""
    return alt.Axis(
        minExtent=ROW_AXIS_PX, maxExtent=ROW_AXIS_PX, labelLimit=ROW_AXIS_PX - 30, **kwargs
    )
