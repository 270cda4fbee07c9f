"""The DuckDB store: one connection per process, one writer thread, cursors for readers.

Ingest hands validated Arrow tables to `submit`, which enqueues them and returns a future.
The writer thread wakes as soon as a batch is queued, takes every batch waiting behind it
too (a group commit) and appends them with one INSERT per table in one transaction, then
completes their futures: ingest answers only once the future says its batch is committed,
so an acknowledged batch survives a kill -9 of the collector. If a group fails, its
batches are retried one by one, so that one bad batch fails alone and every batch is
still stored whole or not at all. `INSERT OR IGNORE` on each table's key makes a resent
batch a no-op, also when the first copy is in the same group. Only the rows the store
added go on to the commit listeners, so none sees a resend's values where the store kept
the first copy's.

Commit listeners (`listen`) hear of every commit, in commit order, on the writer thread,
before the batch is acknowledged: the collector's lifespan (main.py) makes the live state
behind /metrics (state.py) one and the live analysis (analyzer/live.py) another, which
runs the detectors behind the writer, not in the commit. The store itself counts only
its writes (`writes`).
"""

from __future__ import annotations

import logging
import queue
import re
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import duckdb
import numpy as np
import pyarrow as pa

from trainvitals.schema import DTYPES, STORE_TABLES, Table, ddl

from .memory import DEFAULT_MEMORY_LIMIT, memory_limit_bytes

log = logging.getLogger(__name__)


RETENTION_CHECK_S = 3600.0  # how often an idle writer looks for expired runs
# How often a writer whose store failed for want of storage tries to reopen it. A try is an
# ATTACH (a few ms; it replays the write-ahead log, so nothing committed is lost).
HEAL_RETRY_S = 1.0
GROUP_MAX_BATCHES = 256  # batches committed together at most (one transaction)
# Rows per row group of the store. DuckDB writes the rows a transaction appends to a table
# straight to the database file, compressed, once they fill a row group (an "optimistic
# write"); smaller appends go to the write-ahead log, and every 16 MB of log a checkpoint
# compresses them again, inside a commit. With DuckDB's default 122,880-row groups every
# commit of a few thousand-rank steps took that path: 2.5x the CPU per row, and a
# checkpoint stall every few commits. At 4,096 rows, a group commit of 8,192 ranks rows
# commits in 80 ms (p99 115 ms, against 75 and 200 ms at 16,384) and queries slow by
# under 10% (bench/ingest.py, docs/scaling.md).
ROW_GROUP_SIZE = 4096
_DB = "store"  # the store's name in the connection's catalog


class StoreError(RuntimeError):
    """The store cannot be opened or written."""


class Unavailable(StoreError):
    """The store cannot take a batch now; the sender should retry later (503)."""


class QueueFull(Unavailable):
    """The writer is behind."""


class Unwritable(Unavailable):
    """The store's last write failed for want of storage (a full disk); it heals by itself."""


_STOP = object()


class CommitListener(Protocol):
    """Hears of what the store commits, on the writer thread, in commit order."""

    def committed(self, run_id: str, tables: dict[str, pa.Table]) -> None:
        """The rows one commit added for `run_id` (a resend's rows the store ignored are
        not among them), before the batch is acknowledged: whoever hears the answer sees
        it in every listener. May block: the writer waits, and ingest with it."""
        ...

    def forget(self, run_ids: list[str]) -> None:
        """Retention deleted these runs."""
        ...

    def drain(self, timeout_s: float) -> bool:
        """Finish with everything committed so far; False on timeout (`Store.flush`)."""
        ...

    def close(self, timeout_s: float) -> None:
        """The writer has stopped; the store's connection closes after this returns."""
        ...


@dataclass
class WriteStats:
    """The writer's own counts (exported as trainvitals_collector_*)."""

    written_batches: int = 0
    write_seconds_sum: float = 0.0
    write_errors: int = 0
    commits: int = 0  # transactions: written_batches / commits is the group commit's size
    # Rows not stored because their key holds other values (the first copy stays), by table.
    changed_rows: Counter = field(default_factory=Counter)


