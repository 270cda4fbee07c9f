"""In-memory view of each run's latest values, kept behind the writer, read by /metrics.

Prometheus scrapes must be cheap and must not touch the store: `LiveState` is a commit
listener of the store (the collector's lifespan, main.py, loads it from the store and
makes it one), so it folds in every commit before the batch is acknowledged, and a scrape
reads it under a lock. An update costs a few vectorised passes over the batch's columns,
not a Python object per row.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import duckdb
import numpy as np
import pyarrow.compute as pc

from trainvitals.analyzer import Alert
from trainvitals.analyzer.alerts import EPISODE_KINDS, RESOLVED
from trainvitals.analyzer.liveness import STOP_EVENT
from trainvitals.schema import STEPS

from .store import Store, StoreError, damaged

# steps fields mirrored per run (latest logged step): those the schema declares live.
STEP_FIELDS = tuple(f.name for f in STEPS.fields if f.live)


@dataclass
class RunState:
    latest: dict[str, float] = field(default_factory=dict)
    # (kind, culprit rank or None) -> alerts raised
    alerts_by_kind: Counter = field(default_factory=Counter)
    # (kind, culprit rank or None) -> first step of an episode not yet resolved
    active: dict = field(default_factory=dict)
    ended_unix_s: float | None = None  # when the run reported a clean end
    # The latest step with ranks rows, and their step times in seconds and device power in
    # watts, one array per batch: exporters that send per node split a step's ranks rows
    # across batches.
    ranks_step: int = -1
    rank_times_s: list[np.ndarray] = field(default_factory=list)
    rank_power_w: list[np.ndarray] = field(default_factory=list)

    def add_rank_times(
        self, step: int, times_s: np.ndarray, power_w: np.ndarray | None = None
    ) -> None:
        """Fold in step times (and power) of ranks at `step` (each rank once: the store's
        added rows)."""
        if step < self.ranks_step:
            return  # a late batch of an older step: the summary is of the latest step
        if step > self.ranks_step:
            self.ranks_step, self.rank_times_s, self.rank_power_w = step, [], []
        self.rank_times_s.append(times_s)
        if power_w is not None:
            self.rank_power_w.append(power_w[~np.isnan(power_w)])

    @property
    def rank_step_time_s(self) -> dict[str, float]:
        """Median, p99 and max of the latest step's rank step times; {} before any.

        Computed when read (a scrape, every 15 s or so), not per batch: a step of 1,024
        per-node batches would sort its growing set of ranks 1,024 times.
        """
        return _rank_summary(np.concatenate(self.rank_times_s)) if self.rank_times_s else {}

    @property
    def rank_power_summary_w(self) -> dict[str, float]:
        """Median, p99 and max of the latest step's per-rank device power; {} without any."""
        power = np.concatenate(self.rank_power_w) if self.rank_power_w else np.empty(0)
        return _rank_summary(power) if power.size else {}


@dataclass
class CollectorStats:
    """Self-metrics of the collector (exported as trainvitals_collector_*); the writer's
    own counts are the store's (`Store.writes`)."""

    requests: Counter = field(default_factory=Counter)  # by HTTP status code
    rejected_batches: int = 0
    ingested_rows: Counter = field(default_factory=Counter)  # by table


