"""The live driver of the analyzer: detectors follow the collector's writer, a moment behind it.

The collector's store tells `committed` (a commit listener, collector/store.py) the rows
each commit added; ingest has acknowledged them by then. Analysis runs on a thread of its
own, over the committed rows, in step order, a window of steps at a time (a telemetry
source, source.py), as the replay driver (replay.py) reads them from a store. Two reasons:
- the request path never waits for detectors, whose cost grows with ranks and layers;
- batches need not arrive in step order, nor whole: concurrent connections commit them
  in any order, and exporters that send per node split a step's ranks rows across
  batches. A step is analysed `delay_s` after the batch carrying its steps row was
  committed, by then with whatever else of it and before it has arrived, so detectors see
  each step whole and in order, and live alerts are the alerts a replay of the store raises.
  A step that has some ranks rows but fewer than the run's world size waits on for the
  other nodes' rows, up to `ranks_deadline_s` after its steps row; then it is analysed
  without them, and the analyzer names the missing ranks (coverage.py). A node
  whose rows come later than that is stored but was not seen live: replay sees it.

The committed rows wait in memory, not re-read from the store: reading a window back costs
a scan of every row group whose steps overlap it, and runs sharing a store overlap (every
run starts at step 0), which made reads the writer's main competitor. Buffered rows are
what the store holds: the writer passes on only the rows the store added (a resent key
keeps its first copy there), and a key already buffered keeps its first copy. The buffer
is bounded (`max_rows`): a writer that gets that far ahead waits for the analyzer, which
then analyses what is committed without waiting `delay_s`: ingest slows down (503,
retried) rather than memory growing or alerts being skipped.

Cost: alerts come `delay_s` (1 s) later, against Prometheus's 15 s scrape interval; rows
that arrive later than that behind a newer step are stored but not analysed live (as
before, when a batch older than the last analysed step was skipped). A kill -9 loses the
alerts of the batches committed in the last `delay_s` (their rows are stored; `trainvitals
replay` raises them).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from trainvitals.schema import RUNS

from .alerts import Alert
from .engine import Analyzer
from .source import Window, analyze

log = logging.getLogger(__name__)

DELAY_S = 1.0  # how long a committed step waits for stragglers of its own (see above)
MAX_ROWS = 1_000_000  # rows waiting for analysis, at most (about 300 MB of ranks rows)
# How long a step with some of its ranks rows waits for the other nodes' (seconds after its
# steps row). Node leaders send every export interval (1 s), with retries backing off for
# up to about 2 s more (hooks/exporter.py): 10 s leaves room for a slow node.
RANKS_DEADLINE_S = 10.0
_TICK_S = 0.1  # the thread looks for due steps this often
# Tables the detectors read, and the key that identifies a row within a run and step.
_TABLES = {"steps": None, "layers": "layer", "ranks": "rank"}


@dataclass
class _Run:
    parts: dict[str, list[pa.Table]] = field(default_factory=dict)  # committed, not analysed
    # (commit time, max step, steps) of each batch that carried steps rows
    due: deque[tuple[float, int, list[int]]] = field(default_factory=deque)
    meta: pa.Table | None = None  # the runs row
    world_size: int = 0  # from the runs row (0: not known)
    ranks_rows: dict[int, int] = field(default_factory=dict)  # step -> ranks rows buffered
    # Events rows, handed over whole with the next window whatever their step: an event
    # may arrive after the step it names, and detectors look back (engine.py).
    events: list[pa.Table] = field(default_factory=list)
    last: int = -1  # last step analysed


class LiveAnalysis:
    """Runs `analyzer` over committed steps, in step order, per run; hands each tick's
    alerts to `emit` (the collector stores and counts them)."""

    def __init__(
        self,
        analyzer: Analyzer,
        emit: Callable[[list[Alert]], None],
        delay_s: float = DELAY_S,
        max_rows: int = MAX_ROWS,
        ranks_deadline_s: float = RANKS_DEADLINE_S,
        clock: Callable[[], float] = time.monotonic,  # when a step is due (tests inject one)
    ) -> None:
        self.analyzer = analyzer
        self._emit = emit
        self.delay_s = delay_s
        self.ranks_deadline_s = ranks_deadline_s
        self._clock = clock
        self.max_rows = max_rows
        self._cond = threading.Condition()
        self._runs: dict[str, _Run] = {}
        self._rows = 0  # buffered, all runs
        self._busy = self._drain = self._stop = self._full = False
        # Commit time of the oldest step in the window being analysed: until its alerts are
        # stored it still counts in `lag_s` (a reader waiting for lag 0 then sees them).
        self._taken_s: float | None = None
        self._thread: threading.Thread | None = None
        self.errors = 0

    def start(self, query: Callable[[str], pa.Table]) -> None:
        """Start the thread. `query`: runs SQL on the store (`Store.query`).

        Runs already in the store were analysed by an earlier process: go on after their
        last step, as the analyzer did before (its detectors start afresh there)."""
        stored = query("SELECT run_id, max(step) AS last FROM steps GROUP BY ALL").to_pylist()
        for row in stored:
            self._runs.setdefault(row["run_id"], _Run()).last = row["last"]
        cols = ", ".join(["run_id", *(f.name for f in RUNS.fields)])
        meta = query(f"SELECT {cols} FROM runs")
        for i, run_id in enumerate(meta.column("run_id").to_pylist()):
            _set_meta(self._runs.setdefault(run_id, _Run()), meta.slice(i, 1))
        self._thread = threading.Thread(target=self._loop, name="trainvitals-analysis", daemon=True)
        self._thread.start()

    def committed(self, run_id: str, tables: dict[str, pa.Table]) -> None:
        """The writer committed `tables` of `run_id` (call in commit order). May wait.

        `tables` holds the rows the store added, not the batch as sent: a resent runs row
        that the store ignored must not replace the metadata the detectors read.
        """
        parts = {n: t for n, t in tables.items() if n in _TABLES and t.num_rows}
        rows = sum(t.num_rows for t in parts.values())
        with self._cond:
            while self._rows + rows > self.max_rows and self._can_free():
                # The analyzer is behind: ingest waits, and analysis stops waiting for
                # rows still on their way (what is committed is analysed now).
                self._full = True
                self._cond.notify_all()
                self._cond.wait(_TICK_S)
            self._full = False
            run = self._runs.setdefault(run_id, _Run())
            for name, table in parts.items():  # resent or late: never analysed, not buffered
                if run.last >= 0 and pc.min(table.column("step")).as_py() <= run.last:
                    parts[name] = table.filter(pc.greater(table.column("step"), run.last))
                    rows -= table.num_rows - parts[name].num_rows
            if "runs" in tables and tables["runs"].num_rows:
                _set_meta(run, tables["runs"].slice(tables["runs"].num_rows - 1))
            if "events" in tables and tables["events"].num_rows:
                run.events.append(tables["events"])
            for name, table in parts.items():
                if table.num_rows:
                    run.parts.setdefault(name, []).append(table)
            self._rows += rows
            if "ranks" in parts and parts["ranks"].num_rows:
                steps, counts = np.unique(
                    parts["ranks"].column("step").to_numpy(), return_counts=True
                )
                for step, count in zip(steps.tolist(), counts.tolist(), strict=True):
                    run.ranks_rows[step] = run.ranks_rows.get(step, 0) + count
            if "steps" in parts and parts["steps"].num_rows:
                steps = pc.unique(parts["steps"].column("step")).to_pylist()
                run.due.append((self._clock(), max(steps), steps))

    def _can_free(self) -> bool:
        """Whether analysing what is committed frees any room (steps rows are buffered)."""
        return not self._stop and any(run.due for run in self._runs.values())

    @property
    def lag_s(self) -> float:
        """Age of the oldest committed step whose alerts are not stored yet (waiting, or in the
        window being analysed), in seconds; 0 when none."""
        with self._cond:
            oldest = [run.due[0][0] for run in self._runs.values() if run.due]
            if self._taken_s is not None:
                oldest.append(self._taken_s)
        return self._clock() - min(oldest) if oldest else 0.0

    def progress(self, run_id: str) -> tuple[int | None, bool]:
        """(last step of `run_id` analysed, None before any; whether any of its committed
        steps wait for analysis, or a window is being analysed now: its alerts are not
        stored yet)."""
        with self._cond:
            run = self._runs.get(run_id)
            if run is None:
                return None, self._busy
            return (run.last if run.last >= 0 else None), bool(run.due) or self._busy

    def drain(self, timeout_s: float) -> bool:
        """Analyse everything committed so far, without waiting `delay_s`; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._drain = True
            self._cond.notify_all()
            try:
                while self._busy or any(run.due for run in self._runs.values()):
                    left = deadline - time.monotonic()
                    if left <= 0 or self._thread is None or not self._thread.is_alive():
                        return False
                    self._cond.wait(min(left, _TICK_S))
            finally:
                self._drain = False
        return True

    def forget(self, run_ids: list[str]) -> None:
        with self._cond:
            for run_id in run_ids:
                run = self._runs.pop(run_id, None)
                if run is not None:
                    self._rows -= sum(t.num_rows for p in run.parts.values() for t in p)
            self._cond.notify_all()

    def close(self, timeout_s: float) -> None:
        if self._thread is None:
            return
        self.drain(timeout_s)
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout_s)

    # ------------------------------------------------------------------ the thread

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._busy = False
                self._taken_s = None  # the last window's alerts are stored
                self._cond.notify_all()
                if self._stop:
                    return
                self._cond.wait(_TICK_S)
            alerts = list(analyze(self, self.analyzer, self._failed))
            if not alerts:
                continue
            try:
                self._emit(alerts)
            except Exception:  # counted and exported; the next window goes on
                log.exception("storing %d live alerts failed", len(alerts))
                self.errors += 1

    def _failed(self, run_id: str, _error: Exception) -> None:
        log.exception("live analysis of run %s failed", run_id)  # counted and exported
        self.errors += 1

    def windows(self) -> list[Window]:
        """The telemetry source (source.py): every run's due window, taken from the buffer.
        Until the thread calls again it counts as busy (`drain` waits for it)."""
        with self._cond:
            work = self._take_due()
            self._busy = bool(work)
        return [(run_id, {**meta, **tables}) for run_id, (meta, tables) in work.items()]

    def _take_due(self) -> dict[str, tuple[dict[str, pa.Table], dict[str, pa.Table]]]:
        """run -> (runs table, tables of its due window); called under the lock."""
        now, hurry = self._clock(), self._drain or self._full
        cutoff = now - (0.0 if hurry else self.delay_s)
        work = {}
        taken = []  # commit times of the batches taken
        for run_id, run in self._runs.items():
            if not (run.due and run.due[0][0] <= cutoff):
                continue
            up_to = run.last
            while run.due and run.due[0][0] <= cutoff:
                committed, top, steps = run.due[0]
                if not (hurry or committed <= now - self.ranks_deadline_s or _whole(run, steps)):
                    break  # other nodes' ranks rows are on their way; later steps wait too
                run.due.popleft()
                taken.append(committed)
                up_to = max(up_to, top)
            if up_to == run.last:
                continue
            for step in [s for s in run.ranks_rows if s <= up_to]:
                del run.ranks_rows[step]
            window = {}
            for name, parts in run.parts.items():
                if not parts:
                    continue
                table = parts[0] if len(parts) == 1 else pa.concat_tables(parts)
                later = pc.greater(table.column("step"), up_to)
                keep = table.filter(later)
                run.parts[name] = [keep] if keep.num_rows else []
                self._rows -= table.num_rows - keep.num_rows
                if up_to > run.last:
                    mine = table.filter(pc.invert(later))  # rows <= run.last are not buffered
                    window[name] = _first_copies(mine, _TABLES[name])
            if up_to > run.last:
                if run.events:
                    window["events"] = pa.concat_tables(run.events)
                    run.events = []
                run.last = up_to
                work[run_id] = ({"runs": run.meta} if run.meta is not None else {}, window)
        self._taken_s = min(taken) if taken else None
        self._cond.notify_all()  # a writer waiting for room
        return work


