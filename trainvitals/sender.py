"""Send schema batch documents to a collector: batched, binary msgpack, several connections.

    report = send(simulate(spec), "http://127.0.0.1:8000", connections=4)
    print(report.summary())

Consecutive documents are merged into one batch of about `batch_points` values (exporters
send one batch per interval, not one per step), encoded with `schema.encode_msgpack`
(numeric columns as binary) and POSTed by `connections` threads, each with a connection
of its own. A batch the collector cannot take now (503, a network error) is resent after
a back-off; one it refuses (4xx) is counted and named in the report, not resent. Batches
may be committed out of order across connections: the collector's live analysis waits a
moment and reads the store in step order (analyzer/live.py), so that costs nothing.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from trainvitals import checks
from trainvitals.schema import DTYPES, TABLES, encode_json, encode_msgpack

_STOP = object()
RETRY_LIMIT = 20  # attempts per batch before the sender gives up on it (about 30 s)


@dataclass
class SendReport:
    """What was sent and what the collector answered."""

    batches: int = 0
    rows_sent: Counter = field(default_factory=Counter)  # by table, every batch posted
    rows: Counter = field(default_factory=Counter)  # by table, acknowledged (202)
    points: int = 0  # non-null numeric values acknowledged
    bytes: int = 0
    latencies_s: list[float] = field(default_factory=list)  # per acknowledged request
    retries: int = 0
    rejected: list[str] = field(default_factory=list)  # the collector's reason, per batch
    # Given up on after RETRY_LIMIT attempts: no answer (a refused connection) or only
    # retryable ones (503). Not a rejection: the collector never said no.
    undelivered: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0

    def summary(self) -> str:
        lat = np.percentile(self.latencies_s, [50, 99]) * 1e3 if self.latencies_s else (0, 0)
        rate = self.points / self.elapsed_s if self.elapsed_s else 0.0
        rows = ", ".join(f"{n:,} {t}" for t, n in sorted(self.rows.items()))
        return (
            f"{self.batches:,} batches ({self.bytes / 1e6:,.0f} MB) in {self.elapsed_s:.1f} s: "
            f"{rows}; {self.points:,} points, {rate:,.0f} points/s; request latency p50 "
            f"{lat[0]:.0f} ms, p99 {lat[1]:.0f} ms; {self.retries} retries, "
            f"{len(self.rejected)} rejected, {len(self.undelivered)} not delivered"
        )


def points(doc: dict[str, Any]) -> int:
    """Numeric values in a document: one per non-null cell of an int64 or float64 field."""
    total = 0
    for name, spec in TABLES.items():
        for col, values in doc.get(name, {}).items():
            if spec.by_name[col].dtype == "string":
                continue
            if isinstance(values, list):
                total += sum(v is not None for v in values)
            else:
                total += len(values) - getattr(values, "null_count", 0)
    return total


def rows(doc: dict[str, Any]) -> Counter:
    return Counter({name: len(next(iter(doc[name].values()))) for name in TABLES if name in doc})


def merge(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """One document holding the rows of `docs` (one run), in order; absent columns -> null."""
    if len(docs) == 1:
        return docs[0]
    out = {k: docs[0][k] for k in ("schema_version", "run_id")}
    for name, spec in TABLES.items():
        parts = [d[name] for d in docs if name in d]
        if not parts:
            continue
        sizes = [len(next(iter(p.values()))) for p in parts]
        present = [f for f in spec.fields if any(f.name in p for p in parts)]
        out[name] = {f.name: _concat(f, [p.get(f.name) for p in parts], sizes) for f in present}
    return out


def _concat(f: Any, columns: list, sizes: list[int]) -> Any:
    if all(isinstance(c, list) for c in columns):
        return [v for c in columns for v in c]
    if all(isinstance(c, np.ndarray) for c in columns):
        return np.concatenate(columns)
    arrow_type = pa.type_for_alias(DTYPES[f.dtype][1])
    return pa.concat_arrays(
        [
            pa.nulls(n, arrow_type) if c is None else pa.array(c, type=arrow_type)
            for c, n in zip(columns, sizes, strict=True)
        ]
    )


def batches(
    docs: Iterable[dict[str, Any]], batch_points: int, deadline: float | None = None
) -> Iterator[list[dict[str, Any]]]:
    """Consecutive documents of one run, grouped into lists of about `batch_points` values."""
    group: list[dict[str, Any]] = []
    size = 0
    for doc in docs:
        if deadline is not None and time.monotonic() >= deadline:
            break
        if group and doc["run_id"] != group[0]["run_id"]:
            yield group
            group, size = [], 0
        group.append(doc)
        size += points(doc)
        if size >= batch_points:
            yield group
            group, size = [], 0
    if group:
        yield group


def send(
    docs: Iterable[dict[str, Any]],
    url: str,
    *,
    connections: int = 4,
    batch_points: int = 250_000,
    token: str = "",
    wire: str = "msgpack",
    duration_s: float | None = None,
    rate: float | None = None,
    timeout_s: float = 60.0,
    attempts: int | None = None,
) -> SendReport:
    """POST `docs` to the collector at `url`; returns once every batch is answered.

    `rate` paces sending to about that many points per second (None: as fast as the
    collector takes them); `duration_s` stops taking documents after that many seconds.
    """
    import httpx

    if connections < 1 or batch_points < 1:
        raise ValueError("send: connections and batch_points must be >= 1")
    if rate is not None and rate <= 0:
        raise ValueError(f"send: rate must be > 0 points/s, got {rate}")
    if wire not in ("msgpack", "json"):
        raise ValueError(f"send: wire must be 'msgpack' or 'json', got {wire!r}")
    checks.http_url("collector URL", url)  # here, not as a traceback in every worker thread
    encode = encode_msgpack if wire == "msgpack" else encode_json
    headers = {"content-type": f"application/{wire}"}
    if token:
        headers["authorization"] = f"Bearer {token}"
    report = SendReport()
    lock = threading.Lock()
    work: queue.Queue = queue.Queue(maxsize=2 * connections)  # bounded: memory stays flat
    endpoint = url.rstrip("/") + "/api/v1/ingest"

    def worker() -> None:
        with httpx.Client(timeout=timeout_s, headers=headers) as client:
            while (item := work.get()) is not _STOP:
                posted = post_batch(client, endpoint, item[0], attempts)
                with lock:
                    _account(report, item, posted)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(connections)]
    for t in threads:
        t.start()
    start = time.monotonic()
    deadline = None if duration_s is None else start + duration_s
    offered = 0
    try:
        for group in batches(docs, batch_points, deadline):
            doc = merge(group)
            item = (encode(doc), rows(doc), points(doc))
            if rate is not None:  # this batch leaves when the rate allows it
                time.sleep(max(0.0, start + offered / rate - time.monotonic()))
            offered += item[2]
            report.rows_sent.update(item[1])  # only this thread writes rows_sent
            work.put(item)
    finally:
        for _ in threads:
            work.put(_STOP)
        for t in threads:
            t.join()
    report.elapsed_s = time.monotonic() - start
    return report


@dataclass(frozen=True)
class Posted:
    """How one batch fared: `post_batch`'s answer."""

    outcome: str  # 'ok'; 'rejected' (refused, resending cannot help); 'failed' (gave up)
    seconds: float  # of the last attempt; 0 when it got no answer
    retries: int
    status: int | None = None  # of the last answer; None: no answer (a network error)
    reason: str = ""  # the collector's detail, or the network error

    @property
    def detail(self) -> str:
        return self.reason if self.status is None else f"{self.status}: {self.reason}"


