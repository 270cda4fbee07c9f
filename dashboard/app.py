"""The trainvitals dashboard: a live (or replayed) view of one run, read from the collector.

    streamlit run dashboard/app.py -- --collector http://127.0.0.1:8000

or `trainvitals dashboard`. The collector URL comes from `--collector`, else the
TRAINVITALS_COLLECTOR_URL environment variable, else http://127.0.0.1:8000.

The sidebar (run, step window) renders on full reruns only; everything that shows data sits
in one fragment that reruns every REFRESH_S seconds, so a live run updates without reloading
the page or resetting the sidebar.
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import os
import sys
from collections.abc import Mapping, Sequence
from urllib.parse import urlsplit

import pandas as pd
import streamlit as st

from trainvitals.dashboard import charts
from trainvitals.dashboard.client import (
    DEFAULT_URL,
    CollectorClient,
    CollectorError,
    CollectorUnavailable,
    RunNotFound,
    RunSummary,
)

URL_ENV_VAR = "TRAINVITALS_COLLECTOR_URL"
REFRESH_S = 2
# Short enough that a hung collector stalls one refresh, not the page.
REQUEST_TIMEOUT_S = 3.0
# Points per line chart and buckets per heatmap: the collector downsamples to these.
MAX_LINE_POINTS = 2000
MAX_HEATMAP_STEPS = 300


def collector_url(argv: Sequence[str], environ: Mapping[str, str]) -> str:
    """`--collector URL` (script args after streamlit's `--`), else the env var, else default."""
    # allow_abbrev=False: under a test runner argv is the runner's, and e.g. pytest's `--co`
    # must not be read as an abbreviation of --collector.
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--collector")
    args, _ = parser.parse_known_args(argv)
    return args.collector or environ.get(URL_ENV_VAR) or DEFAULT_URL


@st.cache_resource
def get_client(url: str) -> CollectorClient:
    """One client (one connection pool) per collector URL, shared by all sessions."""
    return CollectorClient(url, timeout_s=REQUEST_TIMEOUT_S)


def unreachable_message(url: str) -> str:
    """What to tell a user when nothing answers at `url`, including how to fix it."""
    port = urlsplit(url).port or 8000
    return (
        f"Cannot reach the trainvitals collector at {url}. Start one with "
        f"`trainvitals collector --store trainvitals.duckdb --port {port}`, or point the "
        f"dashboard at another one with `--collector URL` or ${URL_ENV_VAR}. "
        f"Retrying every {REFRESH_S} s."
    )


def main() -> None:
    """Render the page: sidebar choices, then the live panel for the chosen run."""
    st.set_page_config(page_title="trainvitals", layout="wide")
    st.title("trainvitals")
    url = collector_url(sys.argv[1:], os.environ)
    runs, problem = runs_or_problem(url)
    if problem:
        st.error(problem)
    elif not runs:
        st.info(f"The collector at {url} holds no runs yet; this page updates when one starts.")
    if problem or not runs:
        rerun_on_change(url, problem)
        return
    run = pick_run(runs)
    start, end = pick_window(run)
    live_panel(url, run.run_id, start, end, tuple(r.run_id for r in runs))


def runs_or_problem(url: str) -> tuple[list[RunSummary], str | None]:
    """The collector's runs, or a message saying why there are none to read; never raises."""
    try:
        return get_client(url).runs(), None
    except CollectorUnavailable:
        return [], unreachable_message(url)
    except CollectorError as e:
        return [], f"The collector at {url} answered with an error: {e}"


@st.fragment(run_every=REFRESH_S)
def rerun_on_change(url: str, shown_problem: str | None) -> None:
    """While the page shows an empty state, poll; rebuild the page once the state changes."""
    runs, problem = runs_or_problem(url)
    if runs or problem != shown_problem:
        st.rerun()


def pick_run(runs: list[RunSummary]) -> RunSummary:
    """Sidebar run selector, newest first, with the chosen run's metadata below it."""
    by_id = {r.run_id: r for r in runs}
    # keyed, so the choice survives the options growing when a new run starts.
    run_id = st.sidebar.selectbox(
        "Run (newest first)", list(by_id), format_func=lambda i: run_label(by_id[i]), key="run"
    )
    run = by_id[run_id]
    st.sidebar.markdown(run_details(run))
    return run


def run_label(run: RunSummary) -> str:
    """Selector label: the run id, plus model and world size when the run sent them."""
    extras = [x for x in (run.model, run.world_size and f"{run.world_size} ranks") if x]
    return f"{run.run_id} ({', '.join(extras)})" if extras else run.run_id


def run_details(run: RunSummary) -> str:
    """Markdown lines describing what the run trains, on what, laid out how."""
    lines = []
    if run.n_params:
        lines.append(f"**params** {count_label(run.n_params)}")
    if run.world_size:
        lines.append(f"**ranks** {run.world_size} (dp {run.dp} x tp {run.tp})")
    if run.device_name or run.device_type:
        lines.append(f"**device** {run.device_name or run.device_type}")
    if run.started_unix_s:
        started = dt.datetime.fromtimestamp(run.started_unix_s, tz=dt.UTC)
        lines.append(f"**started** {started:%Y-%m-%d %H:%M:%S} UTC")
    return "  \n".join(lines) or "The run sent no metadata."


def count_label(n: int) -> str:
    """A count as people quote model sizes: 139584 -> "139.6 k", 7.0e9 -> "7.0 B"."""
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.1f} {suffix}"
    return str(n)