class Store:
    """Persistence (one writer thread, group commits) plus commit listeners (`listen`)."""

    def __init__(
        self,
        path: str,
        *,
        read_only: bool = False,
        queue_max_batches: int = 1024,
        retention_days: float = 0,
        memory_limit: str = DEFAULT_MEMORY_LIMIT,
    ) -> None:
        self.path = path
        self.read_only = read_only
        try:
            limit_bytes = memory_limit_bytes(memory_limit)
        except ValueError as e:
            raise StoreError(str(e)) from e
        try:
            self._con = _open_read_only(path) if read_only else _open_writable(path)
            self._con.execute(f"SET memory_limit = '{limit_bytes // 2**10}KiB'")
        except duckdb.Error as e:
            raise StoreError(damaged(path, e)) from e
        try:
            if not read_only:
                self._create_tables()
            self._read_every_table()
        except duckdb.Error as e:  # a file cut short opens, then fails on its first read
            self._con.close()
            raise StoreError(damaged(path, e)) from e
        self._listeners: list[CommitListener] = []
        self._writes = WriteStats()
        self._writes_lock = threading.Lock()
        self.retention_days = retention_days
        self._queue: queue.Queue = queue.Queue(maxsize=queue_max_batches)
        self._writer: threading.Thread | None = None
        # Why the store cannot take writes (a full disk), or None: /readyz and /metrics.
        self.unwritable: str | None = None

    def _create_tables(self) -> None:
        for table in STORE_TABLES.values():
            self._con.execute(ddl(table))
            self._add_missing_columns(table)

    def _read_every_table(self) -> None:
        """A file cut short opens, then fails on its first read: read now, so that a
        damaged store is named when it is opened, not at some later query."""
        for name in STORE_TABLES:
            self._con.execute(f"SELECT count(run_id) FROM {name}").fetchall()

    def _add_missing_columns(self, table: Table) -> None:
        """A store made before a field was added gains it (as a nullable column)."""
        have = {r[0] for r in self._con.execute(f"DESCRIBE {table.name}").fetchall()}
        for f in table.fields:
            if f.name not in have:
                self._con.execute(
                    f"ALTER TABLE {table.name} ADD COLUMN {f.name} {DTYPES[f.dtype][0]}"
                )

    # ------------------------------------------------------------------ writing

    def listen(self, listener: CommitListener) -> None:
        """Tell `listener` of every commit from now on (call before `start`)."""
        self._listeners.append(listener)

    def start(self) -> None:
        if self.read_only:
            return
        self._writer = threading.Thread(
            target=self._write_loop, name="trainvitals-writer", daemon=True
        )
        self._writer.start()

    def submit(self, run_id: str, tables: dict[str, pa.Table]) -> Future:
        """Queue one validated batch; the future completes once it is committed.

        Raises Unavailable when the writer is behind or the disk full. The future's result
        is None, or per table the rows left out because their key holds other values; it
        fails with StoreError if the batch could not be written (nothing of it is stored).
        """
        if self.read_only:
            raise StoreError("store is open read-only (replay mode)")
        if self.unwritable is not None:
            raise Unwritable(f"the store cannot take writes: {self.unwritable}")
        done: Future = Future()
        try:
            self._queue.put_nowait((run_id, tables, done))
        except queue.Full as e:
            raise QueueFull(f"write queue is full ({self._queue.maxsize} batches)") from e
        return done

    @property
    def writes(self) -> WriteStats:
        """A copy of the writer's counts so far."""
        with self._writes_lock:
            w = self._writes
            return replace(w, changed_rows=Counter(w.changed_rows))

    def _count_write(self, seconds: float | None, batches: int = 1) -> None:
        """`batches` written in one commit (taking `seconds`), or one failed (None)."""
        with self._writes_lock:
            if seconds is None:
                self._writes.write_errors += 1
            else:
                self._writes.written_batches += batches
                self._writes.commits += 1
                self._writes.write_seconds_sum += seconds

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    @property
    def unwritten_batches(self) -> int:
        """Batches submitted and not yet written and handed to the commit listeners."""
        return self._queue.unfinished_tasks

    @property
    def queue_capacity(self) -> int:
        """Batches the write queue holds at most (beyond: QueueFull)."""
        return self._queue.maxsize

    def cursor(self) -> duckdb.DuckDBPyConnection:
        """A cursor of the store's connection, for one thread (cursors are per thread)."""
        cur = self._con.cursor()
        if not self.read_only:
            cur.execute(f"USE {_DB}")  # a cursor starts in the connection's in-memory catalog
        return cur

    def _write_loop(self) -> None:
        self._cur = self.cursor()
        self.drop_expired(self._cur)
        while True:
            try:
                wait_s = RETENTION_CHECK_S if self.unwritable is None else HEAL_RETRY_S
                item = self._queue.get(timeout=wait_s)
            except queue.Empty:
                if self.unwritable is not None:
                    self._heal()
                else:
                    self.drop_expired(self._cur)  # an idle writer is the one that prunes
                continue
            if item is _STOP:
                self._queue.task_done()
                return
            group = [item]
            # Take whatever else is waiting: fewer, larger transactions.
            while len(group) < GROUP_MAX_BATCHES:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is _STOP:
                    self._write(group)
                    self._queue.task_done()
                    return
                group.append(nxt)
            self._write(group)

    def _write(self, group: list[tuple]) -> None:
        start = time.perf_counter()
        stored: list[tuple] = []
        try:
            if self.unwritable is not None and not self._heal():
                raise Unwritable(self.unwritable)
            durable: list[Exception] = []
            changed = [{} for _ in group]
            added = _append(self._cur, [tables for _, tables, _ in group], durable, changed)
            pairs = zip(group, added, changed, strict=True)
            stored = [(run_id, rows, done, ch) for (run_id, _, done), rows, ch in pairs]
            if durable:  # committed, then the checkpoint after it failed: heal before more
                self._lost_storage(durable[0])
        except Exception as e:
            if isinstance(e, Unwritable) or _out_of_storage(e):
                # Every batch would fail alike: each is refused, and the store heals first.
                if self.unwritable is None:
                    self._lost_storage(e)
                for item in group:
                    self._failed(item, e)
            elif len(group) == 1:
                self._failed(group[0], e)
            else:  # find the bad batch: the others still land, each whole
                stored = [ok for item in group if (ok := self._write_one(self._cur, item))]
        seconds = time.perf_counter() - start
        # Only the rows the store added go on: a resent key keeps its first copy in the
        # store, so /metrics and the analyzer must not see the resend's values either.
        if stored:
            self._count_write(seconds, batches=len(stored))
        for run_id, rows, done, changed in stored:
            if changed:
                # Same key, other values: the store keeps the first copy. Counted, and the
                # sender is told (ingest's answer), never acknowledged as if stored.
                with self._writes_lock:
                    self._writes.changed_rows.update(changed)
                log.warning("run %s: rows not stored, their keys hold other values: %s",
                            run_id, changed)  # fmt: skip
            for listener in self._listeners:
                listener.committed(run_id, rows)  # the live analysis waits if far behind
            done.set_result(changed or None)  # None: every row stored as sent
        for _ in group:
            self._queue.task_done()

    def _write_one(self, cur: duckdb.DuckDBPyConnection, item: tuple) -> tuple | None:
        """(run_id, rows added, future) once `item` is stored; None if it failed."""
        run_id, tables, done = item
        try:
            durable: list[Exception] = []
            changed: list[dict[str, int]] = [{}]
            (added,) = _append(cur, [tables], durable, changed)
            if durable:
                self._lost_storage(durable[0])
            return run_id, added, done, changed[0]
        except Exception as e:
            self._failed(item, e)
            return None

    def _failed(self, item: tuple, error: Exception) -> list:
        # Counted and exported (trainvitals_collector_write_errors_total); the sender hears
        # of it and resends; later batches still land.
        run_id, _, done = item
        if isinstance(error, Unwritable):
            log.warning("batch of run %s not stored: %s", run_id, error)
        else:
            log.exception("writing a batch of run %s failed", run_id)
        self._count_write(None)
        done.set_exception(StoreError(f"batch not stored: {_cause(error)}"))
        return []

    def _lost_storage(self, error: Exception) -> None:
        """A write failed for want of storage: refuse writes (503) until `_heal` works."""
        self.unwritable = f"disk full or unwritable ({_cause(error)})"
        log.error("store %s cannot take writes: %s; retrying every %g s",
                  self.path, self.unwritable, HEAL_RETRY_S)  # fmt: skip

    def _heal(self) -> bool:
        """Reopen the store after a failed write (DuckDB refuses every statement once a
        checkpoint has failed, until the database is attached again). Attaching replays
        the write-ahead log: every acknowledged batch is there. True once writable."""
        try:
            self._cur.close()
            fresh = self._con.cursor()  # in the in-memory catalog: the store can be detached
            fresh.execute(f"DETACH DATABASE IF EXISTS {_DB}")
            _attach(fresh, self.path)
            fresh.close()
            self._cur = self.cursor()
            self._cur.execute("CHECKPOINT")  # space for the log's rows, or fail here
        except duckdb.Error as e:
            self.unwritable = f"disk full or unwritable ({_cause(e)})"
            return False
        log.warning("store %s takes writes again", self.path)
        self.unwritable = None
        return True

    def drop_expired(self, cur: duckdb.DuckDBPyConnection | None = None) -> list[str]:
        """Delete every row of runs whose last step is older than `retention_days`."""
        if not self.retention_days or self.read_only:
            return []
        cur = cur or self.cursor()
        cutoff = time.time() - self.retention_days * 86_400
        expired = [r[0] for r in cur.execute(
            "SELECT run_id FROM (SELECT run_id, max(time_unix_s) AS t FROM steps GROUP BY run_id "
            "UNION ALL SELECT run_id, started_unix_s FROM runs) GROUP BY run_id HAVING max(t) < ?",
            [cutoff],
        ).fetchall()]  # fmt: skip
        if expired:
            cur.execute("BEGIN")
            for table in STORE_TABLES:
                cur.execute(f"DELETE FROM {table} WHERE list_contains(?, run_id)", [expired])
            cur.execute("COMMIT")
            for listener in self._listeners:
                listener.forget(expired)
            log.info(
                "retention: dropped %d runs older than %g days", len(expired), self.retention_days
            )
        return expired

    def flush(self, timeout_s: float = 10.0) -> None:
        """Block until everything submitted so far is written and every commit listener has
        finished with it (analysed, for the live analysis): tests, shutdown."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                raise StoreError("flush timed out")
            time.sleep(0.01)
        if self._writer is None:
            return
        for listener in self._listeners:
            if not listener.drain(deadline - time.monotonic()):
                raise StoreError(f"flush timed out waiting for {type(listener).__name__}")

    def close(self, timeout_s: float = 30.0) -> None:
        if self._writer is not None:
            self._queue.put(_STOP)
            self._writer.join(timeout_s)
            if self._writer.is_alive():
                log.error(
                    "writer did not finish within %.0f s; unwritten batches are lost", timeout_s
                )
        for listener in self._listeners:
            listener.close(timeout_s)
        self._con.close()

    # ------------------------------------------------------------------ reading

    def query(self, sql: str, params: list[Any] | None = None) -> pa.Table:
        """Run a read query on a cursor of its own (cursors are per thread in DuckDB)."""
        cur = self.cursor()
        try:
            return cur.sql(sql, params=params or None).to_arrow_table()
        finally:
            cur.close()


def damaged(path: str, error: Exception) -> str:
    """One line for a store that cannot be opened or read: the file, the cause, what to do."""
    cause = str(error).splitlines()[0] if str(error) else type(error).__name__
    if "Conflicting lock" in cause:  # not damaged: another process has it open for writing
        holder = re.search(r"PID (\d+)", cause)
        who = f"process {holder.group(1)}" if holder else "another process"
        return (
            f"store {path!r} is held open by {who}, most likely a running collector: DuckDB "
            "lets no other process open a store while one writes it. Read it through that "
            "collector's API (or `trainvitals dashboard --collector URL`), or stop the "
            "collector first; the store is not damaged"
        )
    corrupt = duckdb.IOException | duckdb.SerializationException | duckdb.InternalException
    if not (isinstance(error, corrupt) and Path(path).is_file()):
        return f"cannot open store {path!r}: {cause}"
    return (
        f"store {path!r} is damaged (truncated or corrupt: {cause}). Restore it from a "
        f"backup or an export, or move it aside (mv {path} {path}.damaged) to start an "
        "empty store there"
    )


def _out_of_storage(error: BaseException) -> bool:
    """True if `error` (or what it was raised in handling of) is a failed write of the file:
    a full disk, or the database DuckDB invalidated after a failed checkpoint."""
    while error is not None:
        text = str(error)
        if "No space left" in text or "has been invalidated" in text or "Could not write" in text:
            return True
        error = error.__context__
    return False


def _cause(error: BaseException) -> str:
    """The first line of the error that started it (not 'cannot rollback' after it)."""
    while error.__context__ is not None and _out_of_storage(error.__context__):
        error = error.__context__
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    return text[:300]


def _open_writable(path: str) -> duckdb.DuckDBPyConnection:
    """The store file, attached with ROW_GROUP_SIZE-row groups (see above) as the default."""
    file = Path(path)
    if file.is_file() and file.stat().st_size == 0:
        # Left by a start that failed on a full disk (DuckDB creates the file, then cannot
        # write its header); it holds nothing, and DuckDB refuses to open it.
        log.warning("store %s is an empty file, left by a failed start: made anew", path)
        file.unlink()
    existed = file.exists()
    con = duckdb.connect()
    quoted = path.replace("'", "''")
    # Spill files next to the store, as DuckDB puts them for a database opened directly.
    con.execute(f"SET temp_directory = '{quoted}.tmp'")
    try:
        _attach(con, path)
    except duckdb.Error:
        con.close()
        if not existed:  # no empty file behind, for the next start to refuse
            file.unlink(missing_ok=True)
            Path(f"{path}.wal").unlink(missing_ok=True)
        raise
    return con


def _attach(con: duckdb.DuckDBPyConnection, path: str) -> None:
    quoted = path.replace("'", "''")
    con.execute(f"ATTACH '{quoted}' AS {_DB} (ROW_GROUP_SIZE {ROW_GROUP_SIZE})")
    con.execute(f"USE {_DB}")


def _open_read_only(path: str) -> duckdb.DuckDBPyConnection:
    """An in-memory database with one view per table over a DuckDB store (attached
    read-only) or over a Parquet export (a directory, see collector/export.py).

    A store written by an older version lacks newer columns (or tables), and a read-only
    source cannot gain them: the views fill them with NULL, so every query of this version
    runs on it. Views live in the in-memory database, so every cursor sees them.
    """
    if Path(path).is_dir() and not is_export(Path(path)):
        # Else a typo in a path would serve an empty store: an empty dashboard, no error.
        raise StoreError(
            f"{path} is not a trainvitals export: no table folder ({', '.join(STORE_TABLES)}); "
            "`trainvitals export STORE OUT` writes OUT/<table>/run_id=<id>/*.parquet. To "
            "serve a store, name its DuckDB file"
        )
    con = duckdb.connect()
    quoted = path.replace("'", "''")
    if Path(path).is_dir():
        sources = {t: _parquet_source(Path(path), t) for t in STORE_TABLES}
    elif Path(path).is_file():
        con.execute(f"ATTACH '{quoted}' AS stored (READ_ONLY)")
        listed = "SELECT table_name FROM duckdb_tables() WHERE database_name = 'stored'"
        tables = {r[0] for r in con.execute(listed).fetchall()}
        sources = {t: f"stored.main.{t}" if t in tables else None for t in STORE_TABLES}
    else:
        raise duckdb.IOException(f"no such file or directory: {path}")
    for table in STORE_TABLES.values():
        source = sources[table.name]
        have = set()
        if source is not None:
            have = {r[0] for r in con.execute(f"DESCRIBE SELECT * FROM {source}").fetchall()}
        cols = ["run_id" if "run_id" in have else "NULL::VARCHAR AS run_id"]
        for f in table.fields:
            cols.append(f.name if f.name in have else f"NULL::{DTYPES[f.dtype][0]} AS {f.name}")
        con.execute(
            f"CREATE VIEW {table.name} AS SELECT {', '.join(cols)} "
            f"FROM {source or '(SELECT 1)'}" + ("" if source else " WHERE false")
        )
    return con


def is_export(path: Path) -> bool:
    """True if `path` is laid out as an export: a folder per table, run_id=<id> inside."""
    return path.is_dir() and any((path / t).is_dir() for t in STORE_TABLES)


def _parquet_source(root: Path, table: str) -> str | None:
    """read_parquet over a table's hive partitions (run_id=...), or None if it has none."""
    if not any((root / table).glob("*/*.parquet")):
        return None
    pattern = str(root / table / "*" / "*.parquet").replace("'", "''")
    return f"read_parquet('{pattern}', hive_partitioning = true, union_by_name = true)"


