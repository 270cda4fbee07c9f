"""`trainvitals export`: a store's runs as hive-partitioned, zstd-compressed Parquet.

    OUT/steps/run_id=<id>/data_0.parquet, OUT/layers/run_id=<id>/..., one folder per table

Such an export can be moved and archived, served by `trainvitals collector --replay OUT`,
and queried together with the exports of other collectors by any Parquet reader
(`SELECT ... FROM read_parquet('*/steps/*/*.parquet', hive_partitioning = true)` in DuckDB).
"""

from __future__ import annotations

from pathlib import Path

from trainvitals.schema import STORE_TABLES

from .store import Store


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
        written = {}
        for name in STORE_TABLES:
            rows = store.query(f"SELECT * FROM {name} {where}", params)
            written[name] = rows.num_rows
            if rows.num_rows:
                _write(rows, out / name)
        return written
    finally:
        store.close()


def _write(rows, folder: Path) -> None:
    import pyarrow.dataset as ds

    ds.write_dataset(
        rows, folder, format="parquet", partitioning=["run_id"], partitioning_flavor="hive",
        file_options=ds.ParquetFileFormat().make_write_options(compression="zstd"),
    )  # fmt: skip
