"""POST /v1/metrics: OTLP metrics in protobuf or JSON, from hand-built requests and from the
real opentelemetry-sdk client; bad requests get a 4xx naming the problem and store nothing."""

from __future__ import annotations

import gzip
import math

import httpx
import orjson
import pytest
from google.protobuf import json_format
from google.rpc.status_pb2 import Status
from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from trainvitals.hooks.otlp import to_metrics_data

from .conftest import counts, make_batch

URL = "/v1/metrics"
P, J, GZ = "application/x-protobuf", "application/json", "application/x-protobuf+gzip"
PROTOBUF = {"content-type": P}
JSON = {"content-type": J}
NOTHING = {"steps": 0, "layers": 0, "ranks": 0}
ALL = {"steps": 3, "layers": 6, "ranks": 6}


def otlp_request(batch=None) -> ExportMetricsServiceRequest:
    """The OTLP form of a schema batch, as the hooks' OtlpExporter sends it."""
    data = to_metrics_data(
        (batch or make_batch()).to_dict(), Resource({}), InstrumentationScope("t")
    )
    return encode_metrics(data)


def with_metric(request: ExportMetricsServiceRequest, metric: dict) -> ExportMetricsServiceRequest:
    """A copy of `request` with one more metric (protobuf JSON mapping, snake_case) appended."""
    out = ExportMetricsServiceRequest()
    out.CopyFrom(request)
    json_format.ParseDict(metric, out.resource_metrics[0].scope_metrics[0].metrics.add())
    return out


def attrs(**values) -> list[dict]:
    kinds = {int: "int_value", str: "string_value", float: "double_value"}
    return [{"key": k, "value": {kinds[type(v)]: v}} for k, v in values.items()]


def gauge(name: str, value: float, **attributes) -> dict:
    point = {"as_double": value, "attributes": attrs(**attributes)}
    return {"name": name, "gauge": {"data_points": [point]}}


def post(client, request: ExportMetricsServiceRequest, encoding: str = "protobuf", gz=False):
    if encoding == "json":
        body, headers = json_format.MessageToJson(request).encode(), dict(JSON)
    else:
        body, headers = request.SerializeToString(), dict(PROTOBUF)
    if gz:
        body, headers["content-encoding"] = gzip.compress(body), "gzip"
    return client.post(URL, content=body, headers=headers)


def response_of(r) -> ExportMetricsServiceResponse:
    out = ExportMetricsServiceResponse()
    if r.headers["content-type"].startswith("application/json"):
        return json_format.Parse(r.text, out)
    out.ParseFromString(r.content)
    return out


def status_message(r) -> str:
    if r.headers["content-type"].startswith("application/json"):
        return r.json()["message"]
    status = Status()
    status.ParseFromString(r.content)
    return status.message


@pytest.mark.parametrize(("encoding", "gz"), [("protobuf", False), ("json", False),
                                              ("protobuf", True), ("json", True)])  # fmt: skip
def test_every_encoding_stores_the_batch_once(client, encoding, gz) -> None:
    for _ in range(2):  # a resend (an SDK's next cumulative export) is not a duplicate
        r = post(client, otlp_request(), encoding, gz)
        assert r.status_code == 200, r.text
        assert not response_of(r).HasField("partial_success")
        assert r.headers["content-type"] == (J if encoding == "json" else P)
    assert counts(client) == ALL


def test_otlp_json_as_the_spec_writes_it(client) -> None:
    """camelCase keys, int64 as strings, enums as integers, exemplars with hex ids."""
    point = {
        "timeUnixNano": "1700000000000000000",
        "asDouble": 2.5,
        "attributes": [{"key": "step", "value": {"intValue": "7"}}],
        "exemplars": [{"asDouble": 2.5, "traceId": "5b8efff798038103d269b633813fc60c",
                       "spanId": "eee19b7ec3c1b174", "timeUnixNano": "1700000000000000000"}],
    }  # fmt: skip
    values = {f: 1.0 for f in ("time_unix_s", "loss", "grad_norm", "step_time_s",
                               "tokens_per_s", "tflops_per_s_per_device", "mfu_ratio")}  # fmt: skip
    metrics = [
        {"name": f"trainvitals.steps.{f}", "gauge": {"dataPoints": [{**point, "asDouble": v}]}}
        for f, v in values.items()
    ]
    tokens = {**point, "asInt": "512"}
    del tokens["asDouble"]
    sum_ = {"aggregationTemporality": 2, "isMonotonic": False, "dataPoints": [tokens]}
    metrics.append({"name": "trainvitals.steps.tokens", "sum": sum_})
    body = {"resourceMetrics": [{
        "resource": {"attributes": [{"key": "run_id", "value": {"stringValue": "spec"}}]},
        "scopeMetrics": [{"scope": {"name": "x"}, "metrics": metrics}]}]}  # fmt: skip
    r = client.post(URL, content=orjson.dumps(body), headers=JSON)
    assert r.status_code == 200 and r.json() == {}, r.text
    rows = client.app.state.store.query(
        "SELECT step, tokens, loss FROM steps WHERE run_id = 'spec'"
    )
    assert rows.to_pylist() == [{"step": 7, "tokens": 512, "loss": 1.0}]


