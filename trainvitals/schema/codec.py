"""The schema's wire forms: a batch as columnar JSON or msgpack, encoded and decoded.

Telemetry travels as a versioned *batch*: one JSON object holding, per table, a struct of
arrays (one list per column) rather than one object per point. Columnar batches are what
make ingest fast: the collector turns each column into an Arrow array in one call and
appends whole tables to DuckDB.

    {"schema_version": 1, "run_id": "r1",
     "steps":  {"step": [10, 11], "loss": [2.31, 2.29], ...},
     "layers": {"step": [10, 10], "layer": [0, 1], "grad_norm": [...], ...}}

An int64 field takes whole numbers only: 10.0 is stored as 10, and 1.5 refuses the batch.
JSON has no literal for NaN and inf: they travel as the strings "NaN", "Infinity" and
"-Infinity" (`NONFINITE_TO_WIRE`), and the collector's query API answers with them too.

The msgpack form of a batch is the same document, except that a numeric column may also
travel as one binary value instead of a list: a msgpack `bin` holding the column's values
as little-endian int64 or float64 (the field's dtype), 8 bytes per row. A column with nulls
is a map {"data": bin, "valid": bin}, `valid` being a bitmap of ceil(rows / 8) bytes, bit i
(least significant first, as in Arrow) set when row i has a value. The collector wraps
those bytes in Arrow arrays without copying or creating a Python object per value, which
is what lets one collector ingest millions of values a second (docs/scaling.md);
`encode_msgpack` writes that form from numpy or pyarrow columns.

Whether a decoded batch is valid is validation.py's question; `column_to_arrow` here only
turns one wire column into an Arrow array of its field's type, or refuses it by name.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import orjson

from .declarations import DTYPES, SCHEMA_VERSION, TABLES, Field, SchemaError, Table

# Non-finite floats are legal values of some fields (a NaN loss is exactly what the
# analyzer must see), but JSON has no literal for them: they travel as these strings.
NONFINITE_TO_WIRE = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}
WIRE_TO_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}

# Binary columns: little-endian values of the field's dtype (numpy's names for them).
_BINARY_DTYPES = {"int64": "<i8", "float64": "<f8"}


# ---------------------------------------------------------------------------- producer side


def float_to_wire(value: Any) -> Any:
    """A non-finite float (numpy's too) as its wire string ("NaN", "Infinity",
    "-Infinity"); any other value as it is."""
    if isinstance(value, float) and not math.isfinite(value):
        return NONFINITE_TO_WIRE[repr(float(value))]
    return value


def float_from_wire(value: Any) -> Any:
    """The inverse of `float_to_wire`: a wire string as its float; any other value as it is."""
    if isinstance(value, str):
        return WIRE_TO_NONFINITE.get(value, value)
    return value


class BatchBuilder:
    """Producer side: accumulate rows per table, encode one columnar batch.

    >>> b = BatchBuilder("run-1")
    >>> b.append("ranks", step=0, rank=0, step_time_s=0.5, tokens_per_s=100.0, loss=2.0)
    >>> b.to_json()[:40]
    b'{"schema_version":1,"run_id":"run-1","ra'
    """

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self._columns: dict[str, dict[str, list[Any]]] = {}

    def append(self, table: str, **values: Any) -> None:
        spec = TABLES[table]
        unknown = set(values) - set(spec.by_name)
        if unknown:
            raise SchemaError(f"{table}: unknown fields {sorted(unknown)}")
        cols = self._columns.setdefault(table, {f.name: [] for f in spec.fields})
        for f in spec.fields:
            cols[f.name].append(float_to_wire(values.get(f.name)))

    def __len__(self) -> int:
        return sum(len(next(iter(c.values()))) for c in self._columns.values())

    def to_dict(self) -> dict[str, Any]:
        return {"schema_version": SCHEMA_VERSION, "run_id": self.run_id, **self._columns}

    def to_json(self) -> bytes:
        return orjson.dumps(self.to_dict())

    def to_msgpack(self) -> bytes:
        import msgpack

        return msgpack.packb(self.to_dict())


def encode_json(doc: dict[str, Any]) -> bytes:
    """A batch document (array columns too) -> JSON, non-finite floats as the wire strings."""
    out: dict[str, Any] = {}
    for key, value in doc.items():
        if key in TABLES and isinstance(value, dict):
            value = {name: _json_column(col) for name, col in value.items()}
        out[key] = value
    return orjson.dumps(out)


def _json_column(column: Any) -> list:
    if not isinstance(column, list):
        column = column.tolist() if hasattr(column, "tolist") else column.to_pylist()
    if any(isinstance(v, float) and not math.isfinite(v) for v in column):
        column = [float_to_wire(v) for v in column]
    return column


def encode_msgpack(doc: dict[str, Any]) -> bytes:
    """A batch document -> msgpack, numeric array columns as binary columns.

    numpy and pyarrow columns of numeric fields travel as `bin` (nulls in a {data, valid}
    map); lists travel as msgpack arrays, as `BatchBuilder.to_msgpack` sends them. A
    16,384-row float64 column is one 128 KiB memcpy on either side instead of 16,384
    msgpack floats and Python objects.
    """
    import msgpack

    out: dict[str, Any] = {}
    for key, value in doc.items():
        spec = TABLES.get(key)
        if spec is None or not isinstance(value, dict):
            out[key] = value
            continue
        out[key] = {name: _binary_column(spec, name, col) for name, col in value.items()}
    return msgpack.packb(out)


def _binary_column(spec: Table, name: str, column: Any) -> Any:
    f = spec.by_name.get(name)
    if f is None:
        raise SchemaError(f"{spec.name}: unknown field {name!r}")
    if isinstance(column, list):
        return column
    if f.dtype not in _BINARY_DTYPES:  # strings travel as lists
        return column.tolist() if hasattr(column, "tolist") else column.to_pylist()
    import numpy as np
    import pyarrow as pa

    if isinstance(column, np.ndarray):
        if column.dtype.kind == "b":
            raise SchemaError(f"{spec.name}.{name}: expected {f.dtype}, got a boolean")
        return np.ascontiguousarray(column, dtype=_BINARY_DTYPES[f.dtype]).data  # a memoryview
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if isinstance(column, pa.Array):
        data = np.ascontiguousarray(
            column.fill_null(0).to_numpy(zero_copy_only=False), dtype=_BINARY_DTYPES[f.dtype]
        )
        if not column.null_count:
            return data.data
        valid = column.is_valid().to_numpy(zero_copy_only=False)
        return {"data": data.data, "valid": np.packbits(valid, bitorder="little").tobytes()}
    raise SchemaError(f"{spec.name}.{name}: cannot encode a {type(column).__name__} column")


# ---------------------------------------------------------------------------- consumer side


def decode_json(body: bytes) -> dict[str, Any]:
    """Parse a JSON batch body. Raises SchemaError with a message a sender can act on."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise SchemaError(f"body is not valid JSON: {e}") from e
    return doc


