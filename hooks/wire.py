"""A batch built from numpy columns, sent in the schema's binary columnar msgpack form.

The monitor's export thread appends whole columns (a step's layers, a node's ranks) and
never a Python object per row; `to_msgpack` writes each numeric column as one `bin` of
little-endian values (trainvitals/schema/codec.py), a null as a cleared bit of its column's
validity bitmap. An all-null optional column is left out: the collector reads a missing
optional column as nulls.

    >>> import numpy as np
    >>> b = ColumnBatch("run-1")
    >>> b.add("ranks", {"step": (np.array([3, 3]), None), "rank": (np.array([0, 1]), None),
    ...                 "step_time_s": (np.array([0.5, 0.6]), None),
    ...                 "tokens_per_s": (np.array([8.0, 7.0]), None),
    ...                 "loss": (np.array([2.0, np.nan]), None),  # a NaN loss is a value
    ...                 "power_w": (np.array([300.0, 0.0]), np.array([True, False]))}, 2)
    >>> len(b), b.to_dict()["ranks"]["loss"], b.to_dict()["ranks"]["power_w"]
    (2, [2.0, 'NaN'], [300.0, None])

`to_dict` / `to_json` give the JSON wire form of the same rows (for files, OTLP and tests);
they build Python objects and are not the path of the per-node export.
"""

from __future__ import annotations

import gzip
import math
from typing import Any

import numpy as np

from trainvitals.schema import SCHEMA_VERSION, TABLES, SchemaError, encode_json, encode_msgpack

# A column: values, and where they are valid (None: all of them).
Column = tuple[np.ndarray, np.ndarray | None]


class ColumnBatch:
    """Rows of several tables as numpy columns; the interface of schema.BatchBuilder."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        # table -> chunks; a chunk is (rows, {field: Column}).
        self._chunks: dict[str, list[tuple[int, dict[str, Column]]]] = {}
        self._rows = 0

    def add(self, table: str, columns: dict[str, Column], n_rows: int) -> None:
        """Append `n_rows` rows: field -> (values, valid mask or None). Fields left out are
        null. The arrays are kept, not copied: the caller must not reuse them."""
        spec = TABLES[table]
        unknown = set(columns) - set(spec.by_name)
        if unknown:
            raise SchemaError(f"{table}: unknown fields {sorted(unknown)}")
        for name, (values, _valid) in columns.items():
            if len(values) != n_rows:
                raise SchemaError(f"{table}.{name}: {len(values)} values for {n_rows} rows")
        if n_rows:
            self._chunks.setdefault(table, []).append((n_rows, columns))
            self._rows += n_rows

    def append(self, table: str, **values: Any) -> None:
        """One row, as BatchBuilder.append (runs and events rows: one per batch or event)."""
        columns = {}
        for name, value in values.items():
            if value is None:
                continue
            dtype = _dtype(table, name)
            columns[name] = (np.array([value], dtype=dtype), None)
        self.add(table, columns, 1)

    def __len__(self) -> int:
        return self._rows

    def columns(self, table: str) -> dict[str, Column]:
        """The table's rows so far, one column per field that has a value in any row."""
        chunks = self._chunks.get(table, [])
        if len(chunks) == 1:
            return dict(chunks[0][1])
        out: dict[str, Column] = {}
        for f in TABLES[table].fields:
            if not any(f.name in c for _, c in chunks):
                continue
            values, valid = [], []
            for n, chunk in chunks:
                v, m = chunk.get(f.name, (None, None))
                if v is None:
                    values.append(np.zeros(n, dtype=_dtype(table, f.name)))
                    valid.append(np.zeros(n, dtype=bool))
                else:
                    values.append(v)
                    valid.append(np.ones(n, dtype=bool) if m is None else m)
            mask = np.concatenate(valid)
            out[f.name] = (np.concatenate(values), None if mask.all() else mask)
        return out

    def to_msgpack(self) -> bytes:
        """The binary columnar wire form (content type application/msgpack)."""
        import pyarrow as pa

        doc: dict[str, Any] = {"schema_version": SCHEMA_VERSION, "run_id": self.run_id}
        for table in self._chunks:
            cols = {}
            for name, (values, valid) in self.columns(table).items():
                if valid is not None and not valid.any():
                    continue  # all null: a missing optional column reads as nulls
                cols[name] = values if valid is None else pa.array(values, mask=~valid)
            doc[table] = cols
        return encode_msgpack(doc)

    def to_dict(self) -> dict[str, Any]:
        """The JSON wire form: lists, None for nulls, non-finite floats as strings."""
        doc: dict[str, Any] = {"schema_version": SCHEMA_VERSION, "run_id": self.run_id}
        for table in self._chunks:
            cols, have = {}, self.columns(table)
            n = sum(rows for rows, _ in self._chunks[table])
            for f in TABLES[table].fields:
                values, valid = have.get(f.name, (None, None))
                if values is None:
                    cols[f.name] = [None] * n
                    continue
                # values and valid are numpy arrays on the host, not device tensors.
                listed = [_wire(v) for v in values.tolist()]  # host numpy: no sync point
                if valid is not None:
                    oks = valid.tolist()  # host numpy: no sync point
                    listed = [v if ok else None for v, ok in zip(listed, oks, strict=True)]
                cols[f.name] = listed
            doc[table] = cols
        return doc

    def to_json(self) -> bytes:
        return encode_json(self.to_dict())


def _dtype(table: str, name: str) -> Any:
    spec = TABLES[table]
    f = spec.by_name.get(name)
    if f is None:
        raise SchemaError(f"{table}: unknown field {name!r}")
    return {"int64": np.int64, "float64": np.float64}.get(f.dtype, object)


def _wire(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}[repr(value)]
    return value


def gzipped(body: bytes) -> bytes:
    """`body` as one gzip member (Content-Encoding: gzip), at level 1: about 25 us for a
    node's 2.5 KB batch, and a fifth fewer bytes even on random values (bench/hooks_scale.py);
    the collector undoes it on its thread pool (collector/limits.py)."""
    return gzip.compress(body, compresslevel=1, mtime=0)