def test_metrics_that_are_not_ours_are_counted_in_partial_success(client) -> None:
    request = with_metric(otlp_request(), gauge("process.cpu.utilization", 0.5, cpu=0))
    request = with_metric(request, {"name": "http.server.duration", "histogram": {
        "aggregation_temporality": 2,
        "data_points": [{"count": 2, "sum": 1.0}, {"count": 1, "sum": 1.0}]}})  # fmt: skip
    for encoding in ("protobuf", "json"):
        r = post(client, request, encoding)
        assert r.status_code == 200, r.text
        partial = response_of(r).partial_success
        assert partial.rejected_data_points == 3
        assert "'process.cpu.utilization'" in partial.error_message
        assert "'http.server.duration'" in partial.error_message
    assert counts(client) == ALL  # everything of ours is stored


def test_incomplete_rows_are_not_stored_and_are_named(client) -> None:
    """A step whose fields are not all there yet (an SDK reader collected mid-step)."""
    request = with_metric(otlp_request(), gauge("trainvitals.steps.loss", 2.0, run_id="r1", step=9))
    r = post(client, request)
    assert r.status_code == 200, r.text
    partial = response_of(r).partial_success
    assert partial.rejected_data_points == 1
    assert "steps (run_id='r1', step=9) lacks time_unix_s, grad_norm" in partial.error_message
    assert counts(client) == ALL


def _bad(metric: dict) -> bytes:
    return with_metric(otlp_request(), metric).SerializeToString()


def _infinite_step_time() -> bytes:
    b = make_batch()
    b._columns["ranks"]["step_time_s"][3] = math.inf
    return otlp_request(b).SerializeToString()


NO_VALUE = {"data_points": [{"attributes": attrs(run_id="r1", step=0)}]}

# (body, content type, status, what the message says). The protobuf bodies made by _bad
# hold the complete valid batch too: one bad point refuses the whole request.
BAD = [
    (b"\xff\xff\xff\xff", P, 400, "not an OTLP protobuf"),
    (b"\x7a\x03abc", P, 400, "no field of an OTLP"),  # field 15: unknown fields only
    (b"{not json", J, 400, "not valid JSON"),
    (b"[1, 2]", J, 400, "must be a JSON object"),
    (orjson.dumps({"metrics": []}), J, 400, "no resourceMetrics"),
    (orjson.dumps({"resourceMetrics": "all"}), J, 400, "not OTLP JSON"),
    (orjson.dumps({"resourceMetrics": [{"scopeMetrics": [{"metrics": [{"gauge": 1}]}]}]}),
     J, 400, "not OTLP JSON"),
    (_bad(gauge("trainvitals.steps.loss", 1.0, run_id="r1")),
     P, 400, "'trainvitals.steps.loss': data point lacks the attribute 'step'"),
    (_bad(gauge("trainvitals.layers.act_rms", 1.0, run_id="r1", step=1)),
     P, 400, "lacks the attribute 'layer'"),
    (_bad(gauge("trainvitals.steps.loss", 1.0, step=1)), P, 400, "lacks the attribute 'run_id'"),
    (_bad(gauge("trainvitals.steps.loss", 1.0, run_id="r1", step="3")),
     P, 400, "attribute 'step' must be an int, got string_value"),
    (_bad(gauge("trainvitals.steps.bogus", 1.0, run_id="r1", step=1)),
     P, 400, "table steps has no field 'bogus'"),
    (_bad(gauge("trainvitals.gpus.power_w", 1.0, run_id="r1", step=1)),
     P, 400, "unknown table 'gpus'"),
    (_bad(gauge("trainvitals.layers.layer", 1.0, run_id="r1", step=1)),
     P, 400, "travels as an attribute"),
    (_bad(gauge("trainvitals.steps.tokens", 1.5, run_id="r1", step=1)),
     P, 400, "tokens holds integers, got 1.5"),
    (_infinite_step_time(), P, 400, "ranks.step_time_s: values must be finite"),
    (_bad({"name": "trainvitals.steps.loss", "histogram": {"data_points": [{"count": 1}]}}),
     P, 400, "is a histogram"),
    (_bad({"name": "trainvitals.steps.loss", "gauge": NO_VALUE}), P, 400, "has no value"),
    (gzip.compress(b"x")[:-3], GZ, 400, "not valid gzip"),
    (b"\x00" * (1024 * 1024 + 1), P, 413, "exceeds the limit"),
    (gzip.compress(b"\x00" * (4 << 20)), GZ, 413, "decompressed body"),
    (b"a,b", "text/csv", 415, "application/x-protobuf"),
    (b"", "", 415, "not supported"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "ctype", "status", "message"), BAD)