def decode_msgpack(body: bytes) -> dict[str, Any]:
    """Parse a msgpack batch body: the JSON document, where numeric columns may also be binary.

    NaN and inf are native floats; a `bin` column stays bytes until `to_arrow` wraps it.
    """
    import msgpack

    try:
        return msgpack.unpackb(body, raw=False)
    except (msgpack.UnpackException, ValueError, TypeError) as e:
        raise SchemaError(f"body is not valid msgpack: {str(e) or type(e).__name__}") from e


def column_to_arrow(where: str, f: Field, values: Any, pa: Any) -> Any:
    """One wire column -> a pyarrow array of the field's type, or SchemaError naming it."""
    if isinstance(values, list):
        return _list_to_arrow(where, f, values, pa)
    if isinstance(values, bytes | bytearray | memoryview):
        return _binary_to_arrow(where, f, values, None, pa)
    if isinstance(values, dict):
        if set(values) != {"data", "valid"}:
            raise SchemaError(f"{where}: a binary column with nulls is {{data, valid}}")
        return _binary_to_arrow(where, f, values["data"], values["valid"], pa)
    import numpy as np

    if isinstance(values, np.ndarray):
        return _numpy_to_arrow(where, f, values, pa)
    if isinstance(values, pa.Array | pa.ChunkedArray):
        return _cast(where, f, values, pa)
    raise SchemaError(f"{where}: must be a list (or a binary column), got {type(values).__name__}")


