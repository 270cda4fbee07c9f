"""What `trainvitals replay` accepts: a DuckDB store of the collector or an export folder.

Checked before the replay opens it read-only (store.py), so that anything else is refused
with one line rather than replayed as an empty store.
"""

from __future__ import annotations

from pathlib import Path

import duckdb

from trainvitals.schema import STORE_TABLES

from .store import damaged, is_export


def check_source(path: Path) -> bool:
    """ValueError unless `path` is a trainvitals DuckDB store or export folder; returns
    whether it can hold the collector's live alerts to compare with.

    A store written before the collector stored alerts has no alerts table: there is
    nothing to compare with. An export has no alerts folder when the run raised none
    (`trainvitals export` writes no empty folders), so an export always compares.
    """
    if path.is_dir():
        if not is_export(path):
            raise ValueError(
                f"{path} is not a trainvitals export: no table folder ({', '.join(STORE_TABLES)})"
            )
        return True
    if not path.is_file():
        raise ValueError(f"cannot open {path}: no such file or directory")
    columns = _stored_columns(path)
    if not {"run_id", "step"} <= columns.get("steps", set()):
        found = ", ".join(sorted(columns)) or "none"
        raise ValueError(
            f"{path} is not a trainvitals store: it has no steps table with run_id and step "
            f"columns (its tables: {found})"
        )
    return "alerts" in columns


def _stored_columns(path: Path) -> dict[str, set[str]]:
    """Table name -> column names of a DuckDB file, opened read-only for a moment."""
    try:
        con = duckdb.connect(str(path), read_only=True)
    except duckdb.Error as e:  # not a DuckDB file, or one another process writes to
        raise ValueError(f"cannot open {path} read-only: {damaged(str(path), e)}") from e
    try:
        rows = con.execute(
            "SELECT table_name, column_name FROM duckdb_columns() "
            "WHERE database_name = current_database() AND schema_name = 'main'"
        ).fetchall()
    finally:
        con.close()
    columns: dict[str, set[str]] = {}
    for table, column in rows:
        columns.setdefault(table, set()).add(column)
    return columns