def test_bad_requests_are_refused_and_store_nothing(client, body, ctype, status, message) -> None:
    headers = {"content-type": ctype.removesuffix("+gzip")} if ctype else {}
    if ctype.endswith("+gzip"):
        headers["content-encoding"] = "gzip"
    r = client.post(URL, content=body, headers=headers)
    assert r.status_code == status, r.text
    assert message in status_message(r)
    assert counts(client) == NOTHING
    # The collector keeps working: the valid part alone lands.
    assert post(client, otlp_request()).status_code == 200
    assert counts(client) == ALL


def test_deflate_is_refused_by_name(client) -> None:
    r = client.post(URL, content=b"x", headers={**PROTOBUF, "content-encoding": "deflate"})
    assert r.status_code == 415 and "'deflate' is not supported" in status_message(r)


def test_bearer_token_and_rejection_count(settings) -> None:
    from fastapi.testclient import TestClient

    from trainvitals.collector.main import create_app

    settings.ingest_token = "s3cret"
    with TestClient(create_app(settings)) as c:
        body = otlp_request().SerializeToString()
        for auth in ({}, {"authorization": "Bearer nope"}):
            r = c.post(URL, content=body, headers={**PROTOBUF, **auth})
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
            assert "bearer token" in status_message(r)
        assert counts(c) == NOTHING
        auth = {"authorization": "Bearer s3cret"}
        assert c.post(URL, content=body, headers={**PROTOBUF, **auth}).status_code == 200
        assert counts(c) == ALL
        metrics = c.get("/metrics", headers=auth).text  # reads need the token too
        assert "trainvitals_collector_rejected_batches_total 2.0" in metrics


def test_events_and_run_metadata_carry_strings_as_attributes(client) -> None:
    b = make_batch()
    b.append("events", step=1, rank=-1, kind="fault:straggler", detail='{"rank": 1}',
             time_unix_s=1001.0)  # fmt: skip
    assert post(client, otlp_request(b)).status_code == 200
    events = client.get("/api/v1/runs/r1/events").json()
    assert events == [{"run_id": "r1", "step": 1, "rank": -1, "kind": "fault:straggler",
                       "detail": '{"rank": 1}', "time_unix_s": 1001.0}]  # fmt: skip


def test_attributes_layer_resource_scope_point_and_flagged_points_are_counted(client) -> None:
    floats = ("time_unix_s", "loss", "grad_norm", "step_time_s", "tokens_per_s",
              "tflops_per_s_per_device", "mfu_ratio")  # fmt: skip
    metrics = [gauge(f"trainvitals.steps.{f}", 1.0, step=5) for f in floats]
    metrics.append(gauge("trainvitals.steps.tokens", 64.0, step=5))  # a whole double: ok
    flagged = {"flags": 1, "attributes": attrs(step=6)}  # "no recorded value"
    metrics.append({"name": "trainvitals.steps.loss", "gauge": {"data_points": [flagged]}})
    request = json_format.ParseDict({"resource_metrics": [{
        "resource": {"attributes": attrs(run_id="from-resource", step=98)},
        "scope_metrics": [{"scope": {"name": "s", "attributes": attrs(step=99)},
                           "metrics": metrics}]}]}, ExportMetricsServiceRequest())  # fmt: skip
    r = post(client, request)
    assert r.status_code == 200, r.text
    partial = response_of(r).partial_success
    assert partial.rejected_data_points == 1 and "no recorded value" in partial.error_message
    rows = client.app.state.store.query("SELECT run_id, step, tokens FROM steps").to_pylist()
    assert rows == [{"run_id": "from-resource", "step": 5, "tokens": 64}]


