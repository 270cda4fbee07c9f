"""Where telemetry batches go: small exporters with `export` / `force_flush` / `shutdown`.

Exporters run on the monitor's background thread, never in the training step. They must
not raise: a failure is logged and counted; HttpExporter spools undelivered batches to disk
and resends them, in order, when the collector is back.
`NullExporter` is the off switch, `InMemoryExporter` the one tests read back.
"""

from __future__ import annotations

import enum
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Protocol

from trainvitals.schema import BatchBuilder
from trainvitals.sender import retryable

from .spool import Spool
from .wire import gzipped

log = logging.getLogger(__name__)

JSON, MSGPACK = "application/json", "application/msgpack"
# Drains in a row in which the collector failed (500) on the same spooled batch before it is
# set aside: a 500 that persists across export intervals is the batch, not a passing fault.
FAILED_DRAINS = 3


class ExportResult(enum.Enum):
    """What became of one batch (as OpenTelemetry's MetricExportResult). True only for
    SUCCESS, so `if exporter.export(batch):` reads as it should."""

    SUCCESS = "success"  # delivered (or, for a file, written)
    FAILURE = "failure"  # not delivered now: spooled for a resend, rejected, or dropped

    def __bool__(self) -> bool:
        return self is ExportResult.SUCCESS

    @classmethod
    def of(cls, ok: bool) -> ExportResult:
        return cls.SUCCESS if ok else cls.FAILURE


class Exporter(Protocol):
    """Where the export reader (reader.py) sends batches, from its own thread.

    `dropped_batches`: batches neither delivered nor kept for a later resend, so far (the
    monitor adds it to telemetry_dropped)."""

    dropped_batches: int

    def export(self, batch: BatchBuilder) -> ExportResult:
        """Deliver one batch. Must not raise: a failure is logged and counted."""

    def force_flush(self, timeout_s: float) -> bool:
        """Deliver what the exporter still holds; True if nothing is left. Must not raise."""

    def shutdown(self, timeout_s: float) -> None: ...


class NullExporter:
    """Monitoring off: accepts everything, keeps nothing."""

    dropped_batches = 0

    def export(self, batch: BatchBuilder) -> ExportResult:
        return ExportResult.SUCCESS

    def force_flush(self, timeout_s: float) -> bool:
        return True

    def shutdown(self, timeout_s: float) -> None:
        pass


class InMemoryExporter:
    """Keeps every batch as a dict (the decoded wire form), for tests and notebooks."""

    dropped_batches = 0

    def __init__(self) -> None:
        self.batches: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def force_flush(self, timeout_s: float) -> bool:
        return True

    def export(self, batch: BatchBuilder) -> ExportResult:
        with self._lock:
            self.batches.append(batch.to_dict())
        return ExportResult.SUCCESS

    def rows(self, table: str) -> list[dict[str, Any]]:
        """All rows of `table` across batches, one dict per row."""
        with self._lock:
            out = []
            for b in self.batches:
                cols = b.get(table)
                if cols:
                    n = len(next(iter(cols.values())))
                    out.extend({k: v[i] for k, v in cols.items()} for i in range(n))
            return out

    def shutdown(self, timeout_s: float) -> None:
        pass