def retryable(status: int) -> bool:
    """A status that a later resend can turn into a success: the collector failed or is
    behind (5xx; 503 when its write queue is full), or timed out or throttled (408, 429)."""
    return status >= 500 or status in (408, 429)


def post_batch(client: Any, endpoint: str, body: bytes, attempts: int | None = None) -> Posted:
    """POST one encoded batch; resend it after a back-off while the failure is one a resend
    can cure (a network error, a retryable status), `attempts` in all at most (RETRY_LIMIT,
    about 30 s; each further one 2 s more). The collector's keys make a resend of a stored
    batch a no-op."""
    import httpx

    status, reason = None, ""
    attempts = attempts or RETRY_LIMIT
    for attempt in range(attempts):
        if attempt:
            time.sleep(min(2.0, 0.05 * 2 ** (attempt - 1)))  # the collector is behind: back off
        began = time.perf_counter()
        try:
            resp = client.post(endpoint, content=body)
        except httpx.HTTPError as e:
            status, reason = None, str(e) or type(e).__name__
            continue
        took = time.perf_counter() - began
        if resp.status_code < 300:
            return Posted("ok", took, attempt)
        status, reason = resp.status_code, _reason(resp)
        if not retryable(resp.status_code):
            return Posted("rejected", took, attempt, status, reason)
    return Posted("failed", 0.0, attempts - 1, status, reason)


def _reason(resp: Any) -> str:
    """The collector's `detail`, else the body."""
    try:
        doc = resp.json()
    except ValueError:
        doc = None
    if isinstance(doc, dict) and "detail" in doc:
        return str(doc["detail"])
    return resp.text or resp.reason_phrase


def _account(report: SendReport, item: tuple, posted: Posted) -> None:
    body, n_rows, n_points = item
    report.retries += posted.retries
    if posted.outcome == "rejected":
        report.rejected.append(posted.detail)
        return
    if posted.outcome == "failed":
        report.undelivered.append(posted.detail)
        return
    report.batches += 1
    report.rows.update(n_rows)
    report.points += n_points
    report.bytes += len(body)
    report.latencies_s.append(posted.seconds)