class LiveState:
    """Each run's latest values and the collector's counts: a commit listener of the
    store (`Store.listen`), loaded from it at start-up (`load`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.runs: dict[str, RunState] = {}
        self.stats = CollectorStats()
        # (run, time) of each `action:stop` event stored since start-up, in commit order:
        # the supervisor stopping a job, which the liveness watchdog reads (watchdog.py).
        self.stops: list[tuple[str, float]] = []

    def update(self, run_id: str, tables: dict[str, Any]) -> None:
        """Fold the rows a commit added to the store into their run's latest values.

        Pass only the rows the store added, not a batch as sent: a resent key keeps its
        first copy in the store, and /metrics must say what the store says.
        """
        last = ranks = end = None
        steps = tables.get("steps")
        if steps is not None and steps.num_rows:
            newest = pc.index(steps.column("step"), pc.max(steps.column("step"))).as_py()
            last = steps.select(list(STEP_FIELDS)).slice(newest, 1).to_pylist()[0]
        if tables.get("ranks") is not None and tables["ranks"].num_rows:
            ranks = _latest_step_times(tables["ranks"])
        events = tables.get("events")
        if events is not None and events.num_rows:
            ends = events.filter(pc.equal(events.column("kind"), "run_end"))
            end = pc.max(ends.column("time_unix_s")).as_py() if ends.num_rows else None
            stops = events.filter(pc.equal(events.column("kind"), STOP_EVENT))
            self.stops += [(run_id, t) for t in stops.column("time_unix_s").to_pylist()]
        with self._lock:
            run = self.runs.setdefault(run_id, RunState())
            if last is not None and last["step"] >= run.latest.get("step", -1):
                run.latest = last
            if ranks is not None:
                run.add_rank_times(*ranks)
            if end is not None:
                run.ended_unix_s = max(end, run.ended_unix_s or end)
            for name, t in tables.items():
                self.stats.ingested_rows[name] += t.num_rows

    def committed(self, run_id: str, tables: dict[str, Any]) -> None:
        """A commit listener: the rows one commit added (store.CommitListener)."""
        self.update(run_id, tables)

    def drain(self, timeout_s: float) -> bool:
        return True  # folded in on the writer thread: nothing is ever behind

    def close(self, timeout_s: float) -> None:
        pass

    def count_alerts(self, run_id: str, alerts: list[Alert]) -> None:
        """Count raised alerts; open and close episodes (alerts.EPISODE_KINDS)."""
        with self._lock:
            run = self.runs.setdefault(run_id, RunState())
            for a in alerts:  # in the order raised: a resolve follows its episode's alert
                _follow_episode(run.active, a.kind, a.rank, a.severity, a.start_step, a.step)
            run.alerts_by_kind.update((a.kind, a.rank) for a in alerts if not a.resolves)

    def load(self, query) -> None:
        """Rebuild the per-run view from a store (at start-up, and in replay mode).

        `query(sql, params)` returns a pyarrow.Table, as Store.query does.
        """
        latest = query(
            f"SELECT {', '.join(STEP_FIELDS)}, run_id FROM steps "
            "QUALIFY row_number() OVER (PARTITION BY run_id ORDER BY step DESC) = 1",
            [],
        ).to_pylist()
        ranks = query(
            "SELECT r.run_id, r.step, r.step_time_s, r.power_w FROM ranks r JOIN "
            "(SELECT run_id, max(step) AS step FROM ranks GROUP BY run_id) m USING (run_id, step)",
            [],
        )
        alerts = query(
            "SELECT run_id, kind, rank, count(*) AS n FROM alerts "
            f"WHERE severity <> '{RESOLVED}' GROUP BY ALL",
            [],
        ).to_pylist()
        # The last row of each episode kind and culprit: open unless it is a resolve.
        kinds = ", ".join(f"'{k}'" for k in sorted(EPISODE_KINDS))
        episodes = query(
            "SELECT run_id, kind, rank, severity, start_step, step FROM alerts "
            f"WHERE kind IN ({kinds}) QUALIFY row_number() OVER "
            "(PARTITION BY run_id, kind, rank ORDER BY step DESC) = 1",
            [],
        ).to_pylist()
        ends = query(
            "SELECT run_id, max(time_unix_s) AS t FROM events WHERE kind = 'run_end' GROUP BY ALL",
            [],
        ).to_pylist()
        with self._lock:
            for row in latest:
                self.runs.setdefault(row.pop("run_id"), RunState()).latest = row
            for run_id in set(ranks.column("run_id").to_pylist()):
                mine = ranks.filter(pc.equal(ranks.column("run_id"), run_id))
                self.runs.setdefault(run_id, RunState()).add_rank_times(*_latest_step_times(mine))
            for row in ends:
                self.runs.setdefault(row["run_id"], RunState()).ended_unix_s = row["t"]
            for row in alerts:
                key = (row["kind"], row["rank"])
                self.runs.setdefault(row["run_id"], RunState()).alerts_by_kind[key] = row["n"]
            for row in episodes:
                run = self.runs.setdefault(row.pop("run_id"), RunState())
                _follow_episode(run.active, **row)

    def snapshot(self) -> tuple[dict[str, RunState], CollectorStats]:
        with self._lock:
            runs = {
                k: RunState(
                    dict(v.latest),
                    Counter(v.alerts_by_kind),
                    dict(v.active),
                    v.ended_unix_s,
                    v.ranks_step,
                    list(v.rank_times_s),  # the arrays are never changed, only added
                    list(v.rank_power_w),
                )
                for k, v in self.runs.items()
            }
            s = self.stats
            stats = CollectorStats(
                Counter(s.requests),
                s.rejected_batches,
                Counter(s.ingested_rows),
            )
            return runs, stats

    def forget(self, run_ids: list[str]) -> None:
        """Runs deleted from the store leave /metrics too."""
        with self._lock:
            for run_id in run_ids:
                self.runs.pop(run_id, None)

    def count_request(self, status: int) -> None:
        with self._lock:
            self.stats.requests[status] += 1

    def count_rejected(self) -> None:
        with self._lock:
            self.stats.rejected_batches += 1


def load_live_state(store: Store) -> LiveState:
    """The live state of what `store` holds (at start-up, and in replay mode); raises
    StoreError naming a damaged file (and closes the store) if it cannot be read."""
    live = LiveState()
    try:
        live.load(store.query)  # /metrics is whole again after a restart
    except duckdb.Error as e:
        store.close()
        raise StoreError(damaged(store.path, e)) from e
    return live


def _follow_episode(
    active: dict, kind: str, rank: int | None, severity: str, start_step: int | None, step: int
) -> None:
    """Open or close the episode of (kind, rank) that an alert row starts or ends."""
    if kind not in EPISODE_KINDS:
        return
    if severity == RESOLVED:
        active.pop((kind, rank), None)
    else:
        active.setdefault((kind, rank), step if start_step is None else start_step)


def _latest_step_times(ranks: Any) -> tuple[int, np.ndarray, np.ndarray | None]:
    """(latest step of a ranks table, step_time_s and power_w of its rows at that step;
    power None when the table has no power column)."""
    step = ranks.column("step").to_numpy()
    latest = step == int(step.max())
    power = None
    if "power_w" in ranks.column_names:
        power = ranks.column("power_w").to_numpy(zero_copy_only=False).astype(np.float64)[latest]
    return int(step.max()), ranks.column("step_time_s").to_numpy()[latest], power


def _rank_summary(values: np.ndarray) -> dict[str, float]:
    """Median, p99 and max of per-rank values (step times in seconds, power in watts)."""
    times = np.sort(values)
    n, mid = len(times), len(times) // 2
    median = times[mid] if n % 2 else (times[mid - 1] + times[mid]) / 2  # as statistics.median
    p99 = times[min(n - 1, int(0.99 * n))]
    return {"median": float(median), "p99": float(p99), "max": float(times[-1])}
