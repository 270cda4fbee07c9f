"""The wire and storage schema shared by the hooks (producer) and the collector (consumer).

Telemetry travels as a versioned *batch*: one JSON object holding, per table, a struct of
arrays (one list per column) rather than one object per point. Columnar batches are what
make ingest fast: the collector turns each column into an Arrow array in one call and
appends whole tables to DuckDB.

    {"schema_version": 1, "run_id": "r1",
     "steps":  {"step": [10, 11], "loss": [2.31, 2.29], ...},
     "layers": {"step": [10, 10], "layer": [0, 1], "grad_norm": [...], ...}}

An int64 field takes whole numbers only: 10.0 is stored as 10, and 1.5 refuses the batch.

The msgpack form of a batch is the same document, except that a numeric column may also
travel as one binary value instead of a list: a msgpack `bin` holding the column's values
as little-endian int64 or float64 (the field's dtype), 8 bytes per row. A column with nulls
is a map {"data": bin, "valid": bin}, `valid` being a bitmap of ceil(rows / 8) bytes, bit i
(least significant first, as in Arrow) set when row i has a value. The collector wraps
those bytes in Arrow arrays without copying or creating a Python object per value, which
is what lets one collector ingest millions of values a second (docs/scaling.md);
`encode_msgpack` writes that form from numpy or pyarrow columns.

Every table and field is declared once, below. The DuckDB tables, the validation of
incoming batches and the producers' builders are all derived from these declarations, so
adding a field is a one-place change: append a `Field(...)` to its table. A field added
after version 1 must be optional (`required=False`) so that older producers stay valid;
stores created before it gain the column on their next open.

Names carry units: `_s` seconds, `_per_s` per second, `_ratio` a dimensionless fraction,
`_unix_s` seconds since the Unix epoch, `flops` floating-point operations.
"""

from __future__ import annotations

import math
import re
import sys
from dataclasses import dataclass, field
from typing import Any

import orjson

SCHEMA_VERSION = 1

# Non-finite floats are legal values of some fields (a NaN loss is exactly what the
# analyzer must see), but JSON has no literal for them: they travel as these strings.
_NONFINITE_TO_WIRE = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}
_WIRE_TO_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}

# Schema dtype -> (DuckDB type, pyarrow type name). Kept to the few types telemetry needs.
DTYPES = {
    "int64": ("BIGINT", "int64"),
    "float64": ("DOUBLE", "float64"),
    "string": ("VARCHAR", "string"),
}


class SchemaError(ValueError):
    """A batch does not match the schema. The message names the table and field."""


# A run id names folders (exports, spools) and URL paths (the query API), so it keeps to
# characters that are safe in both.
RUN_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+=-]{0,127}")
RUN_ID_RULE = "1-128 characters: letters, digits and . _ : @ + = -, starting with a letter or digit"
# Steps count from 0. The top is the largest integer a float64 holds exactly, so that a
# step survives JSON readers, Prometheus and the dashboard's charts unchanged.
STEP_BOUNDS = (0, 2**53 - 1)
INDEX_BOUNDS = (0, 2**31 - 1)  # layer and rank indices
# Times, durations, counts, rates, power and energy: a negative one is a producer's bug, and
# would reach /metrics and the detectors as if it were a reading.
NONNEGATIVE = (0, math.inf)
# Longest string a field takes, in UTF-8 bytes, unless it says otherwise (Field.max_bytes).
# A name is a few dozen bytes; a 10 MB `runs.model` made every run list answer 10.5 MB.
# JSON fields hold a list per rank or layer: hosts_json of 100,000 ranks is about 3 MB.
MAX_STRING_BYTES = 4096
MAX_JSON_STRING_BYTES = 16 * 2**20


