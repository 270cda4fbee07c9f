"""Ranks: where each rank's time goes, the slowest ranks and what they cost, device power."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import streamlit as st

from trainvitals.analyzer.runinfo import host_is_device
from trainvitals.analyzer.views import COLLECTIVE_TIMES
from trainvitals.dashboard import charts, derive
from trainvitals.dashboard.client import CollectorClient, RunSummary, Series
from trainvitals.dashboard.common import no_power_message, rank_count, view_steps
from trainvitals.dashboard.state import Window

SLOWEST_SHOWN = 10
# Per-rank device readings: (field, what it is, axis title with unit).
DEVICE_METRICS = (
    ("power_w", "power", "mean power (W)"),
    ("sm_clock_mhz", "SM clock", "mean SM clock (MHz)"),
    ("temperature_c", "temperature", "mean temperature (°C)"),
)
# Collectives the hooks count per rank: field prefix -> name. Each has _count, _bytes and
# _time_s fields (trainvitals/schema/declarations.py).
COLLECTIVES = {
    "all_gather": "all-gather",
    "reduce_scatter": "reduce-scatter",
    "all_reduce": "all-reduce",
}


@dataclass(frozen=True)
class RanksData:
    time_field: str  # compute_time_s, or step_time_s from a run without the breakdown
    busy: Series  # time_field, bucket max
    busy_means: Series  # time_field, bucket mean: what the ranking of slow ranks sums
    wait: Series  # wait_time_s, bucket max
    wait_means: Series  # wait_time_s, bucket mean: who arrived last at the step's end
    # COLLECTIVE_TIMES, bucket means: with the waits, the detector's arrival signal
    collective_means: tuple[Series, ...]
    step_means: Series  # step_time_s, bucket mean: the step the arrival is a fraction of
    data_means: Series  # data_time_s, bucket mean: the detector's data signal
    stopped_means: Series  # stopped_time_s, bucket mean: the detector's stopped signal (CPU)
    device: dict[str, Series]  # DEVICE_METRICS fields, one bucket: the window's mean
    # COLLECTIVES prefix -> its bytes and time per step, one bucket: the window's mean.
    # Only collectives the run reported and that moved bytes.
    collectives: dict[str, tuple[Series, Series]]
    # Collectives the run reported at zero bytes on every rank (DDP's all-gather).
    idle_collectives: tuple[str, ...] = ()
    # Ranks the intermittent straggler detector named in the window: rank -> the share of
    # the logged time it held the job up (derive.intermittent_ranks).
    intermittent: dict[int, float] = dataclasses.field(default_factory=dict)


# Asked of the collector in two requests, each one scan of the window's rank rows (one
# request per series scanned them up to twelve times: 1.3 s for a view of 1,024 ranks x
# 10,000 logged steps, bench/dashboard_scale.py): the heatmaps' grid, and window means.
GRID_PAIRS = (
    [(field, agg) for field in ("compute_time_s", "step_time_s") for agg in ("max", "mean")]
    + [("wait_time_s", agg) for agg in ("max", "mean")]
    + [(field, "mean") for field in ("data_time_s", "stopped_time_s")]
    + [(field, "mean") for field in COLLECTIVE_TIMES]
)
MEAN_FIELDS = [field for field, _, _ in DEVICE_METRICS] + [
    f"{prefix}_{what}" for prefix in COLLECTIVES for what in ("bytes", "time_s")
]


def load(client: CollectorClient, run: RunSummary, window: Window) -> RanksData:
    max_steps = charts.heatmap_steps(rank_count(client, run))
    grid = client.rank_grid(run.run_id, GRID_PAIRS, window.start, window.end, max_steps)
    means = client.rank_grid(
        run.run_id, [(f, "mean") for f in MEAN_FIELDS], window.start, window.end, max_steps=1
    )
    time_field = "compute_time_s"
    if not grid[(time_field, "max")].frame["value"].notna().any():
        time_field = "step_time_s"
    return RanksData(
        time_field=time_field,
        busy=grid[(time_field, "max")],
        busy_means=grid[(time_field, "mean")],
        wait=grid[("wait_time_s", "max")],
        wait_means=grid[("wait_time_s", "mean")],
        step_means=grid[("step_time_s", "mean")],
        data_means=grid[("data_time_s", "mean")],
        stopped_means=grid[("stopped_time_s", "mean")],
        collective_means=tuple(grid[(field, "mean")] for field in COLLECTIVE_TIMES),
        device={name: means[(name, "mean")] for name, _, _ in DEVICE_METRICS},
        intermittent=derive.intermittent_ranks(client.alerts(run.run_id), window.start, window.end),
        **load_collectives(lambda name: means[(name, "mean")]),
    )


def load_collectives(mean: Callable[[str], Series]) -> dict:
    """Window means per rank of each reported collective's bytes and time per step, and
    the collectives reported at zero bytes everywhere (`collectives`, `idle_collectives`).
    `mean(field)`: the window's mean of `field` per rank."""
    out, idle = {}, []
    for prefix in COLLECTIVES:
        nbytes = mean(f"{prefix}_bytes")
        values = nbytes.frame["value"]
        if not values.notna().any():
            continue
        if values.fillna(0).eq(0).all():
            idle.append(prefix)
            continue
        out[prefix] = (nbytes, mean(f"{prefix}_time_s"))
    return {"collectives": out, "idle_collectives": tuple(idle)}