# ------------------------------------------------------------------ the real SDK client


def test_the_opentelemetry_sdk_client_against_a_real_collector(collector) -> None:
    """A MeterProvider with the SDK's OTLP/HTTP exporter, as any instrumented program has."""
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

    exporter = OTLPMetricExporter(endpoint=f"{collector.url}/v1/metrics")
    # A long interval: the test decides when to export (force_flush), so no collection
    # happens in the middle of a step; shutdown() exports everything once more.
    reader = PeriodicExportingMetricReader(exporter, export_interval_millis=3_600_000)
    provider = MeterProvider(resource=Resource.create({"run_id": "sdk"}), metric_readers=[reader])
    meter = provider.get_meter("train.py")
    step_fields = {"time_unix_s": lambda s: 1000.0 + s, "loss": lambda s: 3.0 - 0.1 * s,
                   "grad_norm": lambda s: 1.0, "step_time_s": lambda s: 0.5,
                   "tokens_per_s": lambda s: 1024.0, "tflops_per_s_per_device": lambda s: 0.1,
                   "mfu_ratio": lambda s: 0.25}  # fmt: skip
    gauges = {f: meter.create_gauge(f"trainvitals.steps.{f}") for f in step_fields}
    tokens = meter.create_gauge("trainvitals.steps.tokens")
    grad = meter.create_gauge("trainvitals.layers.grad_norm")
    rms = meter.create_gauge("trainvitals.layers.act_rms")
    other = meter.create_counter("dataloader.batches")  # not ours: partial success
    for step in range(20):
        for f, value in step_fields.items():
            gauges[f].set(value(step), {"step": step})
        tokens.set(512, {"step": step})
        for layer in range(3):
            grad.set(0.1 * layer + step, {"step": step, "layer": layer})
            rms.set(1.0, {"step": step, "layer": layer})
        other.add(1)
        if step == 9:
            assert provider.force_flush(10_000)
    assert provider.force_flush(10_000)
    provider.shutdown()  # a third export of the same cumulative points

    runs = {r["run_id"]: r for r in httpx.get(f"{collector.url}/api/v1/runs").json()}
    assert runs["sdk"]["last_step"] == 19
    cols = httpx.get(f"{collector.url}/api/v1/runs/sdk/steps").json()["columns"]
    assert cols["step"] == list(range(20))
    assert cols["loss"] == pytest.approx([3.0 - 0.1 * s for s in range(20)])
    assert cols["tokens"] == [512.0] * 20
    grid = httpx.get(f"{collector.url}/api/v1/runs/sdk/layers", params={"metric": "grad_norm"})
    grid = grid.json()
    assert list(zip(grid["step"], grid["layer"], strict=True)) == [
        (s, layer) for s in range(20) for layer in range(3)
    ]
    assert grid["value"] == pytest.approx(
        [0.1 * layer + s for s in range(20) for layer in range(3)]
    )
    collector.stop()
    import duckdb

    con = duckdb.connect(str(collector.store), read_only=True)
    try:  # exactly once, though every point was sent three times
        for table, n in (("steps", 20), ("layers", 60)):
            assert con.execute(f"SELECT count(*) FROM {table}").fetchone() == (n,)
    finally:
        con.close()


# ------------------------------------------------------------------ bounded work


def _steps_lacking_fields(n_rows: int, n_runs: int = 1, complete: bool = False) -> bytes:
    """One request of `n_rows` steps rows over `n_runs` runs: each row only a loss, or
    (complete) every required field."""
    from opentelemetry.proto.metrics.v1.metrics_pb2 import Metric

    request = ExportMetricsServiceRequest()
    scope = request.resource_metrics.add().scope_metrics.add()
    fields = ["loss"]
    if complete:
        fields += ["time_unix_s", "grad_norm", "step_time_s", "tokens_per_s",
                   "tflops_per_s_per_device", "mfu_ratio", "tokens"]  # fmt: skip
    for f in fields:
        metric: Metric = scope.metrics.add(name=f"trainvitals.steps.{f}")
        for i in range(n_rows):
            point = metric.gauge.data_points.add(as_double=1.0)
            point.attributes.add(key="run_id").value.string_value = f"run-{i % n_runs}"
            point.attributes.add(key="step").value.int_value = i // n_runs
    return request.SerializeToString()


