"""Health: alerts on a timeline with their evidence, SDC fingerprints, injected faults."""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
import streamlit as st

from trainvitals.dashboard import charts, derive
from trainvitals.dashboard.client import CollectorClient, RunSummary, Series
from trainvitals.dashboard.common import alert_table, rank_count
from trainvitals.dashboard.state import Window

FINGERPRINT_COLORS = {derive.AGREES: "#a1d99b", derive.DIFFERS: "#d62728", derive.SPLIT: "#ff7f0e"}
FAULT_COLUMNS = ["step", "rank", "kind", "detail", "first_alert", "alert_step", "delay_steps"]


@dataclass(frozen=True)
class HealthData:
    alerts: pd.DataFrame
    events: pd.DataFrame
    fingerprints: Series  # bucket means of canary_fingerprint per rank


def load(client: CollectorClient, run: RunSummary, window: Window) -> HealthData:
    max_steps = charts.heatmap_steps(rank_count(client, run))
    fingerprints = client.ranks(
        run.run_id, "canary_fingerprint", window.start, window.end, max_steps, agg="mean"
    )
    return HealthData(client.alerts(run.run_id), client.events(run.run_id), fingerprints)


def render(data: HealthData, run: RunSummary, window: Window) -> None:
    steps = (window.start, window.end if window.end is not None else run.last_step or 0)
    timeline(data.alerts, data.events, steps)
    st.subheader("Alerts")
    if data.alerts.empty:
        st.success("No alerts for this run.")
    else:
        st.caption("Every alert of the run, newest first; select one to jump to it.")
        alert_table(data.alerts, run, key="alerts:health")
    fingerprint_agreement(data.fingerprints, (steps[0], steps[1] + 1))
    injected_faults(data.events, data.alerts)


def timeline(alerts: pd.DataFrame, events: pd.DataFrame, steps: tuple[int, int]) -> None:
    first, last = steps
    shown_alerts = alerts[alerts["step"].between(first, last)]
    shown_events = events[events["step"].between(first, last)]
    if shown_alerts.empty and shown_events.empty:
        st.caption(f"No alerts or events between steps {first:,} and {last:,}.")
        return
    st.altair_chart(charts.alert_timeline(shown_alerts, shown_events, (first, last + 1)))


def fingerprint_agreement(grid: Series, steps: tuple[int, int]) -> None:
    st.subheader("SDC fingerprints")
    if not grid.frame["value"].notna().any():
        st.info(
            "No SDC fingerprints in this window: the run's hooks did not run the canary "
            "computation, so ranks cannot be compared for silent data corruption."
        )
        return
    status = derive.fingerprint_agreement(grid.frame)
    bad = status[status["status"] != derive.AGREES]
    n_ranks, n_buckets = status["rank"].nunique(), status["step"].nunique()
    if bad.empty:
        st.success(
            f"All {n_ranks} ranks agree at every canary step in this window "
            f"({n_buckets} bucket(s) of {grid.bucket_steps} step(s) checked)."
        )
    else:
        st.error(disagreement_message(bad, grid.bucket_steps))
    st.altair_chart(
        charts.status_heatmap(
            status, grid.bucket_steps, FINGERPRINT_COLORS, "fingerprint", steps=steps
        )
    )


def disagreement_message(bad: pd.DataFrame, bucket_steps: int) -> str:
    """Which ranks disagree, and from which step (or bucket of steps) on."""
    first = bad.groupby("rank")["step"].min().sort_values()
    shown = ", ".join(f"rank {r} (from step {s:,})" for r, s in first.head(8).items())
    more = f" and {len(first) - 8} more" if len(first) > 8 else ""
    message = f"Canary fingerprints disagree: {shown}{more}."
    if bucket_steps > 1:
        message += (
            f" Each step named starts a bucket of {bucket_steps} steps; narrow the window "
            "to find the exact step."
        )
    if (bad["status"] == derive.SPLIT).any():
        message += " In some buckets no fingerprint has a majority."
    return message


def injected_faults(events: pd.DataFrame, alerts: pd.DataFrame) -> None:
    st.subheader("Injected faults (ground truth)")
    faults = events[events["kind"].str.startswith("fault:")]
    if faults.empty:
        st.info("No injected faults recorded: this run has no ground truth to compare with.")
        return
    st.dataframe(
        derive.first_alert_after(faults, alerts),
        hide_index=True,
        column_order=FAULT_COLUMNS,
        column_config={
            "rank": st.column_config.NumberColumn("rank (-1: job)"),
            "first_alert": "first alert at or after it",
            "alert_step": st.column_config.NumberColumn("alert step", format="%d"),
            "delay_steps": st.column_config.NumberColumn("delay (steps)", format="%d"),
        },
    )
