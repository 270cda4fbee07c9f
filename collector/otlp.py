"""POST /v1/metrics: OTLP/HTTP metrics, protobuf or JSON, optionally gzip.

Any OpenTelemetry SDK or Collector can send telemetry here. Metrics named
`trainvitals.<table>.<field>` (the mapping in trainvitals/otlp.py, described in
docs/otlp.md) are pivoted back into rows, one per (table, key). The rows then pass the
same schema validation as a native batch (`to_arrow`) and the same queue and writer,
analyzer included. The answer comes once they are committed. Auth and size limits are
those of /api/v1/ingest.

- 400, and nothing of the request is stored: a body that is not OTLP, or a point that
  cannot be placed. That is a `trainvitals.*` name with an unknown table or field, a
  missing or mistyped key attribute, a histogram, or a value the schema refuses.
- 200 with OTLP `partial_success`, everything else stored: points of metrics outside the
  `trainvitals.` namespace, and rows lacking a required field. An SDK's periodic reader
  may collect while a step's fields are still being recorded; rows are stored whole or
  not at all, and its next (cumulative) export brings the row complete.

Error bodies are google.rpc.Status messages, encoded like the request, as OTLP asks.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import groupby
from typing import Annotated, Any

import orjson
import pyarrow as pa
import pyarrow.compute as pc
from fastapi import APIRouter, Depends, Header, HTTPException, Request, Response
from fastapi.concurrency import run_in_threadpool
from google.protobuf import json_format
from google.protobuf.message import DecodeError, Message
from google.rpc.status_pb2 import Status
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)

from trainvitals.otlp import attribute_fields, is_ours, parse_metric_name
from trainvitals.schema import (
    SCHEMA_VERSION,
    TABLES,
    Field,
    SchemaError,
    Table,
    runs_to_arrow,
    to_arrow,
)

from .decoding import Decoder, DecoderLost
from .deps import get_decoder, get_settings, get_store
from .ingest import COMMIT_TIMEOUT_S, check_token, read_body
from .settings import Settings
from .store import GROUP_MAX_BATCHES, Store, StoreError, Unavailable

router = APIRouter(tags=["otlp"])

PROTOBUF = "application/x-protobuf"
JSON = "application/json"
_NO_RECORDED_VALUE = 1  # DataPointFlags.DATA_POINT_FLAGS_NO_RECORDED_VALUE_MASK
_EXAMPLES = 5  # examples quoted per reason in partial_success.error_message
_MAX_MESSAGE = 1000  # characters of an error message sent back
# HTTP status -> google.rpc.Code, for Status.code (OTLP clients may log it, never act on it).
_RPC_CODES = {400: 3, 401: 16, 409: 9, 413: 8, 415: 3, 503: 14}
# Batches (one per run) one request has in the write queue at once, at most; a quarter of
# the queue where that is less, so that other senders keep room. A wave is what one group
# commit takes (store.py): 3,000 runs in waves of 64 took 48 commits, in waves of 256, 12.
WAVE_MAX_BATCHES = GROUP_MAX_BATCHES


class OtlpError(ValueError):
    """The request cannot be stored; the message names the metric, attribute or field."""


@dataclass
class Rejections:
    """Data points not stored although the request was: counted, and explained by example.

    At most _EXAMPLES examples are kept per reason: a request may reject a million rows,
    and searching a list of every one of them made each rejection cost O(rows so far).
    """

    points: int = 0
    # reason -> (points, the first few distinct examples, whether there were others)
    by_reason: dict[str, tuple[int, list[str], bool]] = field(default_factory=dict)

    def add(self, reason: str, example: str, points: int = 1) -> None:
        self.points += points
        count, examples, more = self.by_reason.get(reason, (0, [], False))
        if example not in examples:  # a list of _EXAMPLES at most
            if len(examples) < _EXAMPLES:
                examples.append(example)
            else:
                more = True
        self.by_reason[reason] = (count + points, examples, more)

    def message(self) -> str:
        """E.g. "3 data points not stored: 3 of metrics not named trainvitals.<table>.<field>
        ('process.cpu.time', 'up')"."""
        parts = []
        for reason, (count, examples, more) in self.by_reason.items():
            others = ", and others" if more else ""
            parts.append(f"{count} {reason} ({'; '.join(examples)}{others})")
        return f"{self.points} data points not stored: " + "; ".join(parts)


@dataclass
class _Row:
    values: dict[str, Any]
    points: int = 0


# ---------------------------------------------------------------------------- decoding


