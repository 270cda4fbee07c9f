"""Time this rank's process spent stopped: neither running nor waiting for a CPU.

    clock = StoppedClock()          # on the training thread: starts a daemon thread
    ... clock.stopped_s ...         # a plain float, read at step boundaries
    clock.close()

A process stopped from outside (SIGSTOP, a cgroup freezer, a debugger, a paused VM) loses
wall time that no CPU clock sees. On CPU ranks the hooks' compute time is the training
thread's CPU time, which a stopped thread does not use, and the others wait for the stopped
rank inside FSDP's collectives, where they would wait anyway: neither the compute nor the
arrival signal of the straggler detector moves (bench/external_faults.py's throttle cases).

A daemon thread sleeps `period_s` at a time. How much later than asked it woke, less the
CPU it used and the time it waited on the run queue (both from the kernel's schedstat, in
ns), is time it could not run: its process was stopped, or it waited for the GIL. Time
waiting for a CPU (a busy machine) is run-queue time and is not counted. A GIL wait is
told from a stop by the training thread (the one that made the clock): while it holds the
GIL it runs or waits for a CPU, while its process is stopped it does neither. So a
wake-up counts at most the time of its interval in which the training thread neither ran
nor waited for a CPU. What is still counted besides a stop: GIL waits while the training
thread was blocked (in a collective; another thread held the GIL), about 0.6% of the wall
time on the reference trainer, as much on every rank (bench/results/stopped_clock.txt). A
stop that begins and ends while the thread sleeps is not seen, so a stop is seen in full
only if it outlasts `period_s`: one of 12 ms in every 100 ms is seen at about 60%.

Not a stop: a CPU quota (cgroup cpu.max, CFS bandwidth), whose throttled time the kernel
counts as run-queue wait. Linux only (schedstat needs CONFIG_SCHED_INFO, on in the common
distributions' kernels); elsewhere `stopped_s` stays NaN and no thread runs. Cost: one
wake-up and two small file reads per `period_s` on a thread of its own, never on the
training thread.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

SCHEDSTAT = "/proc/thread-self/schedstat"
# 10 ms: stops of 12 ms and longer are seen in good part; 100 wake-ups a second cost the
# thread about 1% of one core (bench/results/stopped_clock.txt).
PERIOD_S = 0.01


class Schedstat:
    """(CPU time, run-queue wait) of a thread, in seconds: its schedstat file (`path`; the
    default is the opening thread's), kept open and read again in place (pread), which
    halves a wake-up's CPU against opening it each time. The file holds three numbers:
    time on the CPU (ns), time waiting on a run queue (ns), time slices run."""

    def __init__(self, path: str = SCHEDSTAT) -> None:
        self._fd = os.open(path, os.O_RDONLY)

    def __call__(self) -> tuple[float, float]:
        on_cpu_ns, waiting_ns, _slices = os.pread(self._fd, 128, 0).split()
        return int(on_cpu_ns) / 1e9, int(waiting_ns) / 1e9

    def close(self) -> None:
        os.close(self._fd)


def late_s(elapsed_s: float, asked_s: float, cpu_s: float, waiting_s: float) -> float:
    """Time a sleep of `asked_s` that took `elapsed_s` lost to neither the thread's own CPU
    time nor its run-queue wait: stopped (or waiting for the GIL). Never negative."""
    return max(0.0, elapsed_s - asked_s - cpu_s - waiting_s)


class Reading(NamedTuple):
    """One wake-up's readings, in seconds: the clock, the clock thread's CPU time and
    run-queue wait, the training thread's."""

    at_s: float
    cpu_s: float
    waiting_s: float
    watched_cpu_s: float
    watched_waiting_s: float


class StoppedClock:
    """Seconds this process was stopped since it was made (`stopped_s`), counted by a
    daemon thread for the thread that made it; `stopped_s` is NaN where the kernel does
    not report schedstat."""

    def __init__(
        self,
        period_s: float = PERIOD_S,
        schedstat: Callable[[str], Schedstat] = Schedstat,
        clock: Callable[[], float] = time.monotonic,
        start: bool = True,
    ) -> None:
        """`schedstat(path)` opens a reader of a thread's schedstat; `start` False: no
        thread (tests call `tick` themselves)."""
        self.period_s = period_s
        self._open, self._clock = schedstat, clock  # injectable, for tests
        self.stopped_s = math.nan
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._watched: Schedstat | None = None
        try:  # the calling thread's, read from the clock's thread
            self._watched = schedstat(f"/proc/self/task/{threading.get_native_id()}/schedstat")
            self._watched()
        except (OSError, ValueError):
            return  # not Linux, or a kernel without schedstat: NaN, no thread
        self.stopped_s = 0.0
        if start:
            self._thread = threading.Thread(target=self._run, name="tv-stopped", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        own = self._open(SCHEDSTAT)  # /proc/thread-self: this thread's
        try:
            reading = self.read(own)
            while not self._stop.wait(self.period_s):
                reading = self.tick(own, reading)
        finally:
            own.close()

    def read(self, own: Callable[[], tuple[float, float]]) -> Reading:
        assert self._watched is not None  # a clock without it runs nothing
        return Reading(self._clock(), *own(), *self._watched())

    def tick(self, own: Callable[[], tuple[float, float]], before: Reading) -> Reading:
        """One wake-up, `period_s` after the reading `before`: adds the time stopped in
        between to `stopped_s` and returns the new reading."""
        now = self.read(own)
        elapsed_s = now.at_s - before.at_s
        late = late_s(elapsed_s, self.period_s, now.cpu_s - before.cpu_s,
                      now.waiting_s - before.waiting_s)  # fmt: skip
        # The training thread neither ran nor waited for a CPU for at most this long: a
        # GIL it held while computing is no stop.
        idle_s = elapsed_s - (now.watched_cpu_s - before.watched_cpu_s)
        idle_s -= now.watched_waiting_s - before.watched_waiting_s
        self.stopped_s += max(0.0, min(late, idle_s))  # one writer; read whole, under the GIL
        return now

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
            if self._thread.is_alive():
                return  # still reading (a stopped process): its file stays open, unused
        if self._watched is not None:
            self._watched.close()
            self._watched = None
