"""Overview: training curves, efficiency (MFU, power, energy, goodput) and the latest alerts."""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
import streamlit as st

from trainvitals.dashboard import charts, derive
from trainvitals.dashboard.client import CollectorClient, RunSummary, Series
from trainvitals.dashboard.common import (
    alert_table,
    duration_label,
    fmt,
    no_power_message,
    si,
    view_steps,
)
from trainvitals.dashboard.state import Window

# Points per line chart: about one per pixel of a half-width chart; the collector
# averages steps into this many buckets (and keeps the max of loss and grad norm).
MAX_LINE_POINTS = 1000
LATEST_ALERTS = 10
GOODPUT_HELP = (
    "Productive time / wall time, as `trainvitals replay` computes it (analyzer/goodput.py): "
    "restarts, steps re-done after them, checkpoints and stalls count as lost."
)
TFLOPS = 1e12  # the steps table's tflops_per_s_per_device is in TFLOP/s


@dataclass(frozen=True)
class OverviewData:
    series: Series  # the window, bucketed
    whole_run: Series  # the whole run, bucketed: for goodput, energy and the token target
    latest: pd.Series  # the run's last logged step, raw
    alerts: pd.DataFrame
    events: pd.DataFrame
    goodput: dict  # the analyzer's (client.goodput)


def load(client: CollectorClient, run: RunSummary, window: Window) -> OverviewData:
    """What the view shows, in at most seven requests whatever the run's length."""
    run_id = run.run_id
    series = client.steps(run_id, window.start, window.end, max_points=MAX_LINE_POINTS)
    whole_run = series
    if window != Window():
        whole_run = client.steps(run_id, max_points=MAX_LINE_POINTS)
    # start=last_step selects exactly the last logged step.
    latest = client.steps(run_id, start=run.last_step).frame.iloc[-1]
    return OverviewData(
        series,
        whole_run,
        latest,
        client.alerts(run_id),
        client.events(run_id),
        client.goodput(run_id),
    )


def render(data: OverviewData, run: RunSummary, window: Window) -> None:
    whole_run = data.whole_run.frame
    progress = derive.progress(
        run, first_step=int(whole_run["step"].iloc[0]), mean_tokens=whole_run["tokens"].mean()
    )
    energy = derive.energy_so_far(whole_run, data.latest.energy_j)
    headline(data.latest, progress, energy, data.goodput, run)
    dropped = data.latest.get("telemetry_dropped", 0)
    if dropped > 0:  # NaN (not reported) compares false
        st.warning(
            f"The hooks dropped {int(dropped):,} logged steps or batches of telemetry since "
            "the run started: a gap in these charts is lost data, not a quiet period."
        )
    frame = data.series.frame
    if frame.empty:
        st.info("No steps in this window.")
        return
    if data.series.bucket_steps > 1:
        st.caption(
            f"Each point is the mean of {data.series.bucket_steps} steps; "
            "the bands reach each bucket's max."
        )
    steps = view_steps(window, run)
    marks = charts.markers(run.run_id, data.alerts, data.events, steps)
    if not marks.empty:
        st.caption(
            "Lines across the charts: alerts (red critical, orange warning) and run events "
            "(blue); hover one for its message, click it for the Health view at its step."
        )
    training_charts(frame, steps, marks)
    efficiency_charts(frame, energy_before(data.whole_run, frame), run, steps, marks)
    latest_alerts(data.alerts, run)


def headline(
    latest: pd.Series,
    progress: derive.Progress,
    energy: derive.EnergySoFar,
    goodput: dict,
    run: RunSummary,
) -> None:
    """The latest step's numbers (raw, not bucket means), then the run's totals."""
    mfu_help = None if run.peak_flops_per_s else "The run reported no peak FLOP/s for its device."
    mfu_label = "MFU"
    if estimated_flops(run):
        mfu_label = "MFU (estimate)"
        mfu_help = f"FLOPs per token: {run.flops_source}; pass flops_per_token to attach()."
    elif counted_flops(run):
        mfu_label = "MFU (counted)"
        mfu_help = f"FLOPs per token {run.flops_source}."
    top = st.columns(5)
    top[0].metric("last step", f"{int(latest.step):,}")
    top[1].metric("loss (nats/token)", fmt(latest.loss, ".4f", missing="non-finite"))
    # The unit in the label, its SI prefix in the value: a metric's value must stay short.
    top[2].metric("throughput (tokens/s)", si(latest.tokens_per_s, ""))
    top[3].metric(mfu_label, fmt(100 * latest.mfu_ratio, ".1f", unit=" %"), help=mfu_help)
    top[4].metric("FLOP rate per device (FLOP/s)", si(latest.tflops_per_s_per_device * TFLOPS, ""))
    power_help = None if latest.power_w > 0 else no_power_message(run)
    bottom = st.columns(5)
    bottom[0].metric("power", si(latest.power_w, "W"), help=power_help)
    bottom[1].metric(
        "energy so far",
        si(energy.used_j, "J"),
        help=f"{fmt(energy.used_j / derive.J_PER_KWH, ',.4g')} kWh",
    )
    bottom[2].metric(
        "tokens per joule",
        fmt(energy.tokens_per_j, ".4g"),
        help="Tokens trained between the first and the latest energy reading / the energy "
        "used between them.",
    )
    bottom[3].metric(
        "goodput",
        fmt(100 * goodput.get("ratio", float("nan")), ".1f", unit=" %"),
        help=GOODPUT_HELP,
    )
    bottom[4].metric(
        "to token target",
        eta_label(progress, run),
        help="At the run's pace so far, lost time included.",
    )


