"""The stopped clock: what a sleep lost to neither the CPU nor the run queue, on injected
readings; and a real process stopped with SIGSTOP, seen by its own clock."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time

import pytest

from trainvitals.hooks.stopped import Schedstat, StoppedClock, late_s

linux_schedstat = pytest.mark.skipif(
    not os.path.exists("/proc/thread-self/schedstat"), reason="needs Linux schedstat"
)


def test_late_is_what_neither_the_cpu_nor_the_run_queue_took() -> None:
    # Asked 10 ms, woke after 50: 1 ms on the CPU, 9 ms waiting for one, 30 ms stopped.
    assert late_s(0.050, 0.010, 0.001, 0.009) == pytest.approx(0.030)
    # A busy machine: the whole delay was the run queue's.
    assert late_s(0.050, 0.010, 0.001, 0.039) == 0.0
    assert late_s(0.009, 0.010, 0.0, 0.0) == 0.0  # woke early (clock granularity)


class Thread:
    """A thread's schedstat readings (CPU time, run-queue wait), moved by the test."""

    def __init__(self) -> None:
        self.cpu_s, self.waiting_s = 0.0, 0.0

    def __call__(self) -> tuple[float, float]:
        return self.cpu_s, self.waiting_s

    def close(self) -> None:
        pass


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def test_ticks_add_up_only_the_stops() -> None:
    own, training, now = Thread(), Thread(), Clock()
    clock = StoppedClock(0.01, schedstat=lambda path: training, clock=now, start=False)  # type: ignore[arg-type, return-value]
    assert clock.stopped_s == 0.0
    reading = clock.read(own)
    # The training thread blocked throughout (a collective): an on-time wake; one delayed
    # 20 ms by the run queue; one 25 ms late with 5 ms of that on the run queue, the
    # other 20 ms stopped.
    for elapsed_s, waiting_s in ((0.010, 0.0), (0.030, 0.020), (0.035, 0.005)):
        now.now_s += elapsed_s
        own.waiting_s += waiting_s
        reading = clock.tick(own, reading)
    assert clock.stopped_s == pytest.approx(0.020)
    assert reading == (now.now_s, 0.0, own.waiting_s, 0.0, 0.0)


def test_a_gil_held_by_a_computing_training_thread_is_no_stop() -> None:
    own, training, now = Thread(), Thread(), Clock()
    clock = StoppedClock(0.01, schedstat=lambda path: training, clock=now, start=False)  # type: ignore[arg-type, return-value]
    reading = clock.read(own)
    # Woke 5 ms late: the training thread ran Python all 15 ms, holding the GIL.
    now.now_s += 0.015
    training.cpu_s += 0.015
    reading = clock.tick(own, reading)
    assert clock.stopped_s == 0.0
    # It ran 12 of the next 15 ms and waited for a CPU 1: 2 ms of the 5 late were a stop.
    now.now_s += 0.015
    training.cpu_s += 0.012
    training.waiting_s += 0.001
    clock.tick(own, reading)
    assert clock.stopped_s == pytest.approx(0.002)


def test_without_schedstat_it_is_nan_and_runs_no_thread() -> None:
    def missing(path: str) -> Schedstat:
        raise FileNotFoundError(path)

    clock = StoppedClock(schedstat=missing)
    assert math.isnan(clock.stopped_s) and clock._thread is None
    clock.close()


@linux_schedstat
def test_schedstat_is_read_in_seconds_and_again_in_place() -> None:
    read = Schedstat()
    try:
        cpu_s, waiting_s = read()
        assert cpu_s > 0 and waiting_s >= 0
        assert cpu_s < time.process_time() + 1  # seconds, not ns
        spin_until = time.thread_time() + 0.05
        while time.thread_time() < spin_until:
            pass
        assert read()[0] >= cpu_s + 0.04  # the same open file, read again: moved on
    finally:
        read.close()


CHILD = """
import sys, time
from trainvitals.hooks.stopped import StoppedClock
clock = StoppedClock()
print("ready", flush=True)
sys.stdin.readline()  # the parent stops and continues this process meanwhile
time.sleep(0.2)  # a few more wake-ups after SIGCONT
print(clock.stopped_s, flush=True)
clock.close()
"""


@linux_schedstat
@pytest.mark.parametrize("stop_s", [0.0, 0.4])
def test_a_real_process_sees_its_sigstop(stop_s: float) -> None:
    """A real SIGSTOP of `stop_s`: seen, within one period (10 ms) plus the run-queue wait
    after SIGCONT, which is not counted. Unstopped, the clock stays near 0 whatever the
    machine's load: waiting for a CPU is not being stopped."""
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        time.sleep(0.3)
        stopped_at = time.monotonic()
        if stop_s:
            os.kill(child.pid, signal.SIGSTOP)
            time.sleep(stop_s)
            os.kill(child.pid, signal.SIGCONT)
        held_s = time.monotonic() - stopped_at  # at least stop_s, longer on a busy machine
        child.stdin.write("\n")
        child.stdin.flush()
        seen_s = float(child.stdout.readline())
    finally:
        child.kill()
        child.wait()
    if stop_s:
        assert stop_s - 0.02 <= seen_s <= held_s + 0.05, (seen_s, held_s)
    else:
        assert seen_s < 0.05, seen_s