def _append(
    cur: duckdb.DuckDBPyConnection,
    batches: list[dict[str, pa.Table]],
    durable: list,
    changed: list[dict[str, int]],
) -> list[dict[str, pa.Table]]:
    """One transaction for every batch of `batches` together; per batch, the rows it added.

    A batch adds all its rows, unless a key is stored already (a resend) or came earlier in
    the group: that row is left out, as the store keeps the first copy. A commit that
    succeeded although the checkpoint after it failed returns, its error put in `durable`.
    `changed[i]` gets, per table, the rows of batch i left out whose key the store holds
    with other values (a resend of the same values is not counted).
    """
    try:
        with _transaction(cur, durable):
            for name, arrow in _merged(batches).items():
                _insert(cur, name, arrow)
        return batches
    except duckdb.ConstraintException:
        # Rarely so: plain INSERT first, as finding out which rows are new costs about
        # twice the CPU per row even when nothing conflicts.
        with _transaction(cur, durable):
            added = _insert_new(cur, batches, changed)
        return added


def _merged(batches: list[dict[str, pa.Table]]) -> dict[str, pa.Table]:
    """table name -> the rows of every batch, in batch order."""
    by_table: dict[str, list[pa.Table]] = {}
    for tables in batches:
        for name, arrow in tables.items():
            by_table.setdefault(name, []).append(arrow)
    return {
        n: p[0] if len(p) == 1 else _one_chunk(pa.concat_tables(p)) for n, p in by_table.items()
    }