def estimated_flops(run: RunSummary) -> bool:
    """Whether the run's FLOPs per token are an estimate (a rule of thumb), not given by
    the user nor counted over a step of the model (hooks/flops.py)."""
    return bool(run.flops_source) and not (run.flops_source == "configured" or counted_flops(run))


def counted_flops(run: RunSummary) -> bool:
    """Whether the hooks counted the run's FLOPs per token over one of its steps."""
    return (run.flops_source or "").startswith("counted")


def eta_label(progress: derive.Progress, run: RunSummary) -> str:
    if not run.token_target:
        return "no target"
    if progress.eta_s == 0:
        return "reached"
    return duration_label(progress.eta_s)


def training_charts(frame: pd.DataFrame, steps: tuple[int, int], marks: pd.DataFrame) -> None:
    """Loss, gradient norm, learning rate and throughput, two per row."""
    on_axis = {"steps": steps, "marks": marks}
    left, right = st.columns(2)
    # F.cross_entropy in the reference trainer: natural log, mean over tokens.
    left.altair_chart(
        charts.band_line(frame, "loss", "loss_max", "Loss", "loss (nats/token)", **on_axis)
    )
    right.altair_chart(
        charts.band_line(
            frame,
            "grad_norm",
            "grad_norm_max",
            "Gradient norm, before clipping",
            "L2 norm",
            **on_axis,
        )
    )
    left.altair_chart(charts.line(frame, "tokens_per_s", "Throughput", "tokens/s", **on_axis))
    if frame["lr"].notna().any():
        right.altair_chart(charts.line(frame, "lr", "Learning rate", "learning rate", **on_axis))
    else:
        right.info("The run reported no learning rate.")


def energy_before(whole_run: Series, window: pd.DataFrame) -> pd.Series:
    """Energy readings of the whole run's buckets that end before the window starts.

    They carry the restarts before the window into its energy curve. A restart inside
    the bucket that holds the window's first step, but before that step, is missed: the
    curve then starts one restart's worth low.
    """
    frame = whole_run.frame
    return frame.loc[frame["step"] + whole_run.bucket_steps <= window["step"].iloc[0], "energy_j"]


def efficiency_charts(
    frame: pd.DataFrame,
    earlier_energy_j: pd.Series,
    run: RunSummary,
    steps: tuple[int, int],
    marks: pd.DataFrame,
) -> None:
    """MFU and achieved FLOP/s per device; power, energy and tokens per joule.

    `earlier_energy_j`: energy readings before the window, for the restarts before it.
    """
    on_axis = {"steps": steps, "marks": marks}
    left, right = st.columns(2)
    if frame["mfu_ratio"].notna().any():
        mfu = frame.assign(mfu_pct=100 * frame["mfu_ratio"])
        title = "Model FLOPs utilization"
        if estimated_flops(run):
            title += " (estimate)"
            left.caption(f"MFU estimate, FLOPs per token from {run.flops_source}.")
        elif counted_flops(run):
            left.caption(f"FLOPs per token {run.flops_source}.")
        left.altair_chart(charts.line(mfu, "mfu_pct", title, "MFU (%)", **on_axis))
    else:
        left.info("MFU unknown: the run reported no peak FLOP/s for its device.")
    if frame["tflops_per_s_per_device"].notna().any():
        rate = frame.assign(flop_per_s=frame["tflops_per_s_per_device"] * TFLOPS)
        right.altair_chart(
            charts.line(rate, "flop_per_s", "Achieved FLOP rate per device", "FLOP/s", **on_axis)
        )
    else:
        right.info("FLOP rate unknown: the run reported no FLOPs per token or step.")
    if not frame["power_w"].notna().any():
        st.info(no_power_message(run))
        return
    energy = frame.assign(
        energy_so_far_j=derive.continued_energy_j(frame["energy_j"], earlier_energy_j),
        tokens_per_j=derive.tokens_per_joule(frame["tokens_per_s"], frame["power_w"]),
    )
    left, middle, right = st.columns(3)
    left.altair_chart(charts.line(energy, "power_w", "Power, all devices", "power (W)", **on_axis))
    middle.altair_chart(
        charts.line(energy, "energy_so_far_j", "Energy so far", "energy (J)", **on_axis)
    )
    right.altair_chart(
        charts.line(energy, "tokens_per_j", "Energy efficiency", "tokens/J", **on_axis)
    )


def latest_alerts(alerts: pd.DataFrame, run: RunSummary) -> None:
    st.subheader("Latest alerts")
    if alerts.empty:
        st.success("No alerts for this run.")
        return
    newest = alerts.sort_values("step", ascending=False).head(LATEST_ALERTS)
    st.caption(
        f"The {len(newest)} newest of {len(alerts)}; select one to jump to it. "
        "The Health view lists them all."
    )
    alert_table(newest, run, key="alerts:overview")
