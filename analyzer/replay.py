"""`trainvitals replay STORE`: run the detectors over a stored run, in step order.

The second driver of the one analyzer (DESIGN invariant 3): the same detector objects the
collector runs live, fed the stored steps, layers and ranks of each run in chunks of steps.
Because the live driver also sees each run's steps in order (ingest keeps the hooks' order,
and resent steps are ignored), the alerts come out identical; `compare` checks that
against the alerts the collector stored.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import duckdb

from trainvitals.schema import LAYERS, RANKS, STEPS

from .alerts import Alert
from .engine import Analyzer

CHUNK_STEPS = 10_000  # steps per read: bounded memory on a run of any length


def _columns(table: Any) -> str:
    return ", ".join(["run_id", *(f.name for f in table.fields)])


def replay_store(con: duckdb.DuckDBPyConnection) -> Iterator[Alert]:
    """Every alert the detectors raise over every run of the store, run by run, in step order."""
    runs = con.execute("SELECT DISTINCT run_id FROM steps ORDER BY run_id").fetchall()
    for (run_id,) in runs:
        analyzer = Analyzer()
        (last,) = con.execute("SELECT max(step) FROM steps WHERE run_id = ?", [run_id]).fetchone()
        for start in range(0, last + 1, CHUNK_STEPS):
            window = [run_id, start, start + CHUNK_STEPS - 1]
            tables = {
                name: con.execute(
                    f"SELECT {_columns(spec)} FROM {name} "
                    "WHERE run_id = ? AND step BETWEEN ? AND ? ORDER BY step",
                    window,
                ).to_arrow_table()
                for name, spec in (("steps", STEPS), ("layers", LAYERS), ("ranks", RANKS))
            }
            yield from analyzer.observe(run_id, tables)


def stored_alerts(con: duckdb.DuckDBPyConnection) -> list[dict]:
    rows = con.execute("SELECT * FROM alerts ORDER BY run_id, step, kind").to_arrow_table()
    return rows.to_pylist()


def comparable(alert: dict) -> tuple:
    """What must agree between live and replayed alerts."""
    return (alert["run_id"], alert["step"], alert["kind"], alert["rank"], alert["layer"],
            alert["message"])  # fmt: skip