def _one_chunk(table: pa.Table) -> pa.Table:
    """`table` in one chunk if its chunks are small. DuckDB scans an Arrow table chunk by
    chunk, at about 80 us a chunk: 3,000 batches of 4 rows took 251 ms to insert as they
    came, 4.4 ms copied into one chunk first (0.6 ms for 256 batches). Large chunks cost
    more to copy than to scan."""
    chunks = max(c.num_chunks for c in table.columns) if table.num_columns else 0
    return table.combine_chunks() if table.num_rows < chunks * 1024 else table


@contextmanager
def _transaction(cur: duckdb.DuckDBPyConnection, durable: list) -> Iterator[None]:
    cur.execute("BEGIN")
    try:
        yield
    except Exception:
        cur.execute("ROLLBACK")
        raise
    try:
        cur.execute("COMMIT")
    except duckdb.Error as e:
        # "Transaction COMMIT succeeded and is durable, but the autocheckpoint failed": the
        # rows are stored (the write-ahead log holds them), the database is not usable until
        # attached again. Acknowledged, as stored; anything else is a failed commit.
        if "succeeded and is durable" in str(e):
            durable.append(e)
            return
        with suppress(duckdb.Error):  # DuckDB has usually ended the transaction already
            cur.execute("ROLLBACK")
        raise