def render(data: RanksData, run: RunSummary, window: Window) -> None:
    if data.busy.frame.empty:
        st.info("No per-rank statistics for this run in this window.")
        return
    time_name = "compute time" if data.time_field == "compute_time_s" else "step time"
    if data.time_field == "step_time_s":
        st.warning(
            "This run did not report compute and waiting time per rank; showing step time, "
            "which synchronisation evens out across ranks, so a straggler shows less."
        )
    st.caption(
        f"Max over each bucket of {data.busy.bucket_steps} step(s); colours span the 1st to "
        "99th percentile, so one slow start-up step does not wash out the rest."
    )
    busy, wait = data.busy, data.wait
    # The view's window on both heatmaps, so that a column means the same steps in each.
    steps = view_steps(window, run)
    left, right = st.columns(2)
    with left:
        st.subheader(f"{time_name.capitalize()} per rank")
        st.altair_chart(
            charts.rank_heatmap(busy.frame, busy.bucket_steps, f"{time_name} (s)", steps)
        )
    with right:
        st.subheader("Waiting time per rank")
        if wait.frame["value"].notna().any():
            st.altair_chart(
                charts.rank_heatmap(wait.frame, wait.bucket_steps, "waiting (s)", steps)
            )
        else:
            st.info("This run did not report the time each rank waits at synchronisation.")
    slowest_ranks(data, time_name, run)
    device_charts(data.device, run)
    collective_charts(data.collectives, data.idle_collectives)


