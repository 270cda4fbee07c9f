"""GET /metrics: Prometheus text format, built at scrape time from the live state.

Cardinality stays bounded: series are per run (and per alert kind), never per layer or
per rank; the rank dimension is summarised as median, p99 and max of step time and of
device power.
"""

from __future__ import annotations

import gc
import math
from typing import Annotated

from fastapi import APIRouter, Depends, Response
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from trainvitals.analyzer.live import LiveAnalysis

from .deps import get_analysis, get_live, get_settings, get_store, get_watchdog
from .settings import Settings
from .state import CollectorStats, LiveState, RunState
from .store import Store, WriteStats
from .watchdog import LiveWatchdog

router = APIRouter(tags=["metrics"])

# (name, help, field of the latest steps row): one gauge per run each.
_RUN_GAUGES = (
    ("trainvitals_step", "Latest logged optimizer step.", "step"),
    ("trainvitals_loss", "Training loss at the latest logged step.", "loss"),
    (
        "trainvitals_grad_norm",
        "Global gradient L2 norm (before clipping) at the latest step.",
        "grad_norm",
    ),
    (
        "trainvitals_tokens_per_second",
        "Job throughput at the latest step, tokens/s.",
        "tokens_per_s",
    ),
    ("trainvitals_mfu_ratio", "Model FLOPs utilisation at the latest step, 0..1.", "mfu_ratio"),
    (
        "trainvitals_achieved_flops_per_second_per_device",
        "Achieved model FLOP/s of one device at the latest step.",
        "tflops_per_s_per_device",
    ),
    (
        "trainvitals_step_time_seconds",
        "Wall time of the latest step (slowest rank).",
        "step_time_s",
    ),
    (
        "trainvitals_last_step_timestamp_seconds",
        "Unix time of the latest logged step.",
        "time_unix_s",
    ),
)


class TrainvitalsCollector(Collector):
    """Yields metric families built from a LiveState snapshot at each scrape."""

    def __init__(
        self,
        live: LiveState,
        store: Store,
        watchdog: LiveWatchdog | None = None,
        max_runs: int = 0,
        analysis: LiveAnalysis | None = None,
    ) -> None:
        """`max_runs`: series of this many runs at most, the latest first (0: every run).
        `analysis`: the live analysis (None in replay mode: no lag, no errors)."""
        self.live = live
        self.store = store
        self.watchdog = watchdog
        self.max_runs = max_runs
        self.analysis = analysis

    def collect(self):
        runs, stats = self.live.snapshot()
        runs, left_out = _latest_runs(runs, self.max_runs)
        for name, doc, key in _RUN_GAUGES:
            g = GaugeMetricFamily(name, doc, labels=["run_id"])
            for run_id, run in runs.items():
                if key in run.latest and run.latest[key] is not None:
                    value = run.latest[key]
                    # Converted where it enters: the store keeps TFLOP/s, Prometheus base units.
                    g.add_metric(
                        [run_id], value * 1e12 if key == "tflops_per_s_per_device" else value
                    )
            yield g
        rank = GaugeMetricFamily(
            "trainvitals_rank_step_time_seconds",
            "Per-rank step time at the latest step, summarised across ranks.",
            labels=["run_id", "stat"],
        )
        alerts = CounterMetricFamily(
            "trainvitals_alerts",
            "Alerts raised by the analyzer, by kind and culprit rank ('' when none).",
            labels=["run_id", "kind", "rank"],
        )
        dropped = CounterMetricFamily(
            "trainvitals_telemetry_dropped",
            "Logged steps and batches the run's hooks dropped (queue full, spool unwritable).",
            labels=["run_id"],
        )
        active = GaugeMetricFamily(
            "trainvitals_alert_active",
            "1 while an episode (straggler, rank_lost, hang, loss_diverging) is unresolved; "
            "the series is absent otherwise and once the run has ended.",
            labels=["run_id", "kind", "rank", "start_step"],
        )
        ended = GaugeMetricFamily(
            "trainvitals_run_end_timestamp_seconds",
            "Unix time at which the run reported a clean end; absent while it runs.",
            labels=["run_id"],
        )
        for run_id, run in runs.items():
            for stat, value in run.rank_step_time_s.items():
                rank.add_metric([run_id, stat], value)
            for (kind, culprit), count in run.alerts_by_kind.items():
                # '' when the alert names no rank: Prometheus treats an empty label as absent.
                alerts.add_metric([run_id, kind, "" if culprit is None else str(culprit)], count)
            if run.ended_unix_s is None:  # an ended run has nothing left to fix
                for (kind, culprit), start in run.active.items():
                    active.add_metric(
                        [run_id, kind, "" if culprit is None else str(culprit), str(start)], 1
                    )
            if "step" in run.latest:  # 0 from the first step on, so increase() sees the first drop
                dropped.add_metric([run_id], run.latest.get("telemetry_dropped") or 0)
            if run.ended_unix_s is not None:
                ended.add_metric([run_id], run.ended_unix_s)
        yield rank
        yield from _power_metrics(runs)
        yield alerts
        yield active
        yield dropped
        yield ended
        yield from _self_metrics(stats, self.store.writes, self.store.queue_depth, self.analysis)
        yield GaugeMetricFamily(
            "trainvitals_collector_store_writable",
            "1 while the store takes writes; 0 after a write failed for want of storage (a "
            "full disk), until the collector reopens it (see /readyz).",
            value=float(getattr(self.store, "unwritable", None) is None),
        )
        yield GaugeMetricFamily(
            "trainvitals_collector_runs_not_exported",
            "Stored runs left out of /metrics by the cap (max_metrics_runs): the ones whose "
            "latest step is oldest. The query API and the dashboard still serve them.",
            value=left_out,
        )
        if self.watchdog is not None:
            yield from _watchdog_metrics(self.watchdog)


