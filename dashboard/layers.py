"""Layers: step x layer heatmaps, to trace a spike to the layer where it started, and a
drill-down that follows a few chosen layers' statistics as lines."""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
import streamlit as st

from trainvitals.dashboard import charts, derive
from trainvitals.dashboard.client import CollectorClient, RunSummary, Series
from trainvitals.dashboard.common import view_steps
from trainvitals.dashboard.state import Window

DRILL_KEY = "drill_layers"
# Points per drill-down line: the collector keeps each bucket's max, so a spike survives.
DRILL_POINTS = 500
# Layers one drill-down follows: more lines than this are a heatmap's job.
MAX_DRILL_LAYERS = 8


@dataclass(frozen=True)
class LayerMetric:
    field: str  # column of the layers table
    name: str  # also the colour legend's title; the quantities are dimensionless


METRICS = (
    LayerMetric("grad_norm", "gradient L2 norm"),
    LayerMetric("act_rms", "activation RMS"),
    LayerMetric("update_rms", "update RMS"),
)
# The drill-down's line of update_rms over param_norm (update_ratio).
UPDATE_RATIO = "update / parameter ratio"


def load(client: CollectorClient, run: RunSummary, window: Window) -> dict[str, Series]:
    """One bucketed step x layer grid per metric; max per bucket, so a spike survives.

    Each grid's frame has a `nonfinite` column (client.layers): where the run measured
    NaN or inf, as opposed to nothing.
    """
    max_steps = charts.heatmap_steps(len(run.layer_names))
    return {
        m.field: client.layers(run.run_id, m.field, window.start, window.end, max_steps, agg="max")
        for m in METRICS
    }


def has_cells(grid: Series) -> bool:
    """Whether a grid has anything to draw: a value, or a non-finite one."""
    frame = grid.frame
    return bool((frame["value"].notna() | frame["nonfinite"]).any())


def render(grids: dict[str, Series], run: RunSummary, window: Window) -> None:
    shown = [grids[m.field] for m in METRICS if has_cells(grids[m.field])]
    if not shown:
        st.info("No per-layer statistics for this run in this window.")
        return
    # One x range for every heatmap, so that a column means the same steps in each.
    steps = view_steps(window, run)
    st.caption(
        f"Max over each bucket of {shown[0].bucket_steps} step(s), log colour scale; "
        "red: non-finite or zero; blank: not measured. A cell reaches to the next logged step."
    )
    for metric in METRICS:
        heatmap(metric, grids[metric.field], steps)


def drill_down(client: CollectorClient, run: RunSummary, window: Window) -> None:
    """The chosen layers' statistics as lines, one chart per statistic on the view's axis."""
    st.subheader("Follow layers")
    names = list(run.layer_names)
    if not names:
        st.info("The run did not name its layers, so none can be picked to follow.")
        return
    chosen = st.multiselect(
        "Layers to follow",
        range(len(names)),
        format_func=lambda i: names[i],
        key=DRILL_KEY,
        max_selections=MAX_DRILL_LAYERS,
        placeholder="Pick layers: their gradient norm, activation RMS, update RMS and update / "
        "parameter ratio as lines",
    )
    if not chosen:
        st.caption("Pick up to 8 layers above to see their statistics as lines.")
        return
    steps = view_steps(window, run)
    st.caption("Each point: the layer's max over a bucket of steps, so a spike survives.")
    frames = {
        field: drill_frame(client, run, window, field, chosen)
        for field in (*(m.field for m in METRICS), "param_norm")
    }
    columns = st.columns(len(METRICS))
    for column, metric in zip(columns, METRICS, strict=True):
        frame = frames[metric.field]
        if not frame["value"].notna().any():
            column.info(f"This run did not report the {metric.name} of these layers here.")
            continue
        column.altair_chart(
            charts.multi_line(
                frame,
                "layer",
                f"{metric.name[0].upper()}{metric.name[1:]}",
                metric.name,
                x=charts.step_x(steps),
            )
        )
    update_ratio_chart(update_ratio(frames["update_rms"], frames["param_norm"]), steps)


def drill_frame(
    client: CollectorClient, run: RunSummary, window: Window, field: str, chosen: list[int]
) -> pd.DataFrame:
    """The chosen layers' `field`, bucketed to DRILL_POINTS steps, a `layer` column named."""
    grid = client.layers(run.run_id, field, window.start, window.end, DRILL_POINTS, "max", chosen)
    return grid.frame.assign(layer=grid.frame["layer_name"])


def update_ratio(update: pd.DataFrame, params: pd.DataFrame) -> pd.DataFrame:
    """update_rms / param_norm per (step, layer): both fetched on the same buckets, so a
    row pairs the two maxima of one bucket. NaN where either is missing or the norm is 0."""
    both = update.merge(
        params[["step", "layer", "value"]], on=["step", "layer"], suffixes=("", "_param")
    )
    norm = both.pop("value_param")
    return both.assign(value=both["value"] / norm.where(norm > 0))


def update_ratio_chart(ratio: pd.DataFrame, steps: tuple[int, int]) -> None:
    if not ratio["value"].notna().any():
        st.info(
            f"This run did not report the {UPDATE_RATIO} of these layers here: it needs "
            "both the update RMS and the parameter norm."
        )
        return
    st.altair_chart(
        charts.multi_line(
            ratio,
            "layer",
            f"{UPDATE_RATIO[0].upper()}{UPDATE_RATIO[1:]}",
            UPDATE_RATIO,
            x=charts.step_x(steps),
        )
    )
    st.caption(
        "Update / parameter ratio = update RMS / parameter L2 norm, of the layer at the "
        "logged step (bucket maxima of each), dimensionless. The update RMS is per element "
        "and the norm over the layer's n parameters, so this is the relative update "
        "||dW|| / ||W|| divided by sqrt(n): follow a layer over time (a jump is a step too "
        "large for its weights); layers of different sizes differ by their sqrt(n)."
    )


def heatmap(metric: LayerMetric, grid: Series, steps: tuple[int, int]) -> None:
    st.subheader(f"{metric.name[0].upper()}{metric.name[1:]} per layer")
    frame = grid.frame
    if not has_cells(grid):
        st.info(f"This run did not report the {metric.name} of its layers in this window.")
        return
    jump = derive.first_jump(frame)
    if jump is not None:
        st.caption(jump_caption(jump))
    st.altair_chart(charts.layer_heatmap(frame, grid.bucket_steps, metric.name, steps))


def jump_caption(jump: pd.Series) -> str:
    """Where a spike started: the cell `derive.first_jump` found."""
    if pd.isna(jump["value"]):
        how = "non-finite"
    else:
        how = f"{jump['value'] / jump['median']:.0f}x its median over the window"
    return f"Earliest jump: **{jump['layer_name']}** at step {int(jump['step']):,}, {how}."