def _insert(cur: duckdb.DuckDBPyConnection, name: str, arrow: pa.Table) -> None:
    cols = ", ".join(arrow.column_names)
    # Not unregistered on failure: that is a statement, refused in an aborted transaction
    # (the next register replaces the view).
    cur.register("incoming", arrow)
    cur.execute(f"INSERT INTO {name} ({cols}) SELECT {cols} FROM incoming")
    cur.unregister("incoming")


def _insert_new(
    cur: duckdb.DuckDBPyConnection,
    batches: list[dict[str, pa.Table]],
    changed: list[dict[str, int]],
) -> list[dict[str, pa.Table]]:
    """Insert the first copy of each key the store does not hold yet; return, per batch,
    the rows that went in, in the batch's own schema (what /metrics and the analyzer see).
    `changed[i][table]`: rows of batch i left out whose key is stored with other values."""
    added = [dict(tables) for tables in batches]
    for name, tagged in _merged([_tagged(i, t) for i, t in enumerate(batches)]).items():
        several = sum(name in tables for tables in batches) > 1
        rows = _insert_first_copies(cur, name, tagged, several)
        for i, tables in enumerate(batches):
            if name in tables:
                added[i][name] = tables[name].take(rows["_row"][rows["_batch"] == i])
        for i, n in _changed_rows(cur, name, tagged):
            changed[i][name] = n
    return added


