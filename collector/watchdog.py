"""The collector's liveness watchdog: a thread that moves analyzer/liveness.py's clock on.

The heartbeat router hands every validated heartbeat batch to `observe`; the thread calls
`Watchdog.advance(clock() - lag_s)` every `tick_s`, so a crash or a hang is judged on time
alone, never waiting for a steps row. Alerts take the analyzer's path: the alerts table and
the /metrics counters (LiveState.count_alerts).

Heartbeats reach the store from here too, every tick, all runs' in one batch per run: one
commit per heartbeat request cost 2.5 ms of collector CPU (DuckDB's transaction), a group
of a tick's heartbeats 0.13 ms per request's worth (bench/heartbeat_scale.py). The price:
the router answers 202 once a batch is validated and taken, and a collector killed (-9)
loses the heartbeats of its last tick from the store (the watchdog had them).

Why `lag_s`: a heartbeat is stamped with its receive time, then handed over here. Judging
only up to `lag_s` ago means every heartbeat received by then has been taken, so the
watchdog sees the heartbeats in receive order, as a replay of the store does, and both
raise the same alerts. A hand-over later than `lag_s` (an overloaded collector) is counted
in `Watchdog.late` and judged when it arrives. Cost: alerts come `lag_s` later. At a stop,
`close` judges up to the last heartbeat received, as a replay of the store does.

At start-up `rebuild` restores the state of the runs that were live when the store was
last written, from their stored heartbeats and open liveness episodes (Watchdog.restore):
a rank that crashed while the collector was down is still named, and the typical step
time behind the hang threshold is known at once, not after five more steps.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import fields
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from trainvitals.analyzer.alerts import RESOLVED, Alert
from trainvitals.analyzer.liveness import HANG, RANK_LOST, STOPPED, LivenessSettings, Watchdog
from trainvitals.analyzer.views import PAUSE_EVENT_KINDS
from trainvitals.schema import HEARTBEATS

from .analysis import AlertLog
from .state import LiveState
from .store import Store, StoreError

log = logging.getLogger(__name__)

LAG_S = 1.0  # the router's stamp to its hand-over takes under a millisecond; ample
TICK_S = 0.5  # how often the clock moves on (alerts are timed by deadline, not by tick)
# Heartbeat rows waiting for the store at most (about 40 s of 100,000 ranks every 2 s); a
# store that takes none for longer loses the oldest, counted in `dropped_rows`.
MAX_PENDING_ROWS = 2_000_000


class LiveWatchdog:
    """Runs a Watchdog on the collector's clock (`clock`: injectable, Unix seconds)."""

    def __init__(
        self,
        store: Store,
        live: LiveState,
        settings: LivenessSettings | None = None,
        clock: Callable[[], float] = time.time,
        lag_s: float = LAG_S,
        tick_s: float = TICK_S,
    ) -> None:
        self.store = store
        self.live = live  # the writer's view: which runs reported their end (state.py)
        self._alerts = AlertLog(store, live)
        self.watchdog = Watchdog(settings or LivenessSettings())
        self.clock = clock
        self.lag_s = lag_s
        self.tick_s = tick_s
        self.errors = 0
        self.dropped_rows = 0  # heartbeats the store never took (see MAX_PENDING_ROWS)
        self._lock = threading.Lock()
        self._unstored: dict[str, list[pa.Table]] = {}  # by run, for the next store write
        self._unstored_rows = 0
        self._ended: set[str] = set()  # runs whose run_end event the watchdog was told of
        self._stops_told = 0  # LiveState.stops the watchdog was told of
        self._last_received_s = -math.inf  # the latest heartbeat's receive time
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def observe(self, run_id: str, heartbeats: pa.Table) -> None:
        """Validated heartbeats (with received_unix_s): judged, and stored at the next tick."""
        with self._lock:
            self.watchdog.observe(run_id, heartbeats)
            received_s = pc.max(heartbeats["received_unix_s"]).as_py()
            if received_s is not None:
                self._last_received_s = max(self._last_received_s, received_s)
            self._unstored.setdefault(run_id, []).append(heartbeats)
            self._unstored_rows += heartbeats.num_rows

    def flush(self) -> None:
        """Hand the heartbeats taken so far to the store's writer (one batch per run)."""
        with self._lock:
            unstored, self._unstored, self._unstored_rows = self._unstored, {}, 0
        for run_id, parts in unstored.items():
            try:
                done = self.store.submit(run_id, {"heartbeats": pa.concat_tables(parts)})
            except StoreError:  # the writer is behind: kept for the next tick
                self._keep(run_id, parts)
                continue
            done.add_done_callback(self._count_failure)

    def _keep(self, run_id: str, parts: list[pa.Table]) -> None:
        with self._lock:
            self._unstored.setdefault(run_id, [])[:0] = parts  # before the newer ones
            self._unstored_rows += sum(t.num_rows for t in parts)
            while self._unstored_rows > MAX_PENDING_ROWS:
                oldest = next(iter(self._unstored.values()))
                lost = oldest.pop(0)
                self._unstored_rows -= lost.num_rows
                self.dropped_rows += lost.num_rows
                self._unstored = {k: v for k, v in self._unstored.items() if v}

    def _count_failure(self, done: Any) -> None:
        if done.exception() is not None:  # the writer logged it; the rows are lost
            self.errors += 1

    def declared_pauses(self) -> dict[str, tuple[str, ...]]:
        """Runs whose job is in a pause its loop declared, and which (for /metrics)."""
        with self._lock:
            return self.watchdog.declared_pauses()

    def rebuild(self) -> list[str]:
        """Restore every run heard within `forget_s` that has not ended, from the store
        (before `start`). The rows read per run: each rank's latest heartbeat and the first
        receipt of each of its last `window` completed steps, so the cost does not grow
        with the run's length. Returns the runs restored."""
        cfg = self.watchdog.settings
        now_s = self.clock()
        cols = ", ".join(f.name for f in HEARTBEATS.fields)  # received_unix_s among them
        alert_cols = ", ".join(f.name for f in fields(Alert))
        live = self.store.query(
            "SELECT run_id, max(received_unix_s) AS last_s FROM heartbeats GROUP BY run_id "
            "HAVING max(received_unix_s) > ? ORDER BY run_id",
            [now_s - cfg.forget_s],
        ).to_pylist()
        restored = []
        for row in live:
            run_id, since_s = row["run_id"], row["last_s"] - cfg.forget_s
            state = self.live.runs.get(run_id)
            if state is not None and state.ended_unix_s is not None:
                continue  # a run_end event: it never alarms again
            heartbeats = self.store.query(
                f"SELECT {cols} FROM heartbeats WHERE run_id = ? AND received_unix_s > ? "
                "QUALIFY row_number() OVER (PARTITION BY rank ORDER BY received_unix_s DESC) = 1 "
                f"UNION SELECT * FROM (SELECT {cols} FROM heartbeats WHERE run_id = ? AND "
                "received_unix_s > ? QUALIFY row_number() OVER (PARTITION BY step_finished "
                "ORDER BY received_unix_s, rank) = 1 ORDER BY step_finished DESC LIMIT ?)",
                [run_id, since_s, run_id, since_s, cfg.window + 1],
            )
            last = self.store.query(
                f"SELECT {alert_cols} FROM alerts WHERE run_id = ? AND kind IN (?, ?) "
                "QUALIFY row_number() OVER (PARTITION BY kind ORDER BY step DESC) = 1",
                [run_id, RANK_LOST, HANG],
            ).to_pylist()
            lengths_s = self._pause_lengths_s(run_id)
            with self._lock:
                self.watchdog.restore(
                    run_id, heartbeats, now_s, [Alert(**a) for a in last], lengths_s
                )
            restored.append(run_id)
        return restored

    def _pause_lengths_s(self, run_id: str) -> dict[str, float]:
        """Per declared phase, the longest pause of it the run came back from, from its
        `pause:<phase>` events (rank 0's duration), leaving out those at whose step a hang
        was raised: live, a pause that outlasted its threshold teaches nothing either."""
        rows = self.store.query(
            "SELECT e.kind, e.detail FROM events e WHERE e.run_id = ? AND e.kind IN "
            f"({', '.join('?' * len(PAUSE_EVENT_KINDS))}) AND NOT EXISTS (SELECT 1 FROM "
            "alerts a WHERE a.run_id = e.run_id AND a.kind = ? AND a.step = e.step "
            "AND a.severity <> ?)",
            [run_id, *PAUSE_EVENT_KINDS, HANG, RESOLVED],
        ).to_pylist()
        out: dict[str, float] = {}
        for row in rows:
            try:
                length_s = float(json.loads(row["detail"] or "{}").get("duration_s", "nan"))
            except (ValueError, TypeError, AttributeError):
                continue  # a hand-made event without a duration: nothing to learn
            phase = row["kind"].removeprefix("pause:")
            if math.isfinite(length_s):
                out[phase] = max(out.get(phase, 0.0), length_s)
        return out

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="trainvitals-watchdog", daemon=True)
        self._thread.start()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread, judge every heartbeat taken, and hand what is left to the store
        (close it after this; the server takes no more heartbeats by then)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        try:  # the run_end events accepted so far reach LiveState (_tell_run_ends)
            self.store.flush(timeout_s)
        except StoreError as e:
            log.warning("liveness watchdog: judging the last heartbeats without: %s", e)
        self._judge_the_rest()
        self.flush()

    def _judge_the_rest(self) -> None:
        """Judge up to the last heartbeat received, not `lag_s` short of now: a replay of
        the store judges up to it (analyzer/replay.py), so the heartbeats of the last
        second before a stop (a run's "ended" ones, say) must not go unjudged live."""
        with self._lock:
            self._tell_run_ends()
            alerts = self.watchdog.advance(self._last_received_s)
        self._alerts(alerts)

    def tick(self) -> list:
        """Store the heartbeats taken; judge up to `clock() - lag_s`; store and count the
        alerts. Returns them."""
        self.flush()
        with self._lock:
            self._tell_run_ends()
            alerts = self.watchdog.advance(self.clock() - self.lag_s)
        self._alerts(alerts)
        return alerts

    def _tell_run_ends(self) -> None:
        """A run_end event the writer saw (LiveState) ends that run here too, at its time;
        so does each `action:stop` event (the supervisor stopping the job)."""
        for run_id in self.watchdog.open_runs():
            run = self.live.runs.get(run_id)  # a dict read: atomic, no lock needed
            ended_s = None if run is None else run.ended_unix_s
            if ended_s is not None and run_id not in self._ended:
                self._ended.add(run_id)
                self.watchdog.end_run(run_id, ended_s)
        stops = self.live.stops[self._stops_told :]  # appended by the writer: a slice is whole
        self._stops_told += len(stops)
        for run_id, stopped_s in stops:
            self.watchdog.end_run(run_id, stopped_s, STOPPED)

    def _loop(self) -> None:
        while not self._stop.wait(self.tick_s):
            try:
                self.tick()
            except Exception:  # counted; the next tick goes on
                log.exception("liveness watchdog tick failed")
                self.errors += 1
