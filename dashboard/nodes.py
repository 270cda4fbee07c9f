"""Nodes: ranks grouped by host, the unit an operator fences.

At 100,000 GPUs people look at 12,500 nodes, not at ranks. Per node: throughput, step,
compute and waiting time, power, network and interconnect rates over the window (the
collector combines the node's ranks at each step: collector/query.py, _NODE_AGG), a step x
node heatmap of step time, and the ranks of one node on demand.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
import streamlit as st

from trainvitals.dashboard import charts
from trainvitals.dashboard.client import CollectorClient, RunSummary, Series
from trainvitals.dashboard.common import si, view_steps
from trainvitals.dashboard.state import Window

NODE_KEY = "node_ranks"
# Node table columns: (summary field, header, SI unit). Step time ranks the nodes.
COLUMNS = (
    ("step_time_s", "step time (slowest rank)", "s"),
    ("wait_time_s", "waiting time (rank mean)", "s"),
    ("tokens_per_s", "throughput", "tokens/s"),
    ("power_w", "power", "W"),
    ("net_rx_bytes_per_s", "network in", "B/s"),
    ("net_tx_bytes_per_s", "network out", "B/s"),
    ("ib_rx_bytes_per_s", "InfiniBand in", "B/s"),
    ("ib_tx_bytes_per_s", "InfiniBand out", "B/s"),
    ("nvlink_rx_bytes_per_s", "NVLink in", "B/s"),
    ("nvlink_tx_bytes_per_s", "NVLink out", "B/s"),
)
# Per-rank figures of one node, on demand: (rank metric, header, SI unit).
RANK_COLUMNS = (
    ("step_time_s", "step time", "s"),
    ("compute_time_s", "compute time", "s"),
    ("wait_time_s", "waiting time", "s"),
    ("tokens_per_s", "throughput", "tokens/s"),
    ("power_w", "power", "W"),
)
# Nodes listed in the table: the slowest ones; the heatmap shows them all.
MAX_TABLE_NODES = 200


@dataclass(frozen=True)
class NodesData:
    summary: pd.DataFrame  # client.node_summary: one row per node
    step_time: Series  # step x node grid of the node's step time, bucket max
    hosts: list[str]  # the nodes' host names, by node index


def load(client: CollectorClient, run: RunSummary, window: Window) -> NodesData:
    fields = [field for field, _, _ in COLUMNS]  # each one costs a scan's worth: no more
    summary = client.node_summary(run.run_id, window.start, window.end, fields)
    max_steps = charts.heatmap_steps(max(1, len(summary)))
    grid, hosts, _ = client.nodes(
        run.run_id, "step_time_s", window.start, window.end, max_steps, agg="max"
    )
    return NodesData(summary, grid, hosts)


def render(data: NodesData, run: RunSummary, window: Window, client: CollectorClient) -> None:
    if data.summary.empty:
        st.info(
            "No nodes to show: the run did not send its ranks' host names (runs.hosts_json), "
            "or has no per-rank rows in this window."
        )
        return
    summary = data.summary.sort_values("step_time_s", ascending=False, na_position="last")
    reported = [c for c in COLUMNS if summary[c[0]].notna().any()]
    missing = [header for field, header, _ in COLUMNS if not summary[field].notna().any()]
    st.subheader(f"{len(summary):,} node{'s' if len(summary) != 1 else ''}, slowest first")
    caption = (
        "Per node over the window: its slowest rank's step time, its ranks' mean waiting "
        "time, the sum of their throughput and power, the node's network rates."
    )
    if missing:
        caption += f" Not reported by this run: {', '.join(missing)}."
    st.caption(caption)
    table = pd.DataFrame({"host": summary["host"], "ranks": summary["ranks"]})
    for field, header, unit in reported:
        table[header] = [si(v, unit) for v in summary[field]]
    st.dataframe(table.head(MAX_TABLE_NODES), hide_index=True)
    st.subheader("Step time per node")
    grid = data.step_time
    if grid.frame["value"].notna().any():
        steps = view_steps(window, run)
        st.altair_chart(charts.node_heatmap(grid.frame, grid.bucket_steps, "step time (s)", steps))
    node_ranks(client, run, window, list(summary["host"]))


def node_ranks(
    client: CollectorClient, run: RunSummary, window: Window, hosts_slowest_first: list[str]
) -> None:
    """The ranks of the node the user picks, with their own figures."""
    host = st.selectbox(
        "Ranks of node",
        hosts_slowest_first,
        index=None,
        key=NODE_KEY,
        placeholder="Pick a node to see its ranks",
    )
    if host is None:
        return
    rank_hosts = client.hosts(run.run_id) or []
    ranks = [r for r, h in enumerate(rank_hosts) if h == host]
    table = pd.DataFrame({"rank": ranks})
    pairs = [(metric, "mean") for metric, _, _ in RANK_COLUMNS]
    means = client.rank_grid(run.run_id, pairs, window.start, window.end, 1, ranks)
    for metric, header, unit in RANK_COLUMNS:
        values = means[(metric, "mean")].frame.set_index("rank")["value"].reindex(ranks)
        if values.notna().any():
            table[header] = [si(v, unit) for v in values]
    st.dataframe(table, hide_index=True)
