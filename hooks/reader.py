"""The export reader: the queue between the training thread and its exporter, and the thread
that empties it (OpenTelemetry's periodic reader, for logged steps and events).

The training thread only puts: a logged step in flight (reducer.Pending) or an event row,
never blocking; a full queue drops the item and counts it. The thread waits for each step's
reductions, turns them into columns (rank 0: steps and layers rows; every node's leader:
its node's ranks rows; records.py) and exports a batch every `interval_s`, an event at
once. `flush` and `close` block their caller: they are for the end of a process.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from .exporter import Exporter
from .records import RANK_SLOT, VectorLayout, add_ranks, add_step, release_unix_s
from .reducer import Pending
from .topology import Node
from .wire import ColumnBatch

log = logging.getLogger(__name__)


@dataclass
class _Event:
    row: dict[str, Any]


@dataclass
class _RunsRow:
    """The run's metadata, sent after the reader started (it waited for a FLOP count)."""

    row: dict[str, Any]


@dataclass
class _Flush:
    """Export what is queued before this at once, then set `done`."""

    done: threading.Event


_STOP = object()


class ExportReader:
    """Owns the export queue, thread, interval, flush and close (module docstring).

    `runs_row`: the run's metadata, exported first by rank 0 (None on other ranks)."""

    def __init__(
        self,
        exporter: Exporter,
        run_id: str,
        *,
        rank: int,
        node: Node,
        layout: VectorLayout,
        world_size: int,
        interval_s: float,
        queue_size: int,
        runs_row: dict[str, Any] | None = None,
    ) -> None:
        self.exporter = exporter
        self.run_id = run_id
        self.rank = rank
        self.node = node
        self.layout = layout
        self.world_size = world_size
        self.interval_s = interval_s
        self.dropped_steps = 0  # logged steps and events refused by a full queue
        self.failed_exports = 0  # batches an exporter raised on (one that cannot encode them)
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._thread = threading.Thread(
            target=self._loop, args=(runs_row,), name="trainvitals-export", daemon=True
        )
        self._thread.start()

    @property
    def dropped(self) -> int:
        """Logged steps dropped on a full queue, plus batches the exporter could not keep
        or raised on."""
        dropped_batches = getattr(self.exporter, "dropped_batches", 0)
        return self.dropped_steps + dropped_batches + self.failed_exports

    def put(self, pending: Pending) -> None:
        """Hand over a logged step in flight. Never blocks."""
        try:
            self._queue.put_nowait(pending)
        except queue.Full:
            self.dropped_steps += 1  # exported as a counter; training never blocks on us

    def event(self, kind: str, step: int, rank: int = -1, detail: dict | None = None) -> None:
        """Record an event (an injected fault, a restart, a checkpoint). Never blocks."""
        row = {
            "step": step,
            "rank": rank,
            "kind": kind,
            "detail": json.dumps(detail or {}),
            "time_unix_s": time.time(),
        }
        try:
            self._queue.put_nowait(_Event(row))
        except queue.Full:
            self.dropped_steps += 1

    def runs_row(self, row: dict[str, Any]) -> None:
        """Export the run's metadata (rank 0, once) with the next batch. Never blocks."""
        try:
            self._queue.put_nowait(_RunsRow(row))
        except queue.Full:
            self.dropped_steps += 1

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Export every step and event queued so far and wait (up to `timeout_s`) until the
        exporter has taken them (and its own force_flush). True if done in time."""
        done = threading.Event()
        try:
            self._queue.put(_Flush(done), timeout=timeout_s)
        except queue.Full:
            return False
        return done.wait(timeout_s)

    def close(self, timeout_s: float = 30.0) -> None:
        """Export what is queued, stop the thread and shut the exporter down."""
        try:
            self._queue.put(_STOP, timeout=timeout_s)
        except queue.Full:
            log.warning("trainvitals export queue stayed full for %.0f s at close", timeout_s)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("trainvitals export thread did not finish within %.0f s", timeout_s)
        try:
            self.exporter.shutdown(timeout_s)
        except Exception:  # an exporter must not raise; if one does, training still ends well
            log.exception("trainvitals exporter failed to shut down")

    # ------------------------------------------------------------------ the thread

    def _loop(self, runs_row: dict[str, Any] | None) -> None:
        batch = ColumnBatch(self.run_id)
        if runs_row is not None:
            batch.append("runs", **runs_row)
        last_export = time.monotonic()
        while True:
            try:
                item = self._queue.get(timeout=self.interval_s)
            except queue.Empty:
                item = None
            if item is _STOP:
                break
            if isinstance(item, _Flush):
                if len(batch):
                    self._export(batch)
                    batch, last_export = ColumnBatch(self.run_id), time.monotonic()
                self._force_flush()
                item.done.set()
                continue
            urgent = isinstance(item, _Event)  # rare, and the record of a crash: sent at once
            if isinstance(item, _RunsRow):
                batch.append("runs", **item.row)
            elif urgent:
                batch.append("events", **item.row)
            elif item is not None:
                # sync point: on this export thread only; training never waits for it.
                item.wait()
                if self.rank == self.node.leader:
                    self._add_rows(batch, item)
            due = time.monotonic() - last_export >= self.interval_s
            if len(batch) and (due or urgent):
                self._export(batch)
                batch, last_export = ColumnBatch(self.run_id), time.monotonic()
        if len(batch):
            self._export(batch)

    def _add_rows(self, batch: ColumnBatch, item: Pending) -> None:
        """The rows of a reduced step: steps and layers on rank 0, the node's ranks on its
        leader. Numpy columns throughout: O(layers + local ranks), nothing per row."""
        # Host tensors whose async copy wait() has completed, on this export thread only.
        both = np.concatenate([p.numpy() for p in item.parts])  # sync point (export thread)
        size, max_size = self.layout.size, self.layout.max_size
        v, v_max = both[:size], both[size : size + max_size]
        if self.rank == 0:
            add_step(batch, self.layout, v, v_max, item.meta, self.world_size)
        slots = both[size + max_size :].reshape(len(self.node.ranks), len(RANK_SLOT))
        release = release_unix_s(self.layout, v_max)
        add_ranks(batch, item.meta.step, np.asarray(self.node.ranks), slots, release)

    def _export(self, batch: ColumnBatch) -> None:
        try:
            self.exporter.export(batch)
        except Exception:  # an exporter must not raise; if one does, training goes on
            self.failed_exports += 1
            log.exception("trainvitals exporter failed; the batch is lost")

    def _force_flush(self) -> None:
        flush = getattr(self.exporter, "force_flush", None)  # a user's exporter may lack it
        if flush is None:
            return
        try:
            flush(self.interval_s)
        except Exception:  # as export: never into the program being observed
            log.exception("trainvitals exporter failed to flush")