def slowest_ranks(data: RanksData, time_name: str, run: RunSummary) -> None:
    st.subheader("Slowest ranks")
    means = data.busy_means
    costs = derive.rank_costs(
        means.frame.dropna(subset=["value"]),
        means.bucket_steps,
        waits=data.wait_means.frame,
        step_times=data.step_means.frame,
        tp=run.tp or 1,
        stopped=data.stopped_means.frame,
        collectives=tuple(series.frame for series in data.collective_means),
        data=data.data_means.frame if host_is_device(run.device_type) else None,
    )
    st.caption(
        "Judged as the straggler detector judges them, each bucket a step, by its signals: "
        f"its {time_name} over the median rank's (confirmed by arriving last at the step's "
        "end), how much later than the median rank it arrived at the step's end and in the "
        "model's collectives, and (CPU ranks) how much longer it waited for its data and "
        "how much longer its process was stopped, each as a share of the step. A straggler "
        "cleared a signal's bar (this window's rank-to-rank spread) in "
        "most buckets of the detector's persistence window somewhere in this window; the "
        "others follow by how far they came to a bar. The cost is the time each spent "
        "beyond the median rank, summed over the window: a synchronous step waits for its "
        "slowest rank."
    )
    # A rank named for single slow steps is shown whatever its rank in the averages.
    held_up = costs["rank"].map(data.intermittent) * 100
    shown = costs.assign(held_up=held_up)
    shown = shown[(shown.index < SLOWEST_SHOWN) | held_up.notna()]
    if data.intermittent:
        st.caption(
            "Held up the job in single steps: ranks the intermittent straggler detector "
            "named in this window (a step now and then, which the averages here hide), with "
            "the share of the logged time the job waited for them."
        )
    st.dataframe(
        shown.assign(
            slower=shown["slower"] * 100,
            late=shown["late"] * 100,
            data=shown["data"] * 100,
            stopped=shown["stopped"] * 100,
        ),
        hide_index=True,
        column_config={
            "straggler": st.column_config.CheckboxColumn("straggler"),
            "named_by": st.column_config.TextColumn("named by"),
            "slower": st.column_config.NumberColumn(f"{time_name} over median (%)", format="%.1f"),
            "late": st.column_config.NumberColumn("late at step end (% of step)", format="%.1f"),
            "data": st.column_config.NumberColumn(
                "data wait beyond median (% of step)", format="%.1f"
            ),
            "stopped": st.column_config.NumberColumn(
                "stopped beyond median (% of step)", format="%.1f"
            ),
            "held_up": st.column_config.NumberColumn(
                "held up the job in single steps (% of time)", format="%.1f"
            ),
            "behind_s": st.column_config.NumberColumn("cost to the job (s)", format="%.3f"),
            "mean_s": st.column_config.NumberColumn(f"mean {time_name} (s)", format="%.4f"),
        },
    )


def device_charts(device: dict[str, Series], run: RunSummary) -> None:
    st.subheader("Power and clocks per rank")
    columns = st.columns(len(DEVICE_METRICS))
    for column, (field, what, axis_title) in zip(columns, DEVICE_METRICS, strict=True):
        frame = device[field].frame
        if frame["value"].notna().any():
            title = f"{what[0].upper()}{what[1:]} per rank"
            column.altair_chart(charts.rank_mean_bar(frame, axis_title, title=title))
        elif field == "power_w":
            column.info(no_power_message(run))
        else:
            column.info(f"This run did not report the {what} of its devices.")


def collective_charts(
    collectives: dict[str, tuple[Series, Series]], idle: tuple[str, ...] = ()
) -> None:
    """Per collective, each rank's algorithm bandwidth (B/s) when the backend timed every
    collective shown, else each one's bytes per step: one unit across the charts."""
    st.subheader("Collective traffic per rank")
    idle_names = " and ".join(COLLECTIVES[p] for p in idle)
    if idle:
        st.caption(
            f"No {idle_names} traffic: this run's ranks reported zero bytes for it "
            "(data parallelism alone, DDP, only all-reduces)."
        )
    if not collectives:
        if not idle:
            st.info(
                "This run did not report its collectives (all-gather, reduce-scatter, "
                "all-reduce): no traffic or bandwidth to show."
            )
        return
    rates = {
        prefix: derive.collective_bandwidth(nbytes.frame, time_s.frame)
        for prefix, (nbytes, time_s) in collectives.items()
    }
    timed = all(rate["value"].notna().any() for rate in rates.values())
    if timed:
        st.caption(
            "Algorithm bandwidth (as nccl-tests counts it): bytes of the collectives' "
            "buffers / time they took, over the window's logged steps."
        )
    else:
        untimed = [COLLECTIVES[p] for p, r in rates.items() if not r["value"].notna().any()]
        st.caption(
            f"Bytes per step: the backend did not time the {' and '.join(untimed)}, so no "
            "bandwidth can be given, and every chart keeps one unit."
        )
    columns = st.columns(len(collectives))
    for column, (prefix, (nbytes, _)) in zip(columns, collectives.items(), strict=True):
        name = COLLECTIVES[prefix].capitalize()
        if timed:
            rate = rates[prefix].assign(value=rates[prefix]["value"] * derive.BYTES_PER_GB)
            title = f"{name} bandwidth per rank"
            column.altair_chart(charts.rank_mean_bar(rate, "bandwidth (B/s)", title=title))
        else:
            title = f"{name} traffic per rank"
            column.altair_chart(charts.rank_mean_bar(nbytes.frame, "bytes per step", title=title))