def _changed_rows(
    cur: duckdb.DuckDBPyConnection, name: str, tagged: pa.Table
) -> list[tuple[int, int]]:
    """(batch, rows) of `tagged` whose key the store holds with other values. Only after a
    conflict, as INSERT OR IGNORE: a join on the key, about as costly as the insert."""
    table = STORE_TABLES[name]
    values = [c for c in tagged.column_names if c not in (*table.key, "_batch", "_row")]
    if not values:
        return []
    # NaN is not distinct from NaN in DuckDB: a resent NaN loss is the same value.
    differ = " OR ".join(f"i.{c} IS DISTINCT FROM t.{c}" for c in values)
    cur.register("incoming", tagged)
    try:
        return cur.execute(
            f"SELECT i._batch, count(*) FROM incoming i JOIN {name} t USING "
            f"({', '.join(table.key)}) WHERE {differ} GROUP BY i._batch"
        ).fetchall()
    finally:
        cur.unregister("incoming")


def _insert_first_copies(
    cur: duckdb.DuckDBPyConnection, name: str, tagged: pa.Table, several: bool
) -> dict[str, np.ndarray]:
    """INSERT OR IGNORE the rows of `tagged` (from `several` batches or one); returns the
    `_batch` and `_row` of the rows the store added."""
    key = ", ".join(STORE_TABLES[name].key)
    cols = ", ".join(c for c in tagged.column_names if c not in ("_batch", "_row"))
    # Ingest refuses a batch that holds a key twice, so only several batches can: then the
    # first copy in group order goes in. The window costs more than the INSERT itself (0.6
    # against 0.4 s for 200,000 rows), so a single batch goes without.
    first = f"QUALIFY row_number() OVER (PARTITION BY {key} ORDER BY _batch, _row) = 1"
    first = first if several else ""
    cur.register("incoming", tagged)  # as in _insert: not unregistered on failure
    stored_keys = cur.sql(
        f"INSERT OR IGNORE INTO {name} ({cols}) SELECT {cols} FROM incoming {first} RETURNING {key}"
    ).to_arrow_table()
    cur.register("stored_keys", stored_keys)
    rows = cur.sql(
        f"SELECT _batch, _row FROM incoming SEMI JOIN stored_keys USING ({key}) {first} "
        "ORDER BY _batch, _row"
    ).fetchnumpy()
    cur.unregister("incoming")
    cur.unregister("stored_keys")
    return rows


def _tagged(batch: int, tables: dict[str, pa.Table]) -> dict[str, pa.Table]:
    """Each table with its batch's index and each row's index within the batch."""
    out = {}
    for name, arrow in tables.items():
        n = arrow.num_rows
        tagged = arrow.append_column("_batch", pa.repeat(pa.scalar(batch, pa.int32()), n))
        out[name] = tagged.append_column("_row", pa.array(np.arange(n, dtype=np.int64)))
    return out
