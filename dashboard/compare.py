"""Compare: two or more runs overlaid (loss, gradient norm, throughput, MFU, power) on the
step or the wall-time axis, optionally smoothed, as W&B and TensorBoard users expect."""

from __future__ import annotations

import altair as alt
import pandas as pd
import streamlit as st

from trainvitals.dashboard import charts, derive
from trainvitals.dashboard.client import CollectorClient, RunSummary

RUNS_KEY = "compare_runs"
AXIS_KEY = "compare_axis"
SMOOTH_KEY = "compare_smoothing"
AXES = ("step", "wall time")
# Points per run and chart: each run's steps are averaged into this many buckets.
POINTS_PER_RUN = 1000
MAX_RUNS = 8
S_PER_H = 3600.0
# (steps column, chart title, axis title with unit, scale applied first).
METRICS = (
    ("loss", "Loss", "loss (nats/token)", 1.0),
    ("grad_norm", "Gradient norm, before clipping", "L2 norm", 1.0),
    ("tokens_per_s", "Throughput", "tokens/s", 1.0),
    ("mfu_ratio", "Model FLOPs utilization", "MFU (%)", 100.0),
    ("power_w", "Power, all devices", "power (W)", 1.0),
)


def render(client: CollectorClient, run: RunSummary, runs: list[RunSummary]) -> None:
    by_id = {r.run_id: r for r in runs}
    if len(by_id) < 2:
        st.info(
            "Only one run in this collector: comparing needs two. Runs appear here as they "
            "start, or serve several stored runs with `trainvitals dashboard --store`."
        )
        return
    # The current run and the newest other one, until the user picks.
    st.session_state.setdefault(RUNS_KEY, [run.run_id, next(i for i in by_id if i != run.run_id)])
    st.session_state[RUNS_KEY] = [i for i in st.session_state[RUNS_KEY] if i in by_id]
    left, middle, right = st.columns([3, 1, 1])
    chosen = left.multiselect("Runs to compare", list(by_id), key=RUNS_KEY, max_selections=MAX_RUNS)
    axis = middle.radio("x axis", AXES, key=AXIS_KEY, horizontal=True)
    weight = right.slider(
        "Smoothing", 0.0, 0.99, 0.0, 0.01, key=SMOOTH_KEY,
        help="Exponential moving average weight, as TensorBoard's slider: 0 is off.",
    )  # fmt: skip
    if len(chosen) < 2:
        st.caption("Pick at least two runs.")
        return
    frames = [run_frame(client, by_id[i], weight) for i in chosen]
    overlay = pd.concat(frames, ignore_index=True)
    if axis == "step":
        # The view's steps: the runs compared, from the first step of any to the last.
        x = charts.step_x((int(overlay["step"].min()), int(overlay["step"].max()) + 1))
    else:
        x = alt.X("wall_h:Q", title="wall time since the run started (h)")
    columns = st.columns(2)
    for i, (field, title, y_title, _) in enumerate(METRICS):
        column = columns[i % 2]
        data = overlay[["step", "wall_h", "run", field]].rename(columns={field: "value"})
        if not data["value"].notna().any():
            column.info(no_data_message(field, chosen))
            continue
        column.altair_chart(charts.multi_line(data, "run", title, y_title, x=x))


def run_frame(client: CollectorClient, run: RunSummary, weight: float) -> pd.DataFrame:
    """One run's METRICS (scaled, smoothed) by step, with the wall time since its start."""
    frame = client.steps(run.run_id, max_points=POINTS_PER_RUN).frame
    start = run.started_unix_s or frame["time_unix_s"].min()
    out = pd.DataFrame(
        {"step": frame["step"], "wall_h": (frame["time_unix_s"] - start) / S_PER_H}
    ).assign(run=run.run_id)
    for field, _, _, scale in METRICS:
        out[field] = derive.smoothed(frame[field] * scale, weight)
    return out


def no_data_message(field: str, run_ids: list[str]) -> str:
    """Why a comparison chart is missing, per metric."""
    names = ", ".join(run_ids)
    if field == "mfu_ratio":
        return f"No MFU for {names}: none reported a peak FLOP/s for its device."
    if field == "power_w":
        return f"No power for {names}: no power source on their hosts (the Overview says why)."
    return f"None of {names} reported {field}."