def pick_window(run: RunSummary) -> tuple[int | None, int | None]:
    """Sidebar step-window slider -> (start, end); end None means "up to the latest step".

    The slider's range ends at the run's last step, which grows while the run is live, and
    Streamlit resets a slider whose range changes. So the user's choice is kept in session
    state (by the on_change callback, which runs before the rerun) and given back as the
    slider's value; a window whose right end sat on the last step keeps following the run.
    """
    last = run.last_step
    if not last:
        return None, None
    choice_key = f"window:{run.run_id}"
    slider_key = f"{choice_key}:slider"
    lo, hi, follow = st.session_state.get(choice_key, (0, last, True))

    def remember() -> None:
        new_lo, new_hi = st.session_state[slider_key]
        st.session_state[choice_key] = (new_lo, new_hi, new_hi == last)

    lo, hi = st.sidebar.slider(
        "Steps",
        min_value=0,
        max_value=last,
        value=(min(lo, last), last if follow else min(hi, last)),
        key=slider_key,
        on_change=remember,
        help="Leave the right end on the last step to follow a live run.",
    )
    return lo, None if hi == last else hi


@st.fragment(run_every=REFRESH_S)
def live_panel(
    url: str, run_id: str, start: int | None, end: int | None, listed: tuple[str, ...]
) -> None:
    """Everything that shows data, refreshed every REFRESH_S seconds."""
    client = get_client(url)
    try:
        runs = client.runs()
        if tuple(r.run_id for r in runs) != listed:
            st.rerun()  # a run started or vanished: rebuild the sidebar's list
        run = next(r for r in runs if r.run_id == run_id)
        if run.last_step is None:
            st.info(f"Run {run_id} has not logged a step yet.")
            return
        headline(client, run)
        training_charts(client, run_id, start, end)
        layer_charts(client, run_id, start, end)
        rank_charts(client, run_id, start, end)
        alerts_table(client, run)
    except CollectorUnavailable:
        st.error(unreachable_message(url))
    except RunNotFound:
        st.warning(f"The collector no longer holds run {run_id}; pick another run.")
    except CollectorError as e:
        st.error(f"The collector at {url} answered with an error: {e}")


def headline(client: CollectorClient, run: RunSummary) -> None:
    """The latest step's numbers, raw (not bucket means)."""
    # start=last_step selects exactly the last logged step.
    last = client.steps(run.run_id, start=run.last_step).frame.iloc[-1]
    mfu_help = None if run.peak_flops_per_s else "The run reported no peak FLOP/s for its device."
    cols = st.columns(5)
    cols[0].metric("last step", f"{int(last.step):,}")
    cols[1].metric("loss", fmt(last.loss, ".4f", missing="non-finite"))
    cols[2].metric("tokens/s", fmt(last.tokens_per_s, ",.0f"))
    cols[3].metric("MFU", fmt(100 * last.mfu_ratio, ".1f", unit=" %"), help=mfu_help)
    cols[4].metric("TFLOP/s per device", fmt(last.tflops_per_s_per_device, ".4g"))


def fmt(value: float, spec: str, missing: str = "n/a", unit: str = "") -> str:
    """Format a metric; a null (NaN) value reads as `missing`, never as "nan"."""
    return missing if math.isnan(value) else f"{value:{spec}}{unit}"