def _power_metrics(runs: dict[str, RunState]):
    """Job power and energy at each run's latest logged step, and its ranks' device power
    summarised (median, p99, max) at their latest step, from the live state (a scrape never
    reads the store, which may be failing). A run without power data has no series."""
    power = GaugeMetricFamily(
        "trainvitals_power_watts",
        "Power of all devices of the job, mean over the latest logged step.",
        labels=["run_id"],
    )
    energy = CounterMetricFamily(
        "trainvitals_energy_joules",
        "Energy of all devices of the job since its monitor started (it starts again from 0 "
        "when a run resumes: a counter reset).",
        labels=["run_id"],
    )
    rank_power = GaugeMetricFamily(
        "trainvitals_rank_power_watts",
        "Per-rank device power at the latest step with per-rank rows, summarised across ranks.",
        labels=["run_id", "stat"],
    )
    for run_id, run in runs.items():
        if _finite(run.latest.get("power_w")):
            power.add_metric([run_id], run.latest["power_w"])
        if _finite(run.latest.get("energy_j")):
            energy.add_metric([run_id], run.latest["energy_j"])
        for stat, value in run.rank_power_summary_w.items():
            rank_power.add_metric([run_id, stat], value)
    yield power
    yield energy
    yield rank_power


def _finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


def _watchdog_metrics(watchdog: LiveWatchdog):
    yield CounterMetricFamily(
        "trainvitals_collector_watchdog_errors",
        "Liveness watchdog ticks that failed, and heartbeat batches the store failed to write.",
        value=watchdog.errors,
    )
    yield CounterMetricFamily(
        "trainvitals_collector_heartbeats_dropped",
        "Heartbeats never written to the store (the writer took none for too long).",
        value=watchdog.dropped_rows,
    )
    yield CounterMetricFamily(
        "trainvitals_collector_heartbeats_late",
        "Heartbeats handed to the watchdog after the time it had judged (an overloaded "
        "collector): judged on arrival, so a replay may differ.",
        value=watchdog.watchdog.late,
    )
    paused = GaugeMetricFamily(
        "trainvitals_run_paused",
        "1 while the run's job is in a pause its training loop declared (monitor.pause: a "
        "checkpoint save, an evaluation), by phase; absent otherwise. TrainvitalsRunStalled "
        "leaves such a run alone; the watchdog allows the pause 3x the run's longest "
        "earlier pause of that phase (at least 5 min, at most liveness.pause_s).",
        labels=["run_id", "phase"],
    )
    for run_id, phases in watchdog.declared_pauses().items():
        paused.add_metric([run_id, "+".join(phases)], 1.0)
    yield paused