def _list_to_arrow(where: str, f: Field, values: list, pa: Any) -> Any:
    types = set(map(type, values))  # one pass in C, instead of isinstance per value
    if f.dtype in ("int64", "float64") and bool in types:
        raise SchemaError(f"{where}: expected {f.dtype}, got a boolean")
    if f.dtype == "int64" and float in types:
        # pyarrow would truncate 1.5 to 1 without a word; whole numbers (10.0) convert exactly.
        bad = next((v for v in values if isinstance(v, float) and not v.is_integer()), None)
        if bad is not None:
            raise SchemaError(f"{where}: expected whole numbers (int64), got {bad!r}")
    if f.dtype == "float64" and not f.finite and str in types:
        values = [WIRE_TO_NONFINITE.get(v, v) if isinstance(v, str) else v for v in values]
    try:
        return pa.array(values, type=DTYPES[f.dtype][1])
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError) as e:
        raise SchemaError(f"{where}: expected {f.dtype} values ({e})") from e


def _binary_to_arrow(where: str, f: Field, data: Any, valid: Any, pa: Any) -> Any:
    """Wrap a binary column's bytes in an Arrow array without copying them."""
    if f.dtype not in _BINARY_DTYPES:
        raise SchemaError(f"{where}: a {f.dtype} column must be a list, not binary")
    if not isinstance(data, bytes | bytearray | memoryview):
        raise SchemaError(f"{where}: binary column data must be bytes")
    size = memoryview(data).nbytes
    if size % 8:
        raise SchemaError(f"{where}: {size} bytes is not a whole number of 8-byte {f.dtype} values")
    n = size // 8
    bitmap = None
    if valid is not None:
        if not isinstance(valid, bytes | bytearray | memoryview):
            raise SchemaError(f"{where}: binary column valid bitmap must be bytes")
        if memoryview(valid).nbytes != (n + 7) // 8:
            raise SchemaError(
                f"{where}: valid bitmap of {memoryview(valid).nbytes} bytes for {n} values; "
                f"expected {(n + 7) // 8}"
            )
        bitmap = pa.py_buffer(valid)
    if sys.byteorder != "little":  # Arrow buffers are native-endian
        import numpy as np

        data = np.frombuffer(data, _BINARY_DTYPES[f.dtype]).astype(f.dtype).tobytes()
    arrow_type = pa.type_for_alias(DTYPES[f.dtype][1])
    return pa.Array.from_buffers(arrow_type, n, [bitmap, pa.py_buffer(data)])


def _numpy_to_arrow(where: str, f: Field, values: Any, pa: Any) -> Any:
    if values.ndim != 1:
        raise SchemaError(f"{where}: must be one-dimensional, got shape {values.shape}")
    kind = values.dtype.kind
    if f.dtype in ("int64", "float64") and kind == "b":
        raise SchemaError(f"{where}: expected {f.dtype}, got a boolean")
    numeric_ok = {"int64": "iu", "float64": "iuf"}.get(f.dtype, "")
    if kind == "O" or (f.dtype == "string" and kind in "UST"):
        return _list_to_arrow(where, f, values.tolist(), pa)
    if kind not in numeric_ok:
        raise SchemaError(f"{where}: expected {f.dtype} values, got numpy {values.dtype}")
    return pa.array(values.astype(f.dtype, copy=False))


def _cast(where: str, f: Field, values: Any, pa: Any) -> Any:
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    target = pa.type_for_alias(DTYPES[f.dtype][1])
    if values.type == target:
        return values
    if pa.types.is_boolean(values.type):
        raise SchemaError(f"{where}: expected {f.dtype}, got a boolean")
    accepted = pa.types.is_integer(values.type) or (
        f.dtype == "float64" and pa.types.is_floating(values.type)
    )
    if not accepted:
        raise SchemaError(f"{where}: expected {f.dtype} values, got {values.type}")
    return values.cast(target)