def decode_request(body: bytes, as_json: bool) -> ExportMetricsServiceRequest:
    """Parse an OTLP ExportMetricsServiceRequest; OtlpError says why a body is not one."""
    request = ExportMetricsServiceRequest()
    if not as_json:
        try:
            request.ParseFromString(body)
        except DecodeError as e:
            raise OtlpError(f"body is not an OTLP protobuf ExportMetricsServiceRequest: {e}") from e
        if body and not request.ListFields():
            # Protobuf skips unknown fields; a body made of nothing else is not OTLP.
            raise OtlpError("body holds no field of an OTLP ExportMetricsServiceRequest")
        return request
    try:
        doc = orjson.loads(body) if body else {}
    except orjson.JSONDecodeError as e:
        raise OtlpError(f"body is not valid JSON: {e}") from e
    if not isinstance(doc, dict):
        raise OtlpError("body must be a JSON object (an OTLP ExportMetricsServiceRequest)")
    if doc and not {"resourceMetrics", "resource_metrics"} & set(doc):
        raise OtlpError(f"body has no resourceMetrics (keys: {sorted(doc)[:5]})")
    # OTLP/JSON writes exemplars' trace and span ids in hex where protobuf's JSON mapping
    # expects base64; exemplars are not stored, so they are dropped before parsing.
    _drop_exemplars(doc)
    try:
        # OTLP/JSON receivers must ignore unknown fields (forward compatibility).
        json_format.ParseDict(doc, request, ignore_unknown_fields=True)
    except (json_format.ParseError, ValueError, TypeError, RecursionError) as e:
        raise OtlpError(f"body is not OTLP JSON: {e}") from e
    return request


def _drop_exemplars(doc: Any) -> None:
    stack = [doc]
    while stack:  # iterative: a deeply nested body must not exhaust the Python stack
        node = stack.pop()
        if isinstance(node, dict):
            node.pop("exemplars", None)
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


# ---------------------------------------------------------------------------- pivoting


def pivot(request: ExportMetricsServiceRequest) -> tuple[dict[str, pa.Table], Rejections]:
    """Rows per (run, table, key) from the request's points, as validated Arrow tables.

    Returns ({table: pyarrow.Table of every run's rows, each run's together}, rejections).
    Raises OtlpError for a point that cannot be placed or a row the schema refuses: then
    nothing may be stored.
    """
    rows: dict[tuple[str, str, tuple], _Row] = {}
    rejected = Rejections()
    for resource_metrics in request.resource_metrics:
        # Attributes of the resource, overridden by the scope's, overridden by the point's.
        resource = _attributes(resource_metrics.resource.attributes)
        for scope_metrics in resource_metrics.scope_metrics:
            scoped = {**resource, **_attributes(scope_metrics.scope.attributes)}
            for metric in scope_metrics.metrics:
                _place(metric, scoped, rows, rejected)
    by_table: dict[str, tuple[list[str], list[dict[str, Any]]]] = {}
    for (run_id, table_name, key), row in sorted(rows.items(), key=lambda kv: kv[0]):
        table = TABLES[table_name]
        missing = [f.name for f in table.fields if f.required and f.name not in row.values]
        if missing:
            where = _describe(run_id, table, key)
            rejected.add(
                "of rows lacking required fields (rows are stored whole or not at all)",
                f"{where} lacks {', '.join(missing)}",
                row.points,
            )
            continue
        run_ids, table_rows = by_table.setdefault(table_name, ([], []))
        run_ids.append(run_id)
        table_rows.append(row.values)
    # Every run's rows of a table are validated at once: run by run cost 0.4 ms each.
    validated = {}
    for name, (run_ids, table_rows) in by_table.items():
        columns = {f.name: [r.get(f.name) for r in table_rows] for f in TABLES[name].fields}
        try:
            validated[name] = runs_to_arrow(name, run_ids, columns)
        except SchemaError as e:
            raise OtlpError(_first_refused(name, run_ids, columns)) from e
    return validated, rejected


def decode_and_pivot(body: bytes, as_json: bool) -> tuple[dict[str, pa.Table], Rejections]:
    """`pivot` of the request in `body`; OtlpError if it is not one or cannot be stored."""
    return pivot(decode_request(body, as_json))


def _split_by_run(tables: dict[str, pa.Table]) -> list[tuple[str, dict[str, pa.Table]]]:
    """[(run_id, {table: its rows of that run})], runs in order; slices share the memory."""
    by_run: dict[str, dict[str, pa.Table]] = {}
    for name, table in tables.items():
        ends = _run_ends(table.column("run_id"))
        for run_id, start, end in ends:
            by_run.setdefault(run_id, {})[name] = table.slice(start, end - start)
    return list(by_run.items())