@dataclass(frozen=True)
class Field:
    """One column. `finite` forbids NaN/inf; `required` fields must be present and non-null."""

    name: str
    dtype: str
    doc: str
    required: bool = True
    finite: bool = True
    # Numbers: the least and greatest value allowed (a step is never negative). NaN, where
    # a field allows it, is not out of bounds.
    bounds: tuple[float, float] | None = None
    # string: the JSON type (list or dict) the string must hold, so readers can parse it.
    json: type | None = None
    # string: the only values allowed (a heartbeat's phase), or None for any.
    choices: tuple[str, ...] | None = None
    # string: the longest value, in UTF-8 bytes; None: MAX_STRING_BYTES, or
    # MAX_JSON_STRING_BYTES for a JSON field.
    max_bytes: int | None = None
    # steps: the collector keeps the latest logged step's value per run in memory, for
    # /metrics (collector/state.py).
    live: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"Field {self.name}: dtype must be one of {sorted(DTYPES)}")
        if self.dtype == "string" and self.max_bytes is None:
            limit = MAX_JSON_STRING_BYTES if self.json is not None else MAX_STRING_BYTES
            object.__setattr__(self, "max_bytes", limit)
        assert self.bounds is None or self.dtype in ("int64", "float64"), f"{self.name}: bounds"
        assert self.json is None or self.dtype == "string", f"{self.name}: json on strings"
        assert self.choices is None or self.dtype == "string", f"{self.name}: choices"


@dataclass(frozen=True)
class Table:
    """A telemetry table. `key` fields identify a record, so a resend is never a duplicate."""

    name: str
    key: tuple[str, ...]
    fields: tuple[Field, ...]
    doc: str = ""
    by_name: dict[str, Field] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "by_name", {f.name: f for f in self.fields})
        missing = [k for k in self.key if k != "run_id" and k not in self.by_name]
        assert not missing, f"table {self.name}: key fields {missing} are not declared"


RUNS = Table(
    "runs",
    key=("run_id",),
    doc="One row per run: what was trained, on what, laid out how.",
    fields=(
        Field("started_unix_s", "float64", "wall-clock start of the run", bounds=NONNEGATIVE),
        Field("model", "string", "model name or preset, e.g. 'llama-tiny'"),
        Field(
            "model_config_json", "string", "the model's configuration as a JSON object", json=dict
        ),
        Field("n_params", "int64", "parameter count of the whole (unsharded) model"),
        Field("n_layers", "int64", "number of entries in layer_names_json", bounds=INDEX_BOUNDS),
        Field("layer_names_json", "string", "JSON list: name of layer index 0, 1, ...", json=list),
        Field("world_size", "int64", "number of ranks", bounds=(1, INDEX_BOUNDS[1])),
        Field("dp", "int64", "data-parallel degree (FSDP)", bounds=(1, INDEX_BOUNDS[1])),
        Field("tp", "int64", "tensor-parallel degree", bounds=(1, INDEX_BOUNDS[1])),
        Field("device_type", "string", "'cuda', 'cpu', ..."),
        Field("device_name", "string", "e.g. 'NVIDIA H100 80GB HBM3'"),
        Field("hosts_json", "string", "JSON list: host name of rank 0, 1, ...", json=list),
        Field(
            "flops_per_token",
            "float64",
            "training FLOPs per token (see hooks/flops.py)",
            bounds=NONNEGATIVE,
        ),
        Field(
            "peak_flops_per_s", "float64", "peak FLOP/s of one device; NaN if unknown", finite=False
        ),
        Field("peak_flops_source", "string", "where peak_flops_per_s came from"),
        Field(
            "flops_source",
            "string",
            "where flops_per_token came from: 'configured', or how it was estimated",
            required=False,
        ),
        Field("power_source", "string", "'nvml', 'rapl' or '' (none)", required=False),
        Field(
            "power_unavailable",
            "string",
            "why power is not reported: sources tried",
            required=False,
        ),
        Field("token_target", "int64", "tokens the run is meant to train on", required=False),
    ),
)

