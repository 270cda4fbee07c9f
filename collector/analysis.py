"""The analyzer in the collector: the live analysis follows the store's commits, and alerts
go to the store's alerts table and to /metrics.

`follow` makes the live driver (analyzer/live.py) a commit listener of the store; it and
the liveness watchdog (watchdog.py) hand their alerts to an `AlertLog`.
"""

from __future__ import annotations

import threading
from itertools import groupby
from typing import Any

import duckdb
import pyarrow as pa

from trainvitals.analyzer import Alert, Analyzer
from trainvitals.analyzer.live import LiveAnalysis
from trainvitals.schema import ALERTS, DTYPES

from .state import LiveState
from .store import Store


def follow(
    store: Store, analyzer: Analyzer, live: LiveState | None = None, **options: Any
) -> LiveAnalysis:
    """The live analysis of what `store` commits from now on (call before `store.start`),
    resuming after the runs it holds; its alerts are counted in `live` (/metrics) when
    given. `options` go to LiveAnalysis (delay_s, clock...)."""
    analysis = LiveAnalysis(analyzer, AlertLog(store, live), **options)
    analysis.start(store.query)
    store.listen(analysis)
    return analysis


class AlertLog:
    """Stores alerts (INSERT OR IGNORE on their key) and counts them in `live` (/metrics)
    when given. Callable from any thread: each thread gets a cursor of its own."""

    def __init__(self, store: Store, live: LiveState | None = None) -> None:
        self.store = store
        self.live = live
        self._local = threading.local()

    def __call__(self, alerts: list[Alert]) -> None:
        if not alerts:
            return
        cur = getattr(self._local, "cur", None)
        if cur is None:
            cur = self._local.cur = self.store.cursor()
        insert_alerts(cur, alerts)
        if self.live is None:
            return
        for run_id, raised in groupby(alerts, key=lambda a: a.run_id):
            self.live.count_alerts(run_id, list(raised))


def insert_alerts(cur: duckdb.DuckDBPyConnection, alerts: list[Alert]) -> None:
    table = alerts_table(alerts)
    cols = ", ".join(table.column_names)
    cur.register("new_alerts", table)
    try:  # one statement: DuckDB commits it whole or not at all
        cur.execute(f"INSERT OR IGNORE INTO alerts ({cols}) SELECT {cols} FROM new_alerts")
    finally:
        cur.unregister("new_alerts")


def alerts_table(alerts: list[Alert]) -> pa.Table:
    names = ["run_id", *(f.name for f in ALERTS.fields)]
    rows = [a.to_dict() for a in alerts]
    return pa.Table.from_pylist(rows, schema=_ALERT_SCHEMA).select(names)


_ALERT_SCHEMA = pa.schema(
    [("run_id", pa.string())]
    + [(f.name, pa.type_for_alias(DTYPES[f.dtype][1])) for f in ALERTS.fields]
)
