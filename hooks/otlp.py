"""OtlpExporter: telemetry batches as OpenTelemetry metrics, to any OTLP/HTTP endpoint.

The records travel as number data points named `trainvitals.<table>.<field>`, with the
key and string fields as attributes (trainvitals/otlp.py, docs/otlp.md). The
opentelemetry-sdk's own OTLP/HTTP exporter sends them (protobuf, gzip, its retries and
backoff). So the endpoint may be the trainvitals collector's `/v1/metrics`, or an
OpenTelemetry Collector that batches, queues and routes them on.

    from trainvitals.hooks import attach
    from trainvitals.hooks.otlp import OtlpExporter

    monitor = attach(model, mesh, exporter=OtlpExporter("http://otel-collector:4318"))
"""

from __future__ import annotations

import logging
import time
from typing import Any

from trainvitals.otlp import attribute_fields, metric_name, value_fields
from trainvitals.schema import TABLES, BatchBuilder

from .exporter import ExportResult

log = logging.getLogger(__name__)

SIGNAL_PATH = "/v1/metrics"


class OtlpExporter:
    """Sends each batch as one OTLP metrics export request; never raises into training.

    `endpoint` is the base URL of an OTLP/HTTP receiver (`/v1/metrics` is appended unless
    the URL already ends with it). `token` adds `Authorization: Bearer <token>`; other
    `headers` are sent as given. A batch the endpoint refuses, or that cannot be delivered
    within `timeout_s` (the SDK retries 429/502/503/504 and connection errors with backoff
    until then), is logged and counted in `dropped_batches`: this exporter has no spool.
    Put an OpenTelemetry Collector with a persistent sending queue in front where
    delivery must survive an outage of the store.
    """

    def __init__(
        self,
        endpoint: str,
        token: str | None = None,
        headers: dict[str, str] | None = None,
        timeout_s: float = 5.0,
        gzip: bool = True,
        resource_attributes: dict[str, Any] | None = None,
    ) -> None:
        from opentelemetry.exporter.otlp.proto.http import Compression
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope

        if not endpoint.startswith(("http://", "https://")):
            raise ValueError(f"OtlpExporter.endpoint must be an http(s) URL, got {endpoint!r}")
        if timeout_s <= 0:
            raise ValueError(f"OtlpExporter.timeout_s must be positive, got {timeout_s}")
        url = endpoint.rstrip("/")
        self.endpoint = url if url.endswith(SIGNAL_PATH) else url + SIGNAL_PATH
        headers = dict(headers or {})
        if token:
            headers["authorization"] = f"Bearer {token}"
        self.timeout_s = timeout_s
        self._exporter = OTLPMetricExporter(
            endpoint=self.endpoint,
            headers=headers,
            timeout=timeout_s,
            compression=Compression.Gzip if gzip else Compression.NoCompression,
        )
        # Resource.create adds the SDK's defaults and OTEL_RESOURCE_ATTRIBUTES.
        self._resource = Resource.create(
            {"service.name": "trainvitals", **(resource_attributes or {})}
        )
        self._scope = InstrumentationScope("trainvitals.hooks")
        self.sent_batches = 0
        self.dropped_batches = 0  # refused by the endpoint, or not delivered in time

    def export(self, batch: BatchBuilder) -> ExportResult:
        from opentelemetry.sdk.metrics.export import MetricExportResult

        try:
            data = to_metrics_data(batch.to_dict(), self._resource, self._scope)
            result = self._exporter.export(data, timeout_millis=self.timeout_s * 1000)
            delivered = result is MetricExportResult.SUCCESS
        except Exception:  # the SDK logs its failures; anything else must not reach training
            log.exception("OTLP export to %s failed", self.endpoint)
            delivered = False
        if delivered:
            self.sent_batches += 1
        else:
            log.error("a telemetry batch was not delivered to %s; it is lost", self.endpoint)
            self.dropped_batches += 1
        return ExportResult.of(delivered)

    def force_flush(self, timeout_s: float) -> bool:
        try:
            return bool(self._exporter.force_flush(timeout_millis=int(timeout_s * 1000)))
        except Exception:  # as export: never into training
            log.exception("flushing the OTLP exporter failed")
            return False

    def shutdown(self, timeout_s: float) -> None:
        try:
            self._exporter.shutdown(timeout_millis=timeout_s * 1000)
        except Exception:
            log.exception("shutting down the OTLP exporter failed")


def to_metrics_data(doc: dict[str, Any], resource: Any, scope: Any, time_ns: int | None = None):
    """One batch (the wire form of BatchBuilder.to_dict) as SDK MetricsData: one gauge per
    `trainvitals.<table>.<field>`, one data point per record that has a value there."""
    from opentelemetry.sdk.metrics.export import (
        Gauge,
        Metric,
        MetricsData,
        NumberDataPoint,
        ResourceMetrics,
        ScopeMetrics,
    )

    now = time_ns if time_ns is not None else time.time_ns()
    run_id = doc["run_id"]
    metrics = []
    for table in TABLES.values():
        columns = doc.get(table.name)
        if not columns:
            continue
        n_rows = len(next(iter(columns.values())))
        # Values travel as they are in the batch (ints as as_int, floats as as_double), so
        # the receiver judges them as ingest would: a float in an int64 field is refused
        # there, never truncated here. Non-finite floats are strings on the wire.
        attributes = [{"run_id": run_id} for _ in range(n_rows)]
        for f in attribute_fields(table):
            for attrs, value in zip(attributes, columns[f.name], strict=True):
                if value is not None:
                    attrs[f.name] = value
        for f in value_fields(table):
            points = [
                NumberDataPoint(attrs, now, now, float(value) if isinstance(value, str) else value)
                for attrs, value in zip(attributes, columns[f.name], strict=True)
                if value is not None
            ]
            if points:
                metrics.append(Metric(metric_name(table, f), f.doc, "", Gauge(points)))
    scope_metrics = ScopeMetrics(scope, metrics, "")
    return MetricsData([ResourceMetrics(resource, [scope_metrics], "")])