STEPS = Table(
    "steps",
    key=("run_id", "step"),
    doc="One row per logged optimizer step: global quantities of the whole job.",
    fields=(
        Field("step", "int64", "optimizer step, counted from 0", bounds=STEP_BOUNDS, live=True),
        Field(
            "time_unix_s",
            "float64",
            "when the last rank reached the step's end",
            bounds=NONNEGATIVE,
            live=True,
        ),
        Field("loss", "float64", "token-weighted mean training loss", finite=False, live=True),
        Field(
            "grad_norm",
            "float64",
            "global L2 norm of all gradients, before clipping",
            finite=False,
            live=True,
        ),
        Field("lr", "float64", "learning rate used by the step", required=False),
        Field(
            "tokens", "int64", "tokens processed by the whole job in this step", bounds=NONNEGATIVE
        ),
        Field(
            "step_time_s",
            "float64",
            "wall time of the step on the slowest rank",
            bounds=NONNEGATIVE,
            live=True,
        ),
        Field("tokens_per_s", "float64", "tokens / step_time_s", bounds=NONNEGATIVE, live=True),
        Field(
            "tflops_per_s_per_device",
            "float64",
            "achieved model TFLOP/s of one device",
            bounds=NONNEGATIVE,
            live=True,
        ),
        Field(
            "mfu_ratio",
            "float64",
            "achieved / peak FLOP/s; NaN if peak unknown",
            finite=False,
            live=True,
        ),
        Field(
            "power_w",
            "float64",
            "power of all devices of the job, mean over the step",
            required=False,
            bounds=NONNEGATIVE,
            live=True,
        ),
        Field(
            "energy_j",
            "float64",
            "energy of all devices since the monitor started (a resumed run starts again from 0)",
            required=False,
            bounds=NONNEGATIVE,
            live=True,
        ),
        Field(
            "nonfinite_count",
            "int64",
            "non-finite values in this step's block outputs, plus gradient tensors holding one",
            required=False,
        ),
        Field(
            "nonfinite_steps",
            "int64",
            "steps since the previous logged step (this one included) whose loss or block "
            "outputs held a non-finite value",
            required=False,
        ),
        Field(
            "telemetry_dropped",
            "int64",
            "logged steps and batches the hooks dropped since the monitor started",
            required=False,
            live=True,
        ),
    ),
)

LAYERS = Table(
    "layers",
    key=("run_id", "step", "layer"),
    doc="One row per (logged step, layer): global per-layer statistics, reduced in-job.",
    fields=(
        Field("step", "int64", "optimizer step", bounds=STEP_BOUNDS),
        Field("layer", "int64", "index into the run's layer_names_json", bounds=INDEX_BOUNDS),
        Field("grad_norm", "float64", "L2 norm of the layer's gradients", finite=False),
        Field("act_rms", "float64", "RMS of the layer's output activations", finite=False),
        Field(
            "act_max_abs",
            "float64",
            "largest |activation| of the layer output over the steps since the previous "
            "logged step (this one included)",
            required=False,
            finite=False,
        ),
        Field(
            "param_norm",
            "float64",
            "L2 norm of the layer's parameters",
            required=False,
            finite=False,
        ),
        Field(
            "update_rms",
            "float64",
            "RMS of the change the previous optimizer step made to the layer",
            required=False,
            finite=False,
        ),
        Field(
            "nonfinite_count",
            "int64",
            "gradient tensors (parameters) of the layer holding a NaN or inf at this step",
            required=False,
        ),
        Field(
            "act_nonfinite_count",
            "int64",
            "non-finite values in the layer output at this step",
            required=False,
        ),
        Field(
            "act_nonfinite_steps",
            "int64",
            "steps since the previous logged step (this one included) whose layer output "
            "held a non-finite value",
            required=False,
        ),
    ),
)