def test_many_rejected_rows_keep_a_few_examples() -> None:
    """Each rejection searched a list of every earlier one: a 1.9 MB request of 900k
    points ran 8 minutes. The examples kept per reason are bounded."""
    from trainvitals.collector.otlp import _EXAMPLES, Rejections

    rejected = Rejections()
    for i in range(100_000):
        rejected.add("of rows lacking required fields", f"row {i}")
    rejected.add("of rows lacking required fields", "row 0")
    (count, examples, more) = rejected.by_reason["of rows lacking required fields"]
    assert (count, len(examples), more) == (100_001, _EXAMPLES, True)
    assert rejected.message() == (
        "100001 data points not stored: 100001 of rows lacking required fields "
        "(row 0; row 1; row 2; row 3; row 4, and others)"
    )


def test_a_request_of_many_incomplete_rows_is_answered_whole(client) -> None:
    r = client.post(URL, content=_steps_lacking_fields(20_000), headers=PROTOBUF)
    assert r.status_code == 200, r.text
    partial = response_of(r).partial_success
    assert partial.rejected_data_points == 20_000
    assert partial.error_message.endswith("step=4) lacks time_unix_s, grad_norm, tokens, "
                                          "step_time_s, tokens_per_s, tflops_per_s_per_device, "
                                          "mfu_ratio, and others)")  # fmt: skip
    assert counts(client) == NOTHING


def test_a_request_of_more_runs_than_the_write_queue_holds_is_stored(tmp_path) -> None:
    """1,300 runs in one request filled the 1,024-batch queue: 503 forever. It goes in
    waves of at most a quarter of the queue."""
    from fastapi.testclient import TestClient

    from trainvitals.collector.main import create_app
    from trainvitals.collector.settings import Settings

    settings = Settings(store_path=str(tmp_path / "s.duckdb"), queue_max_batches=8)
    with TestClient(create_app(settings)) as c:
        r = c.post(URL, content=_steps_lacking_fields(100, n_runs=50, complete=True),
                   headers=PROTOBUF)  # fmt: skip
        assert r.status_code == 200, r.text
        assert response_of(r).partial_success.rejected_data_points == 0
        store = c.app.state.store
        store.flush()
        runs = store.query("SELECT count(DISTINCT run_id) AS n, count(*) AS rows FROM steps")
        assert runs.to_pylist() == [{"n": 50, "rows": 100}]


def test_the_runs_of_a_request_are_validated_together(monkeypatch) -> None:
    """Each run of a request was validated on its own, 0.4 ms a run: 3,000 runs of one row
    cost 4.4x a valid request's CPU per MB. A table is validated once, whatever the runs,
    and split into a batch per run only then."""
    from trainvitals.collector.otlp import _split_by_run, decode_and_pivot
    from trainvitals.schema import validation

    validated: list[str] = []
    real = validation._table_to_arrow

    def counted(spec, *args):
        validated.append(spec.name)
        return real(spec, *args)

    monkeypatch.setattr(validation, "_table_to_arrow", counted)
    body = _steps_lacking_fields(300, n_runs=100, complete=True)
    tables, rejected = decode_and_pivot(body, False)
    assert validated == ["steps"] and rejected.points == 0
    batches = _split_by_run(tables)
    assert [run_id for run_id, _ in batches] == sorted(f"run-{i}" for i in range(100))
    for run_id, by_table in batches:
        steps = by_table["steps"]
        assert steps.column("run_id").unique().to_pylist() == [run_id]
        assert steps.column("step").to_pylist() == [0, 1, 2]


def test_a_refused_row_among_many_runs_names_its_run_and_nothing_is_stored(client) -> None:
    request = ExportMetricsServiceRequest.FromString(
        _steps_lacking_fields(300, n_runs=100, complete=True)
    )
    (step_time,) = [m for m in request.resource_metrics[0].scope_metrics[0].metrics
                    if m.name == "trainvitals.steps.step_time_s"]  # fmt: skip
    step_time.gauge.data_points[250].as_double = math.inf  # run-50, step 2
    r = client.post(URL, content=request.SerializeToString(), headers=PROTOBUF)
    assert r.status_code == 400, r.text
    assert status_message(r) == "run 'run-50': steps.step_time_s: values must be finite numbers"
    assert counts(client) == NOTHING
