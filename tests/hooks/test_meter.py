"""The meter protocol (hooks/meter.py): every meter is a Meter, and the monitor drives them
through it alone."""

from __future__ import annotations

import torch
from torch import nn

from trainvitals.hooks import InMemoryExporter, attach
from trainvitals.hooks.meter import Every, Meter


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))


def test_every_meter_is_a_meter() -> None:
    monitor = attach(_model(), exporter=InMemoryExporter(), log_every=1)
    try:
        kinds = {type(m).__name__ for m in monitor.meters}
        assert kinds == {
            "ActivationMeter", "CommsMeter", "StepTimer", "UpdateMeter", "PowerSampler",
            "Canary", "ReplicaFingerprint",
        }  # fmt: skip
        assert all(isinstance(m, Meter) for m in monitor.meters)
    finally:
        monitor.close()


class _Spy:
    """A meter that records the verbs it is called with and adds nothing to the slot."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def start_step(self, logged: bool) -> None:
        self.calls.append(("start_step", logged))

    def end_step(self, loss: torch.Tensor) -> None:
        self.calls.append(("end_step",))

    def collect(self, step: int, steps: int) -> dict:
        self.calls.append(("collect", step, steps))
        return {}

    def close(self) -> None:
        self.calls.append(("close",))


def test_the_monitor_drives_meters_through_the_protocol() -> None:
    model, out = _model(), InMemoryExporter()
    monitor = attach(model, exporter=out, log_every=2)
    spy = _Spy()
    assert isinstance(spy, Meter)
    monitor.meters.append(spy)  # adding a meter is one line
    for _ in range(4):  # steps 0..3: 0 and 2 logged
        model(torch.ones(2, 4)).sum().backward()
        monitor.step(loss=torch.tensor(1.0), tokens=2)
    monitor.close()
    assert spy.calls == [
        ("end_step",), ("collect", 0, 1), ("start_step", False),
        ("end_step",), ("start_step", True),
        ("end_step",), ("collect", 2, 2), ("start_step", False),
        ("end_step",), ("start_step", True),
        ("close",),
    ]  # fmt: skip
    assert len(out.rows("steps")) == 2


def test_every_schedule() -> None:
    never = Every(0)
    assert not any(never.due(s) for s in range(100))
    every = Every(50, first_step=7)  # first logged step at or after each multiple of 50
    assert [s for s in range(0, 200, 10) if every.due(s)] == [50, 100, 150]
    resumed = Every(50, first_step=0)
    assert [s for s in (0, 3, 49, 51, 60, 100) if resumed.due(s)] == [0, 51, 100]