def _run_ends(run_ids: pa.ChunkedArray) -> list[tuple[str, int, int]]:
    """(run_id, first row, row after its last) of each run, its rows being together."""
    encoded = pc.run_end_encode(run_ids.combine_chunks())
    ends = encoded.run_ends.to_pylist()
    return list(zip(encoded.values.to_pylist(), [0, *ends[:-1]], ends, strict=True))


def _first_refused(name: str, run_ids: list[str], columns: dict[str, list]) -> str:
    """The schema's complaint about the first run whose rows it refuses, naming the run
    (as when runs were validated one by one); found run by run, only for a refused request."""
    start = 0
    for run_id, rows in groupby(run_ids):
        n = len(list(rows))
        doc = {"schema_version": SCHEMA_VERSION, "run_id": run_id,
               name: {f: values[start : start + n] for f, values in columns.items()}}  # fmt: skip
        start += n
        try:
            to_arrow(doc)
        except SchemaError as e:
            return f"run {run_id!r}: {e}"
    raise AssertionError("the schema refused the runs together but none alone")


def _place(metric: Message, scoped: dict, rows: dict, rejected: Rejections) -> None:
    kind = metric.WhichOneof("data")
    points = getattr(metric, kind).data_points if kind else ()
    if not is_ours(metric.name):
        if points:
            rejected.add(
                "of metrics not named trainvitals.<table>.<field>", repr(metric.name), len(points)
            )
        return
    where = f"metric {metric.name!r}"
    try:
        table, value_field = parse_metric_name(metric.name)
    except ValueError as e:
        raise OtlpError(str(e)) from e
    if kind not in (None, "gauge", "sum"):
        raise OtlpError(f"{where} is a {kind}; trainvitals metrics are gauges or sums")
    attribute_names = attribute_fields(table)
    for point in points:
        if point.flags & _NO_RECORDED_VALUE:
            rejected.add("flagged as holding no recorded value", repr(metric.name))
            continue
        attrs = {**scoped, **_attributes(point.attributes)}
        run_id = _attribute(attrs, "run_id", "string", where, table)
        if not run_id:
            raise OtlpError(f"{where}: attribute 'run_id' is empty")
        key = tuple(
            _attribute(attrs, k, table.by_name[k].dtype, where, table)
            for k in table.key
            if k != "run_id"
        )
        row = rows.get((run_id, table.name, key))
        if row is None:
            keyed = [k for k in table.key if k != "run_id"]
            row = rows[(run_id, table.name, key)] = _Row(dict(zip(keyed, key, strict=True)))
        # The first value of a cell wins, as in the store (INSERT OR IGNORE on the key).
        row.values.setdefault(value_field.name, _value(point, value_field, where))
        for f in attribute_names:
            if f.name not in row.values and f.name in attrs:
                row.values[f.name] = _attribute(attrs, f.name, f.dtype, where, table)
        row.points += 1


def _attributes(key_values: Any) -> dict[str, Any]:
    return {kv.key: kv.value for kv in key_values}


def _attribute(attrs: dict, name: str, dtype: str, where: str, table: Table) -> Any:
    value = attrs.get(name)
    if value is None:
        keys = ", ".join(table.key)
        raise OtlpError(
            f"{where}: data point lacks the attribute {name!r} (rows of {table.name} are "
            f"keyed by {keys}; see docs/otlp.md)"
        )
    which = value.WhichOneof("value")
    wanted = "int_value" if dtype == "int64" else "string_value"
    if which != wanted:
        raise OtlpError(
            f"{where}: attribute {name!r} must be {'an int' if dtype == 'int64' else 'a string'}"
            f", got {which or 'an empty value'}"
        )
    return getattr(value, which)


def _value(point: Message, f: Field, where: str) -> int | float:
    which = point.WhichOneof("value")
    if which is None:
        raise OtlpError(f"{where}: data point has no value (as_double or as_int)")
    value = getattr(point, which)
    if f.dtype == "float64":
        return float(value)
    if which == "as_double":  # an int64 field: only whole numbers convert exactly
        if not (math.isfinite(value) and value.is_integer()):
            raise OtlpError(f"{where}: {f.name} holds integers, got {value!r}")
        return int(value)
    return value


def _describe(run_id: str, table: Table, key: tuple) -> str:
    keyed = [k for k in table.key if k != "run_id"]
    parts = [f"run_id={run_id!r}", *(f"{k}={v!r}" for k, v in zip(keyed, key, strict=True))]
    return f"{table.name} ({', '.join(parts)})"


# ---------------------------------------------------------------------------- endpoint

_REQUEST_BODY = {
    "required": True,
    "content": {
        PROTOBUF: {"schema": {"type": "string", "format": "binary"}},
        JSON: {
            "schema": {
                "type": "object",
                "description": "OTLP/JSON ExportMetricsServiceRequest",
                "properties": {"resourceMetrics": {"type": "array", "items": {"type": "object"}}},
            }
        },
    },
}


