"""`trainvitals export`: a store's runs as hive-partitioned, zstd-compressed Parquet.

    OUT/steps/run_id=<id>/data_0.parquet, OUT/layers/run_id=<id>/..., one folder per table

Such an export can be moved and archived, served by `trainvitals collector --replay OUT`,
queried together with the exports of other collectors by any Parquet reader
(`SELECT ... FROM read_parquet('*/steps/*/*.parquet', hive_partitioning = true)` in DuckDB),
and loaded into a running collector again, through its ingest API, by `trainvitals import
OUT` (`read_export` below cuts it into batches).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import duckdb

from trainvitals.schema import SCHEMA_VERSION, STORE_TABLES, TABLES

from .store import Store, StoreError, is_export


def export_store(store_path: str, out_dir: str, run_id: str | None = None) -> dict[str, int]:
    """Write every table (or one run's rows) of a stopped store; returns rows per table.

    Raises ValueError if the run is unknown or a table's folder already exists: an export
    never mixes with or overwrites an earlier one.
    """
    store = Store(store_path, read_only=True)
    try:
        where, params = ("WHERE run_id = ?", [run_id]) if run_id else ("", [])
        if run_id and not store.query(f"SELECT 1 FROM steps {where} LIMIT 1", params).num_rows:
            raise ValueError(f"no run {run_id!r} in {store_path}")
        out = Path(out_dir)
        clashes = [t for t in STORE_TABLES if (out / t).exists()]
        if clashes:
            raise ValueError(
                f"{out} already holds an export ({', '.join(clashes)}); pick a new folder"
            )
        out.mkdir(parents=True, exist_ok=True)
        # Written aside first, then moved in: a failed export leaves nothing behind.
        partial = Path(tempfile.mkdtemp(prefix=".export-", dir=out))
        try:
            written = {}
            for name in STORE_TABLES:
                rows = store.query(f"SELECT * FROM {name} {where}", params)
                written[name] = rows.num_rows
                if rows.num_rows:
                    _write(rows, partial / name)
            for name in STORE_TABLES:
                if (partial / name).exists():
                    (partial / name).rename(out / name)
        finally:
            shutil.rmtree(partial, ignore_errors=True)
        return written
    finally:
        store.close()


def _write(rows, folder: Path) -> None:
    import pyarrow.dataset as ds

    ds.write_dataset(
        rows, folder, format="parquet", partitioning=["run_id"], partitioning_flavor="hive",
        file_options=ds.ParquetFileFormat().make_write_options(compression="zstd"),
    )  # fmt: skip


def read_export(path: Path, max_rows: int = 5000) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, batch document) for every run of an export, ready for ingest.

    Per run: the `runs` row first, then windows of whole steps in step order, each with
    the steps, layers, ranks and events rows of its steps and at most `max_rows` rows
    (unless one step alone holds more). That is the order and shape in which the hooks
    sent them, so a collector's analyzer sees the run as it happened. Alerts are not
    sent: the receiving collector's analyzer raises them again.

    Raises ValueError if `path` is not an export. Non-finite floats stay floats, so send
    the documents as msgpack (JSON has no NaN).
    """
    if max_rows < 1:
        raise ValueError(f"max_rows must be at least 1, got {max_rows}")
    if not is_export(path):
        raise ValueError(
            f"{path} is not a trainvitals export: no table folder ({', '.join(STORE_TABLES)})"
        )
    if not any(path.glob("*/run_id=*/*.parquet")):
        raise ValueError(f"{path} has table folders but no run_id=<id>/*.parquet files in them")
    try:
        store = Store(str(path), read_only=True)
    except StoreError as e:
        raise ValueError(f"cannot read the export {path}: {e}") from e
    try:
        yield from _export_batches(store, max_rows)
    except duckdb.Error as e:
        raise ValueError(f"cannot read the export {path}: {e}") from e
    finally:
        store.close()


def _export_batches(store: Store, max_rows: int) -> Iterator[tuple[str, dict[str, Any]]]:
    stepped = [t for t in TABLES if t != "runs"]
    ids = "SELECT run_id FROM runs UNION " + " UNION ".join(
        f"SELECT run_id FROM {t}" for t in stepped
    )
    for run_id in sorted(store.query(ids).column(0).to_pylist()):
        run = _rows(store, "runs", "WHERE run_id = ?", [run_id])
        if run:
            yield f"run {run_id!r} metadata", _document(run_id, {"runs": run})
        per_step = store.query(
            "SELECT step, count(*) AS n FROM ("
            + " UNION ALL ".join(f"SELECT step FROM {t} WHERE run_id = ?" for t in stepped)
            + ") GROUP BY step ORDER BY step",
            [run_id] * len(stepped),
        ).to_pydict()
        for first, last in _windows(per_step["step"], per_step["n"], max_rows):
            where = "WHERE run_id = ? AND step BETWEEN ? AND ?"
            tables = {t: _rows(store, t, where, [run_id, first, last]) for t in stepped}
            tables = {t: cols for t, cols in tables.items() if cols}
            yield f"run {run_id!r} steps {first}..{last}", _document(run_id, tables)


def _windows(steps: list[int], counts: list[int], max_rows: int) -> Iterator[tuple[int, int]]:
    """(first, last) step ranges of consecutive steps holding at most max_rows rows each."""
    first, rows = None, 0
    for i, (step, n) in enumerate(zip(steps, counts, strict=True)):
        if first is not None and rows + n > max_rows:
            yield first, steps[i - 1]
            first, rows = None, 0
        if first is None:
            first = step
        rows += n
    if first is not None:
        yield first, steps[-1]


def _rows(store: Store, table: str, where: str, params: list) -> dict[str, list] | None:
    """One table's rows as columns (without run_id), in key order; None if there are none."""
    key = ", ".join(k for k in TABLES[table].key)
    cols = store.query(f"SELECT * EXCLUDE (run_id) FROM {table} {where} ORDER BY {key}", params)
    return cols.to_pydict() if cols.num_rows else None


def _document(run_id: str, tables: dict[str, dict[str, list]]) -> dict[str, Any]:
    return {"schema_version": SCHEMA_VERSION, "run_id": run_id, **tables}
