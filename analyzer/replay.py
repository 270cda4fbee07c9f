"""`trainvitals replay STORE`: run the detectors over a stored run, in step order.

The second driver of the one analyzer (DESIGN invariant 3): the same detector objects the
collector runs live, fed by a telemetry source (source.py), `StoredTelemetry`: the stored
runs row and the steps, layers and ranks of each run in windows of steps, as the live
driver (live.py) hands them over after their commit. Detectors judge each step on that
step's rows and on telemetry timestamps only, so the alerts come out identical; `compare`
checks that against the alerts the collector stored. `store_goodput` adds each run's
goodput (goodput.py).

`trainvitals replay` reads through the collector's read-only Store (collector/store.py),
as `collector --replay` does: a DuckDB store or a Parquet export folder, of this version
or an older one (columns and tables it lacks read as empty); collector/stored.py first
refuses anything else with one line, rather than replaying it as an empty store.

Cost: three range scans per window (DuckDB prunes row groups by step) and one numpy
conversion per column; detectors then work on per-step slices (bench/replay_speed.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import duckdb

from trainvitals.schema import EVENTS, HEARTBEATS, LAYERS, RANKS, RUNS, STEPS

from .alerts import Alert
from .config import AnalyzerConfig
from .engine import Analyzer
from .goodput import Goodput, stored_goodput
from .liveness import HANG, RANK_LOST, STOP_EVENT, STOPPED, LivenessSettings, Watchdog
from .source import Window, analyze

CHUNK_STEPS = 10_000  # steps per read: bounded memory on a run of any length


def _columns(table: Any) -> str:
    return ", ".join(["run_id", *(f.name for f in table.fields)])


def replay_store(
    con: duckdb.DuckDBPyConnection, config: AnalyzerConfig | None = None
) -> Iterator[Alert]:
    """Every alert the detectors raise over every run of the store, run by run, in step order,
    with the detector settings of `config` (the defaults when None): to reproduce the live
    alerts, the configuration the collector ran with."""
    runs = con.sql("SELECT DISTINCT run_id FROM steps ORDER BY run_id").fetchall()
    for (run_id,) in runs:
        yield from analyze(StoredTelemetry(con, run_id), Analyzer(config=config))
    yield from replay_liveness(con, (config or AnalyzerConfig()).liveness)


class StoredTelemetry:
    """The telemetry source (source.py) of one stored run: its windows of CHUNK_STEPS steps."""

    def __init__(self, con: duckdb.DuckDBPyConnection, run_id: str) -> None:
        self.con = con
        self.run_id = run_id

    def windows(self) -> Iterator[Window]:
        con, run_id = self.con, self.run_id
        meta = con.sql(
            f"SELECT {_columns(RUNS)} FROM runs WHERE run_id = $1", params=[run_id]
        ).to_arrow_table()
        events_done = -1  # events up to this step were handed over
        for start in _window_starts(con, run_id):
            end = start + CHUNK_STEPS - 1
            tables = {"runs": meta} if meta.num_rows else {}
            for name, spec in (("steps", STEPS), ("layers", LAYERS), ("ranks", RANKS)):
                tables[name] = con.sql(
                    f"SELECT {_columns(spec)} FROM {name} "
                    "WHERE run_id = $1 AND step BETWEEN $2 AND $3 ORDER BY step",
                    params=[run_id, start, end],
                ).to_arrow_table()
            # Events up to the window's end, those in a gap before it too: detectors look
            # back at them only (the live driver hands them over as they arrive).
            tables["events"] = con.sql(
                f"SELECT {_columns(EVENTS)} FROM events "
                "WHERE run_id = $1 AND step > $2 AND step <= $3 ORDER BY step",
                params=[run_id, events_done, end],
            ).to_arrow_table()
            events_done = end
            yield run_id, tables


def replay_liveness(
    con: duckdb.DuckDBPyConnection, settings: LivenessSettings | None = None
) -> Iterator[Alert]:
    """rank_lost and hang from the stored heartbeats: the collector's watchdog, driven by a
    simulated clock over their receive times (alert times are deadlines, so this is what
    the live ticks raised). The clock stops where the collector is known to have been
    running: its last stored heartbeat or liveness alert, whichever is later; a deadline
    after that was never reached live either. A run ends at its first `run_end` event and
    at each `action:stop` (the supervisor's), as live. A store older than heartbeats has
    none."""
    have = con.sql(
        "SELECT table_name FROM duckdb_tables() UNION ALL SELECT view_name FROM duckdb_views()"
    ).fetchall()
    if ("heartbeats",) not in have:
        return
    ((end_s,),) = con.sql(
        "SELECT greatest((SELECT max(received_unix_s) FROM heartbeats), (SELECT max("
        f"time_unix_s) FROM alerts WHERE kind IN ('{RANK_LOST}', '{HANG}')))"
    ).fetchall()
    runs = con.sql("SELECT DISTINCT run_id FROM heartbeats ORDER BY run_id").fetchall()
    for (run_id,) in runs:
        watchdog = Watchdog(settings or LivenessSettings())
        watchdog.observe(
            run_id,
            con.sql(
                f"SELECT {_columns(HEARTBEATS)} FROM heartbeats WHERE run_id = $1 "
                "ORDER BY received_unix_s, rank",
                params=[run_id],
            ).to_arrow_table(),
        )
        ((ended_s,),) = con.sql(
            "SELECT min(time_unix_s) FROM events WHERE run_id = $1 AND kind = 'run_end'",
            params=[run_id],
        ).fetchall()
        if ended_s is not None:
            watchdog.end_run(run_id, ended_s)
        stops = con.sql(
            f"SELECT time_unix_s FROM events WHERE run_id = $1 AND kind = '{STOP_EVENT}'",
            params=[run_id],
        ).fetchall()
        for (stopped_s,) in stops:
            watchdog.end_run(run_id, stopped_s, STOPPED)
        yield from watchdog.advance(end_s)


def store_goodput(con: duckdb.DuckDBPyConnection) -> list[Goodput]:
    """Goodput of every run of the store."""
    out = []
    runs = con.sql("SELECT DISTINCT run_id FROM steps ORDER BY run_id").fetchall()
    for (run_id,) in runs:
        out.append(stored_goodput(run_id, lambda sql, p: con.sql(sql, params=p).to_arrow_table()))
    return out


def stored_alerts(con: duckdb.DuckDBPyConnection) -> list[dict[str, Any]]:
    rows = con.sql("SELECT * FROM alerts ORDER BY run_id, step, kind").to_arrow_table()
    alerts: list[dict[str, Any]] = rows.to_pylist()
    return alerts


def comparable(alert: dict[str, Any]) -> tuple[Any, ...]:
    """What must agree between live and replayed alerts."""
    return (
        alert["run_id"],
        alert["step"],
        alert["kind"],
        alert["rank"],
        alert["layer"],
        alert["message"],
    )


def _window_starts(con: duckdb.DuckDBPyConnection, run_id: str) -> Iterator[int]:
    """First step of each CHUNK_STEPS-step window that holds a step: gaps between steps
    (a run resumed at step 10**9, say) cost one query, not one window per CHUNK_STEPS."""
    start = 0
    while True:
        ((start,),) = con.sql(
            "SELECT min(step) FROM steps WHERE run_id = $1 AND step >= $2", params=[run_id, start]
        ).fetchall()
        if start is None:
            return
        yield start
        start += CHUNK_STEPS
