"""The schema's declarations: every telemetry table and field, declared once.

What a reader needs to know what is on the wire and in the store: the tables, their
fields (dtype, unit, bounds, whether required or finite), their keys, and the schema
version. The DuckDB tables (`ddl`), the validation of incoming batches (validation.py) and
the producers' builders and wire forms (codec.py) are all derived from these declarations,
so adding a field is a one-place change: append a `Field(...)` to its table. A field added
after version 1 must be optional (`required=False`) so that older producers stay valid;
stores created before it gain the column on their next open.

Names carry units: `_s` seconds, `_per_s` per second, `_ratio` a dimensionless fraction,
`_unix_s` seconds since the Unix epoch, `flops` floating-point operations.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

SCHEMA_VERSION = 1
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


# How the run scales its loss (MonitorConfig.loss_scaling).
LOSS_SCALING = ("none", "dynamic")

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
        Field(
            "loss_scaling",
            "string",
            "'dynamic' (a GradScaler: gradient overflows are skipped steps) or 'none'",
            required=False,
            choices=LOSS_SCALING,
        ),
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
            "forward + backward + optimizer time, mean over the steps since the last logged one",
            required=False,
            bounds=NONNEGATIVE,
        ),
        Field(
            "data_time_s",
            "float64",
            "time from the previous step's end to the step's first forward, mean over the "
            "steps since the last logged one",
            required=False,
            bounds=NONNEGATIVE,
        ),
        Field(
            "stopped_time_s",
            "float64",
            "CPU ranks: time the process was stopped (neither running nor waiting for a "
            "CPU: SIGSTOP, a freezer), mean over the steps since the last logged one",
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

# Pauses between steps that the training loop declares (`with monitor.pause("checkpoint")`):
# the liveness watchdog gives them `liveness.pause_s`, not a step's hang threshold.
PAUSES = ("checkpoint", "eval")
# Where a rank's training thread is, as its hooks saw it last (hooks/heartbeat.py). "idle":
# attached, no step begun yet; "ended": the monitor closed; "exited": the process is ending
# without close() (an exception), its last word; PAUSES: a declared pause between steps.
PHASES = (
    "idle", "data_wait", "forward", "backward", "collective", "optimizer", *PAUSES, "ended",
    "exited",
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
HEARTBEATS_SENT = Table("heartbeats", HEARTBEATS.key, HEARTBEATS.fields[:-1], HEARTBEATS.doc)

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


def ddl(table: Table) -> str:
    """CREATE TABLE statement for DuckDB, derived from the declaration."""
    cols = ["run_id VARCHAR NOT NULL"]
    for f in table.fields:
        null = " NOT NULL" if f.required else ""
        cols.append(f"{f.name} {DTYPES[f.dtype][0]}{null}")
    cols.append(f"PRIMARY KEY ({', '.join(table.key)})")
    return f"CREATE TABLE IF NOT EXISTS {table.name} (\n  " + ",\n  ".join(cols) + "\n)"