RANKS = Table(
    "ranks",
    key=("run_id", "step", "rank"),
    doc="One row per (logged step, rank): what each rank saw locally.",
    fields=(
        Field("step", "int64", "optimizer step", bounds=STEP_BOUNDS),
        Field("rank", "int64", "global rank", bounds=INDEX_BOUNDS),
        Field(
            "step_time_s",
            "float64",
            "wall time between this rank's step boundaries",
            bounds=NONNEGATIVE,
        ),
        Field("tokens_per_s", "float64", "this rank's tokens / step_time_s", bounds=NONNEGATIVE),
        Field("loss", "float64", "this rank's local loss", finite=False),
        Field(
            "grad_norm_local",
            "float64",
            "L2 norm of this rank's own gradients before the data-parallel reduction",
            required=False,
            finite=False,
        ),
        Field(
            "compute_time_s",
            "float64",
            "forward + backward + optimizer time",
            required=False,
            bounds=NONNEGATIVE,
        ),
        Field(
            "data_time_s",
            "float64",
            "time from the previous step's end to this step's first forward",
            required=False,
            bounds=NONNEGATIVE,
        ),
        Field(
            "wait_time_s",
            "float64",
            "time waiting at the step's synchronisation point",
            required=False,
            bounds=NONNEGATIVE,
        ),
        Field(
            "power_w",
            "float64",
            "device power, mean over the step",
            required=False,
            bounds=NONNEGATIVE,
        ),
        Field(
            "energy_j",
            "float64",
            "device energy since the monitor started (a resumed run starts again from 0)",
            required=False,
            bounds=NONNEGATIVE,
        ),
        Field("sm_clock_mhz", "float64", "device SM clock", required=False),
        Field("temperature_c", "float64", "device temperature", required=False),
        Field(
            "canary_fingerprint",
            "int64",
            "52-bit hash of the canary computation's result",
            required=False,
        ),
        Field(
            "replica_fingerprint",
            "int64",
            "52-bit hash of the parameters this rank must hold identically to the other "
            "ranks of its replica_group",
            required=False,
        ),
        Field(
            "replica_group",
            "int64",
            "ranks with the same replica_group must report the same replica_fingerprint",
            required=False,
        ),
        *(
            Field(
                f"{kind}_{what}", dtype, f"{kind.replace('_', '-')} {doc}, per step", required=False
            )
            for kind in ("all_gather", "reduce_scatter", "all_reduce")
            for what, dtype, doc in (
                ("count", "float64", "collectives issued"),
                ("bytes", "float64", "bytes of their buffers (nccl-tests' algorithm bytes)"),
                ("time_s", "float64", "time the collectives took (where the backend reports it)"),
            )
        ),
        *(
            Field(
                f"{link}_{way}_bytes_per_s",
                "float64",
                f"{doc} {way} rate of this rank's node",
                required=False,
            )
            for link, doc in (
                ("net", "network interfaces (/proc/net/dev)"),
                ("ib", "InfiniBand ports (/sys/class/infiniband)"),
                ("nvlink", "NVLink of this rank's GPU (NVML)"),
            )
            for way in ("rx", "tx")
        ),
        Field(
            "throttle_reasons",
            "int64",
            "NVML clocks-event (throttle) reasons bitmask; 0 when not throttled",
            required=False,
        ),
        Field("memory_used_bytes", "float64", "device memory in use", required=False),
    ),
)

EVENTS = Table(
    "events",
    key=("run_id", "step", "rank", "kind"),
    doc="Things that happened to the run: injected faults (ground truth), restarts, checkpoints.",
    fields=(
        Field("step", "int64", "step at which it happened", bounds=STEP_BOUNDS),
        Field(
            "rank", "int64", "rank concerned; -1 for the whole job", bounds=(-1, INDEX_BOUNDS[1])
        ),
        Field("kind", "string", "'fault:<type>', 'restart', 'checkpoint'"),
        Field("detail", "string", "parameters as a JSON object", json=dict),
        Field("time_unix_s", "float64", "wall-clock time", bounds=NONNEGATIVE),
    ),
)

# Tables a producer may send.
TABLES: dict[str, Table] = {t.name: t for t in (RUNS, STEPS, LAYERS, RANKS, EVENTS)}