def _set_meta(run: _Run, row: pa.Table) -> None:
    run.meta = row
    world = row.column("world_size")[0].as_py() if "world_size" in row.column_names else None
    run.world_size = world if isinstance(world, int) else 0


def _whole(run: _Run, steps: list[int]) -> bool:
    """Whether each of `steps` has every rank's rows, or none (a producer without ranks
    rows: nothing to wait for). Resent rows count twice here: at worst a step is analysed
    before a late node's rows, as without the wait."""
    world = run.world_size
    return not world or all(not 0 < run.ranks_rows.get(s, 0) < world for s in steps)


def _first_copies(table: pa.Table, key: str | None) -> pa.Table:
    """The first row of each (step, key) in commit order, sorted by step and key: what the
    store keeps of rows sent more than once, in the order replay reads them."""
    if table.num_rows == 0:
        return table
    step = table.column("step").to_numpy().astype(np.int64)
    if key is None:
        ids = step
    else:
        sub = table.column(key).to_numpy().astype(np.int64)
        sub = sub - sub.min()
        ids = step * (int(sub.max()) + 1) + sub
    _, first = np.unique(ids, return_index=True)  # sorted ids; index of the first copy
    if len(first) == table.num_rows and (first == np.arange(len(first))).all():
        return table  # sorted already, each row once: the usual case
    return table.take(pa.array(first))