class HttpExporter:
    """POSTs batches to a collector; spools what cannot be delivered and resends it.

    A batch travels in the binary columnar msgpack form (8 bytes a value, built from numpy
    columns without a Python object per value), gzipped; a spooled batch is kept as JSON, the
    spool's format that `trainvitals import` reads, and resent as JSON (encoding it builds
    Python objects, on the export thread, only while the collector is away).

    Delivery order is kept: while anything is spooled, new batches join the spool behind
    it, and each export first tries to drain the spool. A batch the collector rejects as
    invalid (4xx) is not retried: it is logged and counted in `rejected_batches`. A spooled
    batch the collector fails on (500 to every attempt) in FAILED_DRAINS drains in a row is
    set aside in the spool (spool.py), so that one batch it cannot take does not hold back
    every later one; it counts as dropped until `trainvitals import` delivers it.
    """

    def __init__(
        self,
        url: str,
        token: str | None = None,
        spool_dir: str | Path | None = None,
        timeout_s: float = 5.0,
        retries: int = 2,
        backoff_s: float = 0.25,
    ) -> None:
        import httpx

        self.url = url.rstrip("/") + "/api/v1/ingest"
        headers = {}
        if token is None:  # the collector's own variable for its write token
            token = os.environ.get("TRAINVITALS_INGEST_TOKEN", "")
        if token:
            headers["authorization"] = f"Bearer {token}"
        self._client = httpx.Client(timeout=timeout_s, headers=headers)
        self.spool = Spool(spool_dir) if spool_dir else None
        self.retries = retries
        self.backoff_s = backoff_s
        self.sent_batches = 0
        self.rejected_batches = 0
        # Neither delivered nor spooled (no spool, or disk full), or set aside.
        self.dropped_batches = 0
        self._failed_on_last = False  # did the last _send get 500 to every attempt?
        self._failed_drains: dict[Path, int] = {}  # spooled batch -> drains answered 500

    def export(self, batch: BatchBuilder) -> ExportResult:
        if self.spool is not None and self._drain() and len(self.spool):
            self._keep(batch)  # the collector is still away: queue behind the others
            return ExportResult.FAILURE
        delivered = self._send(gzipped(batch.to_msgpack()), MSGPACK, gzip=True)
        if delivered is None:
            self._keep(batch)
        return ExportResult.of(bool(delivered))

    def force_flush(self, timeout_s: float) -> bool:
        """Batches are sent as they come; a spooled one waits for the next export or for
        shutdown (a drain retries, which would not respect `timeout_s`)."""
        return self.spool is None or not len(self.spool)

    def _send(self, body: bytes, content_type: str = JSON, gzip: bool = False) -> bool | None:
        """True: stored. False: rejected for good. None: not delivered (try again later)."""
        self._failed_on_last = True
        for attempt in range(self.retries + 1):
            try:
                headers = {"content-type": content_type}
                if gzip:
                    headers["content-encoding"] = "gzip"
                resp = self._client.post(self.url, content=body, headers=headers)
                if resp.status_code < 300:
                    self.sent_batches += 1
                    return True
                if resp.status_code >= 400 and not retryable(resp.status_code):
                    # The collector judged the batch itself: resending cannot help.
                    log.error("collector rejected a batch (%s): %s", resp.status_code, resp.text)
                    self.rejected_batches += 1
                    return False
                # 500: the collector failed on this batch; 502-504: it is away or busy.
                self._failed_on_last &= resp.status_code == 500
                log.warning("collector answered %s; retrying", resp.status_code)
            except Exception as e:  # network errors of every kind: never into training
                self._failed_on_last = False
                log.warning("export to %s failed (%s); attempt %d", self.url, e, attempt + 1)
            time.sleep(self.backoff_s * 2**attempt)
        return None

    def _drain(self) -> bool:
        """Resend spooled batches in order; True if the spool was touched at all."""
        pending = self.spool.pending()
        for path in pending:
            if self._send(path.read_bytes()) is None:
                if self._set_aside_if_failing(path):
                    continue
                return True  # still unreachable; keep the rest in order
            path.unlink()
            self._failed_drains.pop(path, None)
        return bool(pending)

    def _set_aside_if_failing(self, path: Path) -> bool:
        """Count a drain in which the collector failed on `path` itself; set it aside once
        that has happened FAILED_DRAINS times in a row. True if it was set aside."""
        if not self._failed_on_last:  # away or busy: not the batch's fault
            self._failed_drains.pop(path, None)
            return False
        failures = self._failed_drains.get(path, 0) + 1
        if failures < FAILED_DRAINS:
            self._failed_drains[path] = failures
            return False
        del self._failed_drains[path]
        aside = self.spool.set_aside(path)
        self.dropped_batches += 1
        log.error(
            "the collector failed (500) on a spooled batch %d times; set aside as %s so the "
            "batches after it go on. Once the collector is mended: trainvitals import %s",
            failures * (self.retries + 1),
            aside,
            self.spool.dir,
        )
        return True

    def _keep(self, batch: BatchBuilder) -> bool:
        if self.spool is None:
            self.dropped_batches += 1
            return False
        try:
            self.spool.put(batch.to_json())
        except OSError as e:
            log.error("cannot spool a batch to %s (%s); it is lost", self.spool.dir, e)
            self.dropped_batches += 1
        return False

    def shutdown(self, timeout_s: float) -> None:
        if self.spool is not None and len(self.spool):
            self._drain()
            if left := len(self.spool):
                log.warning(
                    "%d telemetry batches remain in %s; the next run sends them, or "
                    "`trainvitals import %s --collector URL`",
                    left,
                    self.spool.dir,
                    self.spool.dir,
                )
        self._client.close()


class JsonlExporter:
    """Appends each batch as one JSON line to a file: an offline record of the run."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._file = open(path, "ab")  # noqa: SIM115 - held open for the run's lifetime
        self.dropped_batches = 0  # batches the file refused (a full disk)

    def export(self, batch: BatchBuilder) -> ExportResult:
        try:
            self._file.write(batch.to_json() + b"\n")
            self._file.flush()
            return ExportResult.SUCCESS
        except OSError as e:
            log.error("cannot write telemetry to %s: %s", self.path, e)
            self.dropped_batches += 1
            return ExportResult.FAILURE

    def force_flush(self, timeout_s: float) -> bool:
        return True  # every batch is flushed to the file as it is written

    def shutdown(self, timeout_s: float) -> None:
        try:
            self._file.close()  # flushes what a failed write left in the buffer
        except OSError as e:
            log.error("cannot write telemetry to %s: %s", self.path, e)


class MultiExporter:
    """Sends every batch to each of several exporters."""

    def __init__(self, exporters: list[Exporter]) -> None:
        self.exporters = exporters

    def export(self, batch: BatchBuilder) -> ExportResult:
        return ExportResult.of(all([bool(e.export(batch)) for e in self.exporters]))

    @property
    def dropped_batches(self) -> int:
        """What each exporter dropped, together (the monitor's telemetry_dropped reads it)."""
        return sum(getattr(e, "dropped_batches", 0) for e in self.exporters)

    def force_flush(self, timeout_s: float) -> bool:
        return all([e.force_flush(timeout_s) for e in self.exporters])

    def shutdown(self, timeout_s: float) -> None:
        for e in self.exporters:
            e.shutdown(timeout_s)