# Where a rank's training thread is, as its hooks saw it last (hooks/heartbeat.py). "idle":
# attached, no step begun yet; "ended": the monitor closed; "exited": the process is ending
# without close() (an exception), its last word.
PHASES = (
    "idle", "data_wait", "forward", "backward", "collective", "optimizer", "ended", "exited"
)  # fmt: skip
HEARTBEATS = Table(
    "heartbeats",
    key=("run_id", "rank", "time_unix_s"),
    doc="Each rank's liveness, sent every few seconds by its hooks whatever the steps do "
    "(POST /api/v1/heartbeats, not ingest): what the collector's watchdog judges.",
    fields=(
        Field("rank", "int64", "global rank", bounds=INDEX_BOUNDS),
        Field("time_unix_s", "float64", "when the rank sent it (its clock)", bounds=NONNEGATIVE),
        Field("host", "string", "host name of the rank"),
        Field(
            "step_started",
            "int64",
            "last step whose forward the rank began; -1 before the first",
            bounds=(-1, STEP_BOUNDS[1]),
        ),
        Field(
            "step_finished",
            "int64",
            "last step the rank finished (monitor.step); -1 before the first",
            bounds=(-1, STEP_BOUNDS[1]),
        ),
        Field("phase", "string", "where the training thread is: one of PHASES", choices=PHASES),
        Field(
            "received_unix_s",
            "float64",
            "when the collector received it (the collector's clock; set by the collector, "
            "never sent): the watchdog's time base, live and in replay",
            bounds=NONNEGATIVE,
        ),
    ),
)
# Set by the collector on receipt (the last field): a sender that sends it is refused.
HEARTBEAT_RECEIVED = "received_unix_s"
assert HEARTBEATS.fields[-1].name == HEARTBEAT_RECEIVED
# What a sender sends: the table less the receive time.
_HEARTBEATS_SENT = Table("heartbeats", HEARTBEATS.key, HEARTBEATS.fields[:-1], HEARTBEATS.doc)

ALERTS = Table(
    "alerts",
    key=("run_id", "kind", "step"),
    doc="Written by the analyzer, never ingested: one row per detected event.",
    fields=(
        Field("step", "int64", "step at which the event was detected"),
        Field("kind", "string", "detector name, e.g. 'loss_spike', 'nonfinite'"),
        Field(
            "severity",
            "string",
            "'warning' or 'critical'; 'resolved' on the row that ends an episode of its kind",
        ),
        Field("message", "string", "what happened, for a person on call"),
        Field("value", "float64", "the observed value", required=False, finite=False),
        Field("baseline", "float64", "what the detector expected", required=False, finite=False),
        Field("rank", "int64", "rank named as the culprit, if any", required=False),
        Field("layer", "int64", "layer named as the culprit, if any", required=False),
        Field("time_unix_s", "float64", "wall-clock time of the step, from the telemetry"),
        Field(
            "start_step",
            "int64",
            "first step of the episode (onset), when it began before the detection step",
            required=False,
        ),
    ),
)

# Every table of a store, in creation order.
STORE_TABLES: dict[str, Table] = {**TABLES, "alerts": ALERTS, "heartbeats": HEARTBEATS}


