"""Keeps the cyclic garbage collector's pauses in the collector process short.

A full collection (generation 2) walks every container object the process holds, with the
GIL held throughout: every thread waits, the event loop and /healthz included. The
collector's long-lived state grows with what it is sent: the live analysis keeps about 140
objects a run (its detectors), the liveness watchdog two per rank. After two OTLP requests
of 3,000 runs each it held a million objects, and each full collection took 100-550 ms.
CPython (up to 3.13) runs one each time generation 2 has grown by a quarter, so a growing
collector paid a longer pause at every growth: /healthz took 400-580 ms during the
adversarial families (bench/adversarial.py), and 10-51 ms with automatic collection off.

So the guard takes full collections over. Automatic ones are off (generation 2's threshold);
the young generations are collected as usual. A thread looks every `tick_s` at what
generation 2 holds: past `max_objects` it collects (a pause bounded by what accumulated
since the last time, not by the whole state) and freezes the survivors (`gc.freeze`: the
permanent generation, which no collection walks again). Every `full_every_s` it collects
generation 2 anyway, so that cycles there are reclaimed while it stays below the limit.

Cost: a reference cycle frozen while alive that dies later is never reclaimed (objects
without cycles are freed by reference counting as usual, frozen or not). What is frozen is
what lived long (runs' detectors, ranks, the app); a request's cycles die young and are
reclaimed by the young generations, or by the collection before each freeze. `close`
unfreezes everything and restores the thresholds (the last guard of a process, where
tests run two collectors at once).
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

# Objects generation 2 may gather before the guard collects and freezes them. A full
# collection walks about 2 million objects a second (a million: 370-550 ms on 2 loaded
# cores): 50,000 cost about 25 ms, plus what accumulates within a tick while the analysis
# takes on new runs; the guard's collections took 12-61 ms there, at load average 11.
MAX_OBJECTS = 50_000
TICK_S = 0.1
FULL_EVERY_S = 60.0
_NEVER = 2**30  # generation 2's threshold: it counts generation-1 collections
# The process's settings are shared by the guards in it: the first saves, the last restores.
_guards_lock = threading.Lock()
_guards = 0
_saved_thresholds = gc.get_threshold()


class GcGuard:
    """Collects and freezes generation 2 past `max_objects`, on a thread of its own.

    `clock` (monotonic seconds) times the periodic full collection; tests inject one and
    call `check` themselves instead of `start`.
    """

    def __init__(
        self,
        max_objects: int = MAX_OBJECTS,
        tick_s: float = TICK_S,
        full_every_s: float = FULL_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_objects < 1:
            raise ValueError(f"GcGuard.max_objects must be 1 or more, got {max_objects}")
        self.max_objects = max_objects
        self.tick_s = tick_s
        self.full_every_s = full_every_s
        self.clock = clock
        self.freezes = 0  # times generation 2 was collected and frozen
        self.collections = 0  # full collections the guard ran, freezes included
        self._taken = False
        self._gen1_runs = -1  # generation-1 collections counted at the last look
        self._next_full_s = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def take_over(self) -> None:
        """Turn automatic full collections off and freeze what the process holds now (its
        modules, the app, the state loaded at start-up): no later collection walks it."""
        global _saved_thresholds, _guards
        with _guards_lock:
            if _guards == 0:  # two collectors in one process (tests) share the settings
                _saved_thresholds = gc.get_threshold()
                gc.set_threshold(_saved_thresholds[0], _saved_thresholds[1], _NEVER)
            _guards += 1
        self._taken = True
        gc.collect(1)  # the young generations' cycles: not frozen
        gc.freeze()
        self._next_full_s = self.clock() + self.full_every_s

    def start(self) -> None:
        self.take_over()
        self._thread = threading.Thread(target=self._loop, name="trainvitals-gc", daemon=True)
        self._thread.start()

    def check(self) -> bool:
        """Collect generation 2 if it holds more than `max_objects` (then freeze what
        survives) or a periodic collection is due. True if it collected."""
        promotions = gc.get_count()[2]  # generation 2 grows only when generation 1 is collected
        due = self.clock() >= self._next_full_s
        if not due and promotions == self._gen1_runs:
            return False
        self._gen1_runs = promotions
        over = len(gc.get_objects(generation=2)) > self.max_objects
        if not (over or due):
            return False
        gc.collect()  # the frozen objects are not walked
        self.collections += 1
        if over:
            gc.freeze()
            self.freezes += 1
        self._gen1_runs = gc.get_count()[2]
        self._next_full_s = self.clock() + self.full_every_s
        return True

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread; the process's last guard unfreezes and gives collection back to
        CPython's thresholds."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        global _guards
        if not self._taken:
            return
        self._taken = False
        with _guards_lock:
            _guards -= 1
            if _guards == 0:  # the last one out gives collection back
                gc.set_threshold(*_saved_thresholds)
                gc.unfreeze()

    def _loop(self) -> None:
        while not self._stop.wait(self.tick_s):
            try:
                self.check()
            except Exception:  # the collector goes on; CPython's young collections still run
                log.exception("the garbage collector guard failed")