@router.post(
    "/v1/metrics",
    response_class=Response,
    openapi_extra={"requestBody": _REQUEST_BODY},
    responses={
        200: {
            "description": "Stored (ExportMetricsServiceResponse, with partial_success "
            "when some points were not)",
            "content": {PROTOBUF: {}, JSON: {}},
        },
        400: {"description": "Not stored: the google.rpc.Status message says why"},
    },
)
async def receive_metrics(
    request: Request,
    settings: Annotated[Settings, Depends(get_settings)],
    store: Annotated[Store, Depends(get_store)],
    decoder: Annotated[Decoder, Depends(get_decoder)],
    authorization: Annotated[str | None, Header()] = None,
) -> Response:
    """OTLP/HTTP metrics export; `trainvitals.<table>.<field>` metrics are stored as rows."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    as_json = ctype == JSON
    try:
        rejected = await _receive(request, ctype, settings, store, decoder, authorization)
    except HTTPException as e:
        if e.status_code < 500:
            request.app.state.live.count_rejected()
        message = str(e.detail)
        if len(message) > _MAX_MESSAGE:  # parser errors may quote the offending input
            message = message[:_MAX_MESSAGE] + "..."
        status = Status(code=_RPC_CODES.get(e.status_code, 2), message=message)
        return _encode(status, as_json, e.status_code, e.headers)
    response = ExportMetricsServiceResponse()
    if rejected.points:
        response.partial_success.rejected_data_points = rejected.points
        response.partial_success.error_message = rejected.message()
    return _encode(response, as_json)


async def _receive(
    request: Request,
    ctype: str,
    settings: Settings,
    store: Store,
    decoder: Decoder,
    authorization: str | None,
) -> Rejections:
    check_token(settings, authorization)
    if store.read_only:
        raise HTTPException(409, "this collector serves a stored run read-only (replay mode)")
    if ctype not in (PROTOBUF, JSON):
        raise HTTPException(
            415, f"content-type {ctype or None!r} is not supported; send {PROTOBUF} or {JSON}"
        )
    # Refused if cut off after gzip too: the intact prefix of a protobuf body could itself
    # parse as a valid, shorter request.
    body = await read_body(request, settings.max_body_bytes)
    try:
        # CPU-bound: off the event loop, in a worker process if large (decoding.py).
        tables, rejected = await decoder.run(decode_and_pivot, body, ctype == JSON)
    except OtlpError as e:
        raise HTTPException(400, str(e)) from e
    except DecoderLost as e:
        raise HTTPException(503, str(e), headers={"Retry-After": "1"}) from e
    # Here, not in the decoding process: a pickled slice carries its whole table.
    batches = await run_in_threadpool(_split_by_run, tables)
    # One batch per run (the writer commits a wave together), in waves of at most `wave`
    # batches: a request of thousands of runs never fills the write queue (it then got 503
    # forever, and so did every other sender). Should the queue fill between two waves, the
    # sender resends the whole request; keys make what was stored a no-op.
    wave = max(1, min(WAVE_MAX_BATCHES, store.queue_capacity // 4))
    deadline = asyncio.get_running_loop().time() + COMMIT_TIMEOUT_S
    for start in range(0, len(batches), wave):
        futures = []
        for run_id, tables in batches[start : start + wave]:
            try:
                futures.append(asyncio.wrap_future(store.submit(run_id, tables)))
            except Unavailable as e:  # a full write queue, a full disk
                headers = {"Retry-After": "1"}
                raise HTTPException(503, f"{e}; retry later", headers=headers) from e
            except StoreError as e:
                raise HTTPException(409, str(e)) from e
        try:
            async with asyncio.timeout_at(deadline):
                changed = await asyncio.gather(*futures)
        except (StoreError, TimeoutError) as e:
            detail = f"metrics not stored ({e or 'timed out'}); resend them"
            raise HTTPException(503, detail) from e
        for (run_id, _), by_table in zip(batches[start : start + wave], changed, strict=True):
            for table, rows in (by_table or {}).items():
                reason = "of rows whose keys are stored with other values (the first copy stays)"
                rejected.add(reason, f"run {run_id!r}: {rows} {table} rows", rows)
    return rejected


def _encode(
    message: Message, as_json: bool, status: int = 200, headers: Mapping[str, str] | None = None
) -> Response:
    if as_json:
        content = orjson.dumps(json_format.MessageToDict(message))
        return Response(content, status, headers, media_type=JSON)
    return Response(message.SerializeToString(), status, headers, media_type=PROTOBUF)