def _to_wire(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return _NONFINITE_TO_WIRE[repr(value)]
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
            cols[f.name].append(_to_wire(values.get(f.name)))

    def __len__(self) -> int:
        return sum(len(next(iter(c.values()))) for c in self._columns.values())

    def to_dict(self) -> dict[str, Any]:
        return {"schema_version": SCHEMA_VERSION, "run_id": self.run_id, **self._columns}

    def to_json(self) -> bytes:
        return orjson.dumps(self.to_dict())

    def to_msgpack(self) -> bytes:
        import msgpack

        return msgpack.packb(self.to_dict())


# ---------------------------------------------------------------------------- consumer side


def ddl(table: Table) -> str:
    """CREATE TABLE statement for DuckDB, derived from the declaration."""
    cols = ["run_id VARCHAR NOT NULL"]
    for f in table.fields:
        null = " NOT NULL" if f.required else ""
        cols.append(f"{f.name} {DTYPES[f.dtype][0]}{null}")
    cols.append(f"PRIMARY KEY ({', '.join(table.key)})")
    return f"CREATE TABLE IF NOT EXISTS {table.name} (\n  " + ",\n  ".join(cols) + "\n)"


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


def to_arrow(doc: Any) -> tuple[str, dict[str, Any]]:
    """Validate a decoded batch and convert it to one pyarrow.Table per table present.

    Either the whole batch is valid and every table converts, or SchemaError is raised
    and nothing is returned: a receiver that stores only what this returns stores nothing
    half-way. Returns (run_id, {table name: pyarrow.Table with a run_id column first}).

    A column may be a list (JSON, msgpack), a binary column (bytes, or {"data", "valid"}
    from msgpack, see the module docstring), or, in the same process, a numpy or pyarrow
    array (the fleet simulator's documents).
    """
    import pyarrow as pa

    if not isinstance(doc, dict):
        raise SchemaError("batch must be a JSON object")
    version = doc.get("schema_version")
    if type(version) is not int or version != SCHEMA_VERSION:  # True == 1 in Python
        raise SchemaError(
            f"schema_version {version!r} is not supported; this collector speaks {SCHEMA_VERSION}"
        )
    run_id = doc.get("run_id")
    check_run_id(run_id)
    unknown = set(doc) - {"schema_version", "run_id"} - set(TABLES)
    if unknown:
        raise SchemaError(f"unknown tables {_names(unknown)}; known: {sorted(TABLES)}")
    out = {}
    for name, spec in TABLES.items():
        if name in doc:
            out[name] = _table_to_arrow(spec, doc[name], run_id, pa)
    if not out:
        raise SchemaError(f"batch holds no table; expected one of {sorted(TABLES)}")
    return run_id, out


def runs_to_arrow(name: str, run_ids: list[str], columns: Any) -> Any:
    """One table's rows of several runs (row i is run `run_ids[i]`'s; each run's rows
    together), validated at once as `to_arrow` validates one run's: keys are unique within
    a run, a runs row is one per run. A pyarrow.Table with a run_id column first, as
    `to_arrow` gives. An OTLP request of 3,000 runs cost 1.3 s validated run by run (0.4 ms
    each); at once, what one run of as many rows costs."""
    import pyarrow as pa

    for run_id in dict.fromkeys(run_ids):
        check_run_id(run_id)
    return _table_to_arrow(TABLES[name], columns, pa.array(run_ids, pa.string()), pa)


def _table_to_arrow(spec: Table, columns: Any, run_id: Any, pa: Any) -> Any:
    """`run_id`: the batch's (a str), or each row's (a pyarrow string array)."""
    if not isinstance(columns, dict):
        raise SchemaError(f"{spec.name}: must be an object of column name -> list")
    unknown = set(columns) - set(spec.by_name)
    if unknown:
        raise SchemaError(f"{spec.name}: unknown fields {_names(unknown)}")
    # Every given column becomes an Arrow array first (naming the field if it cannot)...
    given = {
        f.name: _as_arrow(f"{spec.name}.{f.name}", f, columns[f.name], pa)
        for f in spec.fields
        if columns.get(f.name) is not None
    }
    lengths = {name: len(arr) for name, arr in given.items()}
    if len(set(lengths.values())) > 1:
        raise SchemaError(f"{spec.name}: columns have different lengths {lengths}")
    n_rows = next(iter(lengths.values()), 0)
    # ... then each is checked against its declaration, with vectorised kernels.
    by_run = not isinstance(run_id, str)
    if by_run and len(run_id) != n_rows:
        raise SchemaError(f"{spec.name}: {len(run_id)} run ids for {n_rows} rows")
    arrays = [run_id if by_run else pa.repeat(pa.scalar(run_id, pa.string()), n_rows)]
    for f in spec.fields:
        arrays.append(_checked(f"{spec.name}.{f.name}", f, given.get(f.name), n_rows, pa))
    names = ["run_id", *(f.name for f in spec.fields)]
    table = pa.Table.from_arrays(arrays, names=names)
    _check_unique_keys(spec, table, by_run)
    return table


def check_run_id(run_id: Any) -> None:
    """SchemaError unless `run_id` follows RUN_ID_RULE."""
    if not isinstance(run_id, str) or not RUN_ID_PATTERN.fullmatch(run_id):
        shown = run_id if not isinstance(run_id, str) or len(run_id) <= 40 else run_id[:40] + "..."
        raise SchemaError(f"run_id {shown!r} is not valid: use {RUN_ID_RULE}")


def _names(keys: set, shown: int = 20) -> list[str]:
    """Sorted names for a message, the first `shown` of them (a body of 100,000 unknown
    fields must not come back as a 1 MB message); msgpack keys may be bytes or numbers."""
    names = sorted(str(k)[:64] for k in keys)
    return names if len(names) <= shown else [*names[:shown], f"... {len(names) - shown} more"]


def _check_unique_keys(spec: Table, table: Any, by_run: bool = False) -> None:
    """SchemaError if two rows of one batch share a key: which one is right is unknowable,
    and the store would keep only the first. (A resend of stored rows is fine: that is a
    later batch.) `by_run`: the rows are of several runs, each run's together."""
    keys = [k for k in spec.key if k != "run_id"]
    if by_run:  # the run's index (in order of appearance) leads the key
        import pyarrow as pa

        runs = table.column("run_id").combine_chunks().dictionary_encode().indices
        table = table.append_column("_run", runs.cast(pa.int64()))
        keys = ["_run", *keys]
    elif not keys and table.num_rows > 1:  # one row per run (runs): the batch is one run's
        raise SchemaError(f"{spec.name}: {table.num_rows} rows for one run; send one")
    if table.num_rows < 2 or _strictly_ascending(table, keys):
        return  # the usual case, as producers send rows in key order
    counts = table.group_by(keys).aggregate([([], "count_all")])
    if counts.num_rows == table.num_rows:
        return
    import pyarrow.compute as pc

    dup = counts.filter(pc.greater(counts["count_all"], 1)).slice(0, 1).to_pylist()[0]
    n = dup.pop("count_all")
    if by_run:  # name the run, not its index
        first = pc.index(table.column("_run"), dup.pop("_run")).as_py()
        dup = {"run_id": table.column("run_id")[first].as_py(), **dup}
    where = ", ".join(f"{k}={v!r}" for k, v in dup.items())
    raise SchemaError(f"{spec.name}: {n} rows have the same key ({where}); send each once")


def _checked(where: str, f: Field, arr: Any, n_rows: int, pa: Any) -> Any:
    if arr is None:
        if f.required:
            raise SchemaError(f"{where}: required field is missing")
        return pa.nulls(n_rows, type=pa.type_for_alias(DTYPES[f.dtype][1]))
    if f.required and arr.null_count:
        raise SchemaError(f"{where}: required field has null values")
    if f.dtype == "float64" and f.finite and len(arr):
        import pyarrow.compute as pc

        values = arr.fill_null(0.0) if arr.null_count else arr
        if not pc.all(pc.is_finite(values)).as_py():
            raise SchemaError(f"{where}: values must be finite numbers")
    if f.bounds is not None and len(arr) > arr.null_count:
        _check_bounds(where, f.bounds, arr)
    if f.max_bytes is not None and len(arr) > arr.null_count:
        _check_length(where, f.max_bytes, arr)
    if f.json is not None:
        _check_json(where, f.json, arr)
    if f.choices is not None:
        _check_choices(where, f.choices, arr)
    return arr


def _check_choices(where: str, choices: tuple[str, ...], arr: Any) -> None:
    import pyarrow as pa
    import pyarrow.compute as pc

    known = pc.is_in(arr, value_set=pa.array(choices))
    if not pc.all(known).as_py():
        bad = arr.filter(pc.invert(known))[0].as_py()
        raise SchemaError(f"{where}: {bad!r} is not one of {list(choices)}")


def heartbeats_to_arrow(doc: Any, received_unix_s: float) -> tuple[str, Any]:
    """Validate a heartbeat batch ({"schema_version", "run_id", "heartbeats": columns}) and
    convert it to a pyarrow.Table stamped with the collector's receive time. As `to_arrow`:
    SchemaError naming the field, or the whole table."""
    import pyarrow as pa

    if not isinstance(doc, dict):
        raise SchemaError("batch must be a JSON object")
    version = doc.get("schema_version")
    if type(version) is not int or version != SCHEMA_VERSION:
        raise SchemaError(
            f"schema_version {version!r} is not supported; this collector speaks {SCHEMA_VERSION}"
        )
    run_id = doc.get("run_id")
    check_run_id(run_id)
    unknown = set(doc) - {"schema_version", "run_id", "heartbeats"}
    if unknown:
        raise SchemaError(f"unknown keys {_names(unknown)}; a heartbeat batch holds heartbeats")
    columns = doc.get("heartbeats")
    if not isinstance(columns, dict) or not columns:
        raise SchemaError("heartbeats: must be an object of column name -> list")
    if HEARTBEAT_RECEIVED in columns:
        raise SchemaError(
            f"heartbeats.{HEARTBEAT_RECEIVED}: set by the collector on receipt; do not send it"
        )
    table = _table_to_arrow(_HEARTBEATS_SENT, columns, run_id, pa)
    if table.num_rows == 0:
        raise SchemaError("heartbeats: the batch holds no heartbeat")
    received = pa.repeat(pa.scalar(float(received_unix_s)), table.num_rows)
    return run_id, table.append_column(HEARTBEAT_RECEIVED, received)


def _strictly_ascending(table: Any, keys: list[str]) -> bool:
    """True if the rows are in strictly ascending key order (so no key repeats): a few
    vectorised passes, where hashing every key costs about 1 ms per 8,000 rows."""
    import numpy as np

    if any(table.schema.field(k).type != "int64" for k in keys):
        return False
    ascending = None
    for k in reversed(keys):  # lexicographic: an earlier key decides unless it is equal
        d = np.diff(table.column(k).to_numpy())
        ascending = d > 0 if ascending is None else (d > 0) | ((d == 0) & ascending)
    return bool(ascending.all())


def _check_bounds(where: str, bounds: tuple[float, float], arr: Any) -> None:
    import pyarrow.compute as pc

    least, greatest = pc.min_max(arr).values()  # NaN is skipped
    if least.as_py() < bounds[0] or greatest.as_py() > bounds[1]:
        bad = least.as_py() if least.as_py() < bounds[0] else greatest.as_py()
        if bounds[1] == math.inf:
            raise SchemaError(f"{where}: {bad} is below {bounds[0]}; it cannot be negative")
        raise SchemaError(f"{where}: {bad} is outside {bounds[0]}..{bounds[1]}")


def _check_length(where: str, max_bytes: int, arr: Any) -> None:
    import pyarrow.compute as pc

    longest = pc.max(pc.binary_length(arr)).as_py()
    if longest > max_bytes:
        raise SchemaError(
            f"{where}: a value of {longest} bytes exceeds the limit of {max_bytes} bytes"
        )


def _check_json(where: str, kind: type, arr: Any) -> None:
    """Each string parses as JSON of `kind`: readers (the query API) parse it unchecked."""
    name = {list: "a JSON list", dict: "a JSON object"}[kind]
    for text in arr.to_pylist():  # rows of runs and events: a few per batch
        if text is None:
            continue
        try:
            value = orjson.loads(text)
        except orjson.JSONDecodeError:
            value = None
        if not isinstance(value, kind):
            shown = text if len(text) <= 40 else text[:40] + "..."
            raise SchemaError(f"{where}: {shown!r} is not {name}")


# Binary columns: little-endian values of the field's dtype (numpy's names for them).
_BINARY_DTYPES = {"int64": "<i8", "float64": "<f8"}


def _as_arrow(where: str, f: Field, values: Any, pa: Any) -> Any:
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
        values = [_WIRE_TO_NONFINITE.get(v, v) if isinstance(v, str) else v for v in values]
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


# ---------------------------------------------------------------------------- producer side


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
        return memoryview(np.ascontiguousarray(column, dtype=_BINARY_DTYPES[f.dtype]))
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if isinstance(column, pa.Array):
        data = np.ascontiguousarray(
            column.fill_null(0).to_numpy(zero_copy_only=False), dtype=_BINARY_DTYPES[f.dtype]
        )
        if not column.null_count:
            return memoryview(data)
        valid = column.is_valid().to_numpy(zero_copy_only=False)
        return {"data": memoryview(data), "valid": np.packbits(valid, bitorder="little").tobytes()}
    raise SchemaError(f"{spec.name}.{name}: cannot encode a {type(column).__name__} column")


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
        column = [_to_wire(v) for v in column]
    return column
