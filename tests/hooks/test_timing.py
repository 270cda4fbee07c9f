"""StepTimer: a logged step reports the mean data and compute time of the steps since the
previous logged one, measured on injected clocks (no wall-clock assertion)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from trainvitals.hooks.stopped import StoppedClock
from trainvitals.hooks.timing import StepTimer


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def _run_steps(timer: StepTimer, model: nn.Module, opt, wall: Clock, cpu: Clock,
               steps: list[tuple[float, float]]) -> None:  # fmt: skip
    """One training step per (data wait, CPU compute) pair, in seconds."""
    for data_s, compute_s in steps:
        wall.now_s += data_s  # the loop fetches its batch
        loss = model(torch.ones(1, 2)).sum()  # the first forward ends the data wait
        loss.backward()
        cpu.now_s += compute_s  # what forward, backward and the optimizer cost the thread
        opt.step()
        opt.zero_grad()
        timer.end_step(loss.detach())


@pytest.fixture
def timed():
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    wall, cpu = Clock(), Clock()
    # A stopped clock without its thread: the test moves its total by hand.
    stopped = StoppedClock(start=False)
    timer = StepTimer(model, torch.device("cpu"), wall_clock=wall, cpu_clock=cpu, stopped=stopped)
    yield timer, model, opt, wall, cpu
    timer.close()


def test_a_logged_step_reports_the_mean_since_the_last_logged_one(timed) -> None:
    timer, model, opt, wall, cpu = timed
    # Logged every 4 steps: the fourth step alone (0.5 s of compute, 0.4 s of data wait)
    # would stand for all four; their mean is 0.2 s and 0.1 s.
    _run_steps(timer, model, opt, wall, cpu, [(0.0, 0.1), (0.0, 0.1), (0.0, 0.1), (0.4, 0.5)])
    got = timer.collect(step=3, steps=4)
    assert got["compute_time_s"] == pytest.approx(0.2)
    assert got["data_time_s"] == pytest.approx(0.1)
    # The sums start over: the next logged step (every step logged) is its own step's.
    _run_steps(timer, model, opt, wall, cpu, [(0.05, 0.3)])
    got = timer.collect(step=4, steps=1)
    assert got["compute_time_s"] == pytest.approx(0.3)
    assert got["data_time_s"] == pytest.approx(0.05)


def test_a_wait_in_an_earlier_pre_forward_hook_is_not_data_time() -> None:
    # FSDP's root pre-forward hook, registered when the model was sharded (before the
    # monitor attached), runs the root's all-gather and waits in it for the slowest rank:
    # 0.3 s here. Counted as data time, a rank's data-parallel peers showed its slow data
    # loading as their own.
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    wall, cpu = Clock(), Clock()

    def all_gather(_module, _args) -> None:
        wall.now_s += 0.3

    model.register_forward_pre_hook(all_gather)
    timer = StepTimer(model, torch.device("cpu"), wall_clock=wall, cpu_clock=cpu)
    try:
        _run_steps(timer, model, opt, wall, cpu, [(0.05, 0.1)])
        assert timer.collect(step=0, steps=1)["data_time_s"] == pytest.approx(0.05)
    finally:
        timer.close()


def test_a_logged_step_reports_the_mean_time_stopped_since_the_last_one(timed) -> None:
    timer, model, opt, wall, cpu = timed
    _run_steps(timer, model, opt, wall, cpu, [(0.0, 0.1)])
    timer.stopped.stopped_s += 0.3  # stopped 300 ms in the second of two steps
    _run_steps(timer, model, opt, wall, cpu, [(0.0, 0.1)])
    assert timer.collect(step=1, steps=2)["stopped_time_s"] == pytest.approx(0.15)
    _run_steps(timer, model, opt, wall, cpu, [(0.0, 0.1)])
    assert timer.collect(step=2, steps=1)["stopped_time_s"] == 0.0


def test_cuda_ranks_run_no_stopped_clock() -> None:
    """Their event time already spans a stop of the host: no thread, NaN reported."""
    model = nn.Linear(2, 2)
    timer = StepTimer(model, torch.device("cuda"))  # nothing here touches the device
    try:
        assert timer.stopped is None
        assert math.isnan(timer.collect(step=0, steps=1)["stopped_time_s"])
    finally:
        timer.close()


def test_a_report_without_steps_is_nan(timed) -> None:
    timer = timed[0]
    got = timer.collect(step=0, steps=1)
    assert math.isnan(got["compute_time_s"]) and math.isnan(got["data_time_s"])


class FakeEvent:
    """Stands in for torch.cuda.Event, which needs a GPU (no GPU here): `query()` says
    whether the device passed it, `elapsed_time` the milliseconds from `start`."""

    def __init__(self, at_ms: float, passed: bool = True) -> None:
        self.at_ms, self.passed = at_ms, passed

    def query(self) -> bool:
        return self.passed

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.passed and end.passed, "elapsed_time on an event not yet passed syncs"
        return end.at_ms - self.at_ms


def test_on_cuda_a_report_averages_the_steps_the_device_finished(timed) -> None:
    timer = timed[0]
    timer.cuda = True
    # Three steps finished since the last report (100, 200 and 300 ms); the fourth is
    # still running on the device, and is not read.
    spans = [(0, 100), (100, 300), (300, 600)]
    timer._done.extend((FakeEvent(a), FakeEvent(b)) for a, b in spans)
    running = (FakeEvent(600), FakeEvent(700, passed=False))
    timer._done.append(running)
    assert timer.collect(step=3, steps=4)["compute_time_s"] == pytest.approx(0.2)
    assert list(timer._done) == [running]
    # Nothing new finished by the next report: the last finished step's mean again.
    assert timer.collect(step=4, steps=1)["compute_time_s"] == pytest.approx(0.2)
    running[1].passed = True
    assert timer.collect(step=5, steps=1)["compute_time_s"] == pytest.approx(0.1)
