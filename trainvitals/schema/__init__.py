"""The wire and storage schema shared by the hooks (producer) and the collector (consumer).

One typed, versioned schema, in three parts:
- declarations.py: the tables and fields (dtype, unit, bounds, keys), the schema version,
  and the DuckDB DDL derived from them: what is on the wire and in the store;
- codec.py: the wire forms, columnar JSON and msgpack with binary numeric columns, NaN and
  inf as JSON strings, encoded by producers (`BatchBuilder`, `encode_msgpack`) and decoded
  by the collector;
- validation.py: the checks of an incoming batch against the declarations, refusals
  naming `table.field`, the whole batch or nothing.

Import from here (`from trainvitals.schema import TABLES, to_arrow`): the names below are
the schema's public interface, whichever part defines them.
"""

from __future__ import annotations

from .codec import (
    NONFINITE_TO_WIRE,
    WIRE_TO_NONFINITE,
    BatchBuilder,
    column_to_arrow,
    decode_json,
    decode_msgpack,
    encode_json,
    encode_msgpack,
    float_from_wire,
    float_to_wire,
)
from .declarations import (
    ALERTS,
    DTYPES,
    EVENTS,
    HEARTBEAT_RECEIVED,
    HEARTBEATS,
    HEARTBEATS_SENT,
    INDEX_BOUNDS,
    LAYERS,
    LOSS_SCALING,
    MAX_JSON_STRING_BYTES,
    MAX_STRING_BYTES,
    NONNEGATIVE,
    PAUSES,
    PHASES,
    RANKS,
    RUN_ID_PATTERN,
    RUN_ID_RULE,
    RUNS,
    SCHEMA_VERSION,
    STEP_BOUNDS,
    STEPS,
    STORE_TABLES,
    TABLES,
    Field,
    SchemaError,
    Table,
    ddl,
)
from .validation import check_run_id, heartbeats_to_arrow, runs_to_arrow, to_arrow

__all__ = [
    "ALERTS",
    "DTYPES",
    "EVENTS",
    "HEARTBEATS",
    "HEARTBEATS_SENT",
    "HEARTBEAT_RECEIVED",
    "INDEX_BOUNDS",
    "LAYERS",
    "LOSS_SCALING",
    "MAX_JSON_STRING_BYTES",
    "MAX_STRING_BYTES",
    "NONFINITE_TO_WIRE",
    "NONNEGATIVE",
    "PAUSES",
    "PHASES",
    "RANKS",
    "RUNS",
    "RUN_ID_PATTERN",
    "RUN_ID_RULE",
    "SCHEMA_VERSION",
    "STEPS",
    "STEP_BOUNDS",
    "STORE_TABLES",
    "TABLES",
    "WIRE_TO_NONFINITE",
    "BatchBuilder",
    "Field",
    "SchemaError",
    "Table",
    "check_run_id",
    "column_to_arrow",
    "ddl",
    "decode_json",
    "decode_msgpack",
    "encode_json",
    "encode_msgpack",
    "float_from_wire",
    "float_to_wire",
    "heartbeats_to_arrow",
    "runs_to_arrow",
    "to_arrow",
]
