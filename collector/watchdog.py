"""The collector's liveness watchdog: a thread that moves analyzer/liveness.py's clock on.

The heartbeat router hands every committed heartbeat to `observe`; the thread calls
`Watchdog.advance(clock() - lag_s)` every `tick_s`, so a crash or a hang is judged on time
alone, never waiting for a steps row. Alerts take the analyzer's path: the alerts table and
the /metrics counters (LiveState.count_alerts).

Why `lag_s`: a heartbeat is stamped with its receive time before it is committed, and is
given to the watchdog after the commit. Judging only up to `lag_s` ago means every
heartbeat received by then has been taken, so the watchdog sees the heartbeats in receive
order, as a replay of the store does, and both raise the same alerts. A commit slower than
`lag_s` (an overloaded store) is counted in `Watchdog.late` and judged when it arrives.
Cost: alerts come `lag_s` later.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from trainvitals.analyzer.liveness import LivenessSettings, Watchdog

from .analysis import _insert_alerts
from .store import Store

log = logging.getLogger(__name__)

LAG_S = 1.0  # commits take tens of ms (store.py); a second covers a busy writer
TICK_S = 0.5  # how often the clock moves on: alerts are timed by deadline, not by tick


class LiveWatchdog:
    """Runs a Watchdog on the collector's clock (`clock`: injectable, Unix seconds)."""

    def __init__(
        self,
        store: Store,
        settings: LivenessSettings | None = None,
        clock: Callable[[], float] = time.time,
        lag_s: float = LAG_S,
        tick_s: float = TICK_S,
    ) -> None:
        self.store = store
        self.watchdog = Watchdog(settings or LivenessSettings())
        self.clock = clock
        self.lag_s = lag_s
        self.tick_s = tick_s
        self.errors = 0
        self._lock = threading.Lock()
        self._ended: set[str] = set()  # runs whose run_end event the watchdog was told of
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def observe(self, run_id: str, heartbeats: Any) -> None:
        """Committed heartbeats (a pyarrow table with received_unix_s)."""
        with self._lock:
            self.watchdog.observe(run_id, heartbeats)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="trainvitals-watchdog", daemon=True)
        self._thread.start()

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def tick(self) -> list:
        """Judge up to `clock() - lag_s`; store and count the alerts. Returns them."""
        with self._lock:
            self._tell_run_ends()
            alerts = self.watchdog.advance(self.clock() - self.lag_s)
        if alerts:
            cur = self.store.cursor()
            try:
                _insert_alerts(cur, alerts)
            finally:
                cur.close()
            for run_id in {a.run_id for a in alerts}:
                self.store.state.count_alerts(run_id, [a for a in alerts if a.run_id == run_id])
        return alerts

    def _tell_run_ends(self) -> None:
        """A run_end event the writer saw (LiveState) ends that run here too, at its time."""
        for run_id in self.watchdog.open_runs():
            run = self.store.state.runs.get(run_id)  # a dict read: atomic, no lock needed
            ended_s = None if run is None else run.ended_unix_s
            if ended_s is not None and run_id not in self._ended:
                self._ended.add(run_id)
                self.watchdog.end_run(run_id, ended_s)

    def _loop(self) -> None:
        while not self._stop.wait(self.tick_s):
            try:
                self.tick()
            except Exception:  # counted; the next tick goes on
                log.exception("liveness watchdog tick failed")
                self.errors += 1
