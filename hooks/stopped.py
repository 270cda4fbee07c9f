"""Time this rank's process spent stopped: neither running nor waiting for a CPU.

    clock = StoppedClock()          # starts a daemon thread (CPU ranks)
    ... clock.stopped_s ...         # a plain float, read at step boundaries
    clock.close()

A process stopped from outside (SIGSTOP, a cgroup freezer, a debugger, a paused VM) loses
wall time that no CPU clock sees. On CPU ranks the hooks' compute time is the training
thread's CPU time, which a stopped thread does not use, and the others wait for the stopped
rank inside FSDP's collectives, where they would wait anyway: neither the compute nor the
arrival signal of the straggler detector moves (bench/external_faults.py's throttle cases).

A daemon thread sleeps `period_s` at a time. How much later than asked it woke, less the
CPU it used and the time it waited on the run queue (both from the kernel's
/proc/thread-self/schedstat, in ns), is time its process was stopped. Time waiting for a CPU
(a busy machine) is the run-queue time and is not counted. What is counted besides a stop:
the thread's waits for the GIL, about 1% of the wall time on the reference trainer, as
much on every rank (bench/results/stopped_clock.txt). A stop that begins and ends while the
thread sleeps is not seen, so a stop is seen in full only if it outlasts `period_s`: a stop
of 12 ms in every 100 ms is seen at about half its length, one of 25 ms at about 80%.

Linux only (schedstat needs CONFIG_SCHED_INFO, on in the common distributions' kernels);
elsewhere `stopped_s` stays NaN and no thread runs. Cost: one wake-up and one small file
read per `period_s` on a thread of its own, never on the training thread.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable

SCHEDSTAT = "/proc/thread-self/schedstat"
# 10 ms: stops of 12 ms and longer are seen in good part; 100 wake-ups a second cost the
# thread about 0.5% of one core (bench/results/stopped_clock.txt).
PERIOD_S = 0.01


class Schedstat:
    """(CPU time, run-queue wait) of the thread that made it, in seconds: its schedstat
    file, kept open and read again in place (pread), which halves a wake-up's CPU against
    opening it each time. The file holds three numbers: time on the CPU (ns), time waiting
    on a run queue (ns), time slices run."""

    def __init__(self, path: str = SCHEDSTAT) -> None:
        self._fd = os.open(path, os.O_RDONLY)  # /proc/thread-self: the opening thread's

    def __call__(self) -> tuple[float, float]:
        on_cpu_ns, waiting_ns, _slices = os.pread(self._fd, 128, 0).split()
        return int(on_cpu_ns) / 1e9, int(waiting_ns) / 1e9

    def close(self) -> None:
        os.close(self._fd)


def late_s(elapsed_s: float, asked_s: float, cpu_s: float, waiting_s: float) -> float:
    """Time a sleep of `asked_s` that took `elapsed_s` lost to neither the thread's own CPU
    time nor its run-queue wait: stopped (or waiting for the GIL). Never negative."""
    return max(0.0, elapsed_s - asked_s - cpu_s - waiting_s)


class StoppedClock:
    """Seconds this process was stopped since it was made (`stopped_s`), counted by a
    daemon thread; `stopped_s` is NaN where the kernel does not report schedstat."""

    def __init__(
        self,
        period_s: float = PERIOD_S,
        schedstat: Callable[[], Schedstat] = Schedstat,
        clock: Callable[[], float] = time.monotonic,
        start: bool = True,
    ) -> None:
        """`schedstat` opens a reader of the calling thread's schedstat (the clock's
        thread opens its own); `start` False: no thread (tests call `tick` themselves)."""
        self.period_s = period_s
        self._open, self._clock = schedstat, clock  # injectable, for tests
        self.stopped_s = math.nan
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._schedstat: Schedstat | None = None
        try:
            self._schedstat = schedstat()
            self._schedstat()
        except (OSError, ValueError):
            return  # not Linux, or a kernel without schedstat: NaN, no thread
        self.stopped_s = 0.0
        if start:
            self._thread = threading.Thread(target=self._run, name="tv-stopped", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        assert self._schedstat is not None  # the thread starts only with a reader
        self._schedstat.close()  # the maker's thread's: this thread reads its own
        self._schedstat = read = self._open()
        try:
            at_s, (cpu_s, waiting_s) = self._clock(), read()
            while not self._stop.wait(self.period_s):
                at_s, cpu_s, waiting_s = self.tick(at_s, cpu_s, waiting_s)
        finally:
            read.close()

    def tick(self, at_s: float, cpu_s: float, waiting_s: float) -> tuple[float, float, float]:
        """One wake-up, `period_s` after the reading (at_s, cpu_s, waiting_s): adds what
        it lost to `stopped_s` and returns the new reading."""
        assert self._schedstat is not None
        now_s, (cpu_now_s, waiting_now_s) = self._clock(), self._schedstat()
        lost_s = late_s(now_s - at_s, self.period_s, cpu_now_s - cpu_s, waiting_now_s - waiting_s)
        self.stopped_s += lost_s  # one writer; a reader sees the float whole, under the GIL
        return now_s, cpu_now_s, waiting_now_s

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)  # the thread closes its reader
        elif self._schedstat is not None:
            self._schedstat.close()
            self._schedstat = None