def training_charts(
    client: CollectorClient, run_id: str, start: int | None, end: int | None
) -> None:
    """Loss, grad norm, throughput and MFU over steps, two per row."""
    series = client.steps(run_id, start, end, max_points=MAX_LINE_POINTS)
    frame = series.frame
    if frame.empty:
        st.info("No steps in this window.")
        return
    if series.bucket_steps > 1:
        st.caption(
            f"Each point is the mean of {series.bucket_steps} steps; "
            "the band reaches the bucket's max."
        )
    left, right = st.columns(2)
    # F.cross_entropy in the reference trainer: natural log, mean over tokens.
    left.altair_chart(charts.band_line(frame, "loss", "loss_max", "Loss", "loss (nats/token)"))
    right.altair_chart(
        charts.band_line(
            frame, "grad_norm", "grad_norm_max", "Gradient norm", "L2 norm, before clipping"
        )
    )
    left.altair_chart(charts.line(frame, "tokens_per_s", "Throughput", "tokens/s"))
    if frame["mfu_ratio"].notna().any():
        mfu = frame.assign(mfu_pct=100 * frame["mfu_ratio"])
        right.altair_chart(charts.line(mfu, "mfu_pct", "Model FLOPs utilization", "MFU (%)"))
    else:
        right.info("MFU unknown: the run reported no peak FLOP/s for its device.")


def layer_charts(client: CollectorClient, run_id: str, start: int | None, end: int | None) -> None:
    """Step x layer heatmap of the gradient norm (max over each bucket)."""
    st.subheader("Gradient norm per layer")
    series = client.layers(run_id, "grad_norm", start, end, max_steps=MAX_HEATMAP_STEPS)
    if series.frame.empty:
        st.info("No per-layer statistics for this run in this window.")
        return
    st.caption(f"Max over each bucket of {series.bucket_steps} step(s); red: non-finite or zero.")
    st.altair_chart(charts.layer_heatmap(series.frame, series.bucket_steps, "grad norm (L2)"))


def rank_charts(client: CollectorClient, run_id: str, start: int | None, end: int | None) -> None:
    """Per-rank step time: step x rank heatmap (bucket max) and the mean per rank.

    The heatmap shows each bucket's max so a one-step stall stays visible; the bars need
    the mean, a second query, since a mean of bucket maxima would overstate every rank.
    """
    st.subheader("Step time per rank")
    series = client.ranks(run_id, "step_time_s", start, end, max_steps=MAX_HEATMAP_STEPS)
    if series.frame.empty:
        st.info("No per-rank statistics for this run in this window.")
        return
    means = client.ranks(run_id, "step_time_s", start, end, MAX_HEATMAP_STEPS, agg="mean")
    left, right = st.columns([3, 1])
    left.caption(f"Max over each bucket of {series.bucket_steps} step(s).")
    left.altair_chart(charts.rank_heatmap(series.frame, series.bucket_steps, "step time (s)"))
    right.altair_chart(charts.rank_mean_bar(means.frame, "mean step time (s)"))


def alerts_table(client: CollectorClient, run: RunSummary) -> None:
    """The run's alerts, newest first, with layer indices shown as layer names."""
    st.subheader("Alerts")
    alerts = client.alerts(run.run_id)
    if alerts.empty:
        st.success("No alerts for this run.")
        return
    st.dataframe(alerts_view(alerts, run.layer_names), hide_index=True)


def alerts_view(alerts: pd.DataFrame, layer_names: Sequence[str]) -> pd.DataFrame:
    """Alerts as displayed: UTC time, layer names, newest first."""
    view = alerts.sort_values(["step", "time_unix_s"], ascending=False)
    view.insert(0, "time", pd.to_datetime(view.pop("time_unix_s"), unit="s", utc=True))
    view["layer"] = [layer_label(i, layer_names) for i in view["layer"]]
    return view


def layer_label(index: int | None, layer_names: Sequence[str]) -> str | None:
    """Name of a layer index; None (or pd.NA) when the alert is not about a layer."""
    if index is None or pd.isna(index):
        return None
    return layer_names[index] if index < len(layer_names) else f"layer {index}"


# Streamlit (and AppTest) run this file as __main__; tests may import its helpers.
if __name__ == "__main__":
    main()