def _self_metrics(
    stats: CollectorStats, writes: WriteStats, queue_depth: int, analysis: LiveAnalysis | None
):
    requests = CounterMetricFamily(
        "trainvitals_collector_http_requests",
        "HTTP requests served, by status code.",
        labels=["code"],
    )
    for code, n in stats.requests.items():
        requests.add_metric([str(code)], n)
    yield requests
    yield CounterMetricFamily(
        "trainvitals_collector_rejected_batches",
        "Ingest requests rejected (4xx): nothing stored.",
        value=stats.rejected_batches,
    )
    rows = CounterMetricFamily(
        "trainvitals_collector_ingested_rows",
        "Rows written to the store, by table.",
        labels=["table"],
    )
    for table, n in stats.ingested_rows.items():
        rows.add_metric([table], n)
    yield rows
    changed = CounterMetricFamily(
        "trainvitals_collector_changed_rows",
        "Rows not stored because their key is stored with other values (the first copy "
        "stays; the sender is told), by table.",
        labels=["table"],
    )
    for table, n in writes.changed_rows.items():
        changed.add_metric([table], n)
    yield changed
    yield CounterMetricFamily(
        "trainvitals_collector_write_errors",
        "Batches the writer failed to store.",
        value=writes.write_errors,
    )
    yield GaugeMetricFamily(
        "trainvitals_collector_queue_depth_batches",
        "Batches waiting for the writer.",
        value=queue_depth,
    )
    yield CounterMetricFamily(
        "trainvitals_collector_write_seconds",
        "Time spent writing batches.",
        value=writes.write_seconds_sum,
    )
    yield CounterMetricFamily(
        "trainvitals_collector_written_batches",
        "Batches written to the store.",
        value=writes.written_batches,
    )
    yield CounterMetricFamily(
        "trainvitals_collector_commits",
        "Store transactions; each holds every batch that was waiting (a group commit).",
        value=writes.commits,
    )
    yield GaugeMetricFamily(
        "trainvitals_collector_analysis_lag_seconds",
        "Age of the oldest committed step whose alerts are not stored yet (about 1 s normally).",
        value=analysis.lag_s if analysis else 0.0,
    )
    yield CounterMetricFamily(
        "trainvitals_collector_analysis_errors",
        "Windows of steps the live analyzer failed on (see the collector's log).",
        value=analysis.errors if analysis else 0,
    )
    yield GaugeMetricFamily(
        "trainvitals_collector_gc_frozen_objects",
        "Long-lived objects frozen out of full garbage collections (collector/gcguard.py); "
        "a reference cycle among them that dies is not reclaimed.",
        value=gc.get_freeze_count(),
    )


def _latest_runs(runs: dict[str, RunState], cap: int) -> tuple[dict[str, RunState], int]:
    """The `cap` runs (0: all) whose latest step is newest, running ones first; and how
    many were left out. About 9 series a run: 3,000 stored runs made 27,000 lines."""
    if not cap or len(runs) <= cap:
        return runs, 0

    def recency(item: tuple[str, RunState]) -> tuple[bool, float]:
        run = item[1]
        return run.ended_unix_s is None, run.latest.get("time_unix_s") or 0.0

    kept = dict(sorted(runs.items(), key=recency, reverse=True)[:cap])
    return kept, len(runs) - cap


def build_registry(
    live: LiveState,
    store: Store,
    watchdog: LiveWatchdog | None = None,
    max_runs: int = 0,
    analysis: LiveAnalysis | None = None,
) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(TrainvitalsCollector(live, store, watchdog, max_runs, analysis))
    return registry


@router.get("/metrics")
def metrics(
    store: Annotated[Store, Depends(get_store)],
    live: Annotated[LiveState, Depends(get_live)],
    settings: Annotated[Settings, Depends(get_settings)],
    watchdog: Annotated[LiveWatchdog | None, Depends(get_watchdog)],
    analysis: Annotated[LiveAnalysis | None, Depends(get_analysis)],
) -> Response:
    registry = build_registry(live, store, watchdog, settings.max_metrics_runs, analysis)
    return Response(
        generate_latest(registry), media_type="text/plain; version=0.0.4; charset=utf-8"
    )
