"""Display pieces that several views share: number formats, empty states, the alert table."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pandas as pd
import streamlit as st

from trainvitals.dashboard.client import CollectorClient, RunSummary
from trainvitals.dashboard.state import Window, jump_for, request_jump

ALERT_TABLE_COLUMNS = [
    "time",
    "step",
    "severity",
    "kind",
    "rank",
    "layer",
    "value",
    "baseline",
    "message",
]


def rank_count(client: CollectorClient, run: RunSummary) -> int:
    """The run's world size; from its data (one small request) when it sent no metadata."""
    if run.world_size:
        return run.world_size
    return client.ranks(run.run_id, "step_time_s", max_steps=1).frame["rank"].nunique()


def fmt(value: float | None, spec: str, missing: str = "n/a", unit: str = "") -> str:
    """Format a metric; a null (None or NaN) value reads as `missing`, never as "nan"."""
    if value is None or math.isnan(value):
        return missing
    return f"{value:{spec}}{unit}"


def duration_label(seconds: float) -> str:
    """Seconds as a person reads a remaining time: "3 d 4 h", "2 h 5 min", "40 s"."""
    if math.isnan(seconds):
        return "n/a"
    days, rest = divmod(int(seconds), 86_400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days} d {hours} h"
    if hours:
        return f"{hours} h {minutes} min"
    return f"{minutes} min {secs} s" if minutes else f"{secs} s"


def no_power_message(run: RunSummary) -> str:
    """Why a run has no power figures, naming the sources it tried when it said so."""
    if run.power_unavailable:
        return f"No power source on this host. Tried: {run.power_unavailable}"
    if run.power_source:
        return f"The power source ({run.power_source}) reported no samples in this window."
    return (
        "No power data in this run, and the run did not say which power sources it tried "
        "(its hooks predate power reporting, or the collector does not serve the reason)."
    )


def layer_label(index: int | None, layer_names: Sequence[str]) -> str | None:
    """Name of a layer index; None (or pd.NA) when the alert is not about a layer."""
    if index is None or pd.isna(index):
        return None
    return layer_names[index] if index < len(layer_names) else f"layer {index}"


def alerts_view(alerts: pd.DataFrame, layer_names: Sequence[str]) -> pd.DataFrame:
    """Alerts as displayed: UTC time, layer names, newest first."""
    view = alerts.sort_values(["step", "time_unix_s"], ascending=False, ignore_index=True)
    view.insert(0, "time", pd.to_datetime(view.pop("time_unix_s"), unit="s", utc=True))
    view.insert(len(view.columns), "layer_index", view["layer"])
    view["layer"] = [layer_label(i, layer_names) for i in view["layer"]]
    return view


def alert_table(alerts: pd.DataFrame, run: RunSummary, key: str) -> None:
    """The alerts with their evidence; selecting one jumps to its step (and culprit's view).

    The selection is read in the script body, not in an on_select callback: the body can
    start the full rerun a jump needs from inside the live fragment, and a test can drive
    it through session state. The jump clears the selection, so a table redrawn with it
    (or with new rows above it) does not jump again.
    """
    view = alerts_view(alerts, run.layer_names)
    event = st.dataframe(
        view,
        hide_index=True,
        key=key,
        on_select="rerun",
        selection_mode="single-row",
        column_order=ALERT_TABLE_COLUMNS,
        column_config={
            "time": st.column_config.DatetimeColumn("time (UTC)", format="YYYY-MM-DD HH:mm:ss"),
            "value": st.column_config.NumberColumn("observed", format="%.4g"),
            "baseline": st.column_config.NumberColumn("expected", format="%.4g"),
        },
    )
    if not event.selection.rows:
        return
    alert = view.iloc[event.selection.rows[0]]
    rank, layer = alert["rank"], alert["layer_index"]
    jump = jump_for(
        run.run_id,
        int(alert["step"]),
        run.last_step or 0,
        rank=None if pd.isna(rank) else int(rank),
        layer=None if pd.isna(layer) else int(layer),
    )
    request_jump(jump, clear_key=key)


SI_PREFIXES = ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"), (1.0, ""),
               (1e-3, "m"), (1e-6, "\u00b5"), (1e-9, "n"), (1e-12, "p"))  # fmt: skip


def si(value: float | None, unit: str, digits: int = 4) -> str:
    """A value with the SI prefix that keeps it between 1 and 1000: (1.902e8, "FLOP/s") ->
    "190.2 MFLOP/s", (0.5, "W") -> "500 mW", (5156, "tokens/s") -> "5.156 k tokens/s" (a
    word for a unit stands apart from the prefix); null reads "n/a", zero "0 {unit}"."""
    if value is None or math.isnan(value):
        return "n/a"
    if value == 0 or math.isinf(value):
        return f"{value:g} {unit}"
    scale, prefix = next(((s, p) for s, p in SI_PREFIXES if abs(value) >= s), SI_PREFIXES[-1])
    word = len(unit.split("/")[0]) > 1 and unit[:1].islower()
    return f"{value / scale:.{digits}g} {prefix}{' ' if word and prefix else ''}{unit}"


def view_steps(window: Window, run: RunSummary) -> tuple[int, int]:
    """The step axis of a view: (first step, end) of the window, the end one past its last
    step, so that every chart of the view spans the same steps."""
    last = window.end if window.end is not None else run.last_step or 0
    return window.start, last + 1
