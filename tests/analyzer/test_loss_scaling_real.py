"""fp16 training with a real dynamic loss scaler (torch.amp.GradScaler) through the hooks and
the analyzer: the scaler's overflows, which it skips by design, are not `nonfinite` alerts
when the run says it scales its loss dynamically; gradients that overflow at every scale
still are. One process, a small model, fp16 autocast on the CPU."""

from __future__ import annotations

import itertools
import math

import torch
from torch import nn

from trainvitals.analyzer import Analyzer
from trainvitals.hooks import InMemoryExporter, attach
from trainvitals.schema import to_arrow

STEPS = 300


def train(loss_scaling: str, poison_from: int | None = None) -> tuple[list, int]:
    """(the analyzer's alerts, how many times the scaler lowered its scale). From
    `poison_from`, one layer's gradient is infinite whatever the scale."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64), nn.ReLU(),
                          nn.Linear(64, 1))  # fmt: skip
    out = InMemoryExporter()
    monitor = attach(model, log_every=1, exporter=out, loss_scaling=loss_scaling)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    # Far too high a first scale and frequent growth: the scaler overflows often.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24, growth_interval=30)
    scales = []
    for step in range(STEPS):
        x = torch.randn(32, 64)
        with torch.autocast("cpu", dtype=torch.float16):
            y = model(x)
        loss = y.float().square().mean()
        scaler.scale(loss).backward()
        if poison_from is not None and step >= poison_from:
            model[2].weight.grad[0, 0] = math.inf
        scaler.unscale_(opt)  # the hooks read unscaled gradients, as clipping needs them
        monitor.step(loss=loss, tokens=32)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
    monitor.close()
    analyzer, alerts = Analyzer(), []
    for batch in out.batches:
        alerts += analyzer.observe(*to_arrow(batch))
    return alerts, sum(b < a for a, b in itertools.pairwise(scales))


def test_the_scalers_overflows_are_not_alerts_under_dynamic_loss_scaling() -> None:
    alerts, lowered = train("dynamic")
    assert lowered >= 5  # real overflows, each a skipped step
    assert [a for a in alerts if a.kind == "nonfinite"] == []
    # Without saying so, each overflow looks like training gone wrong.
    unsaid, _ = train("none")
    assert len([a for a in unsaid if a.kind == "nonfinite"]) >= 3


def test_gradients_that_overflow_at_every_scale_are_an_alert() -> None:
    alerts, _ = train("dynamic", poison_from=200)
    (alert,) = [a for a in alerts if a.kind == "nonfinite"]
    assert alert.step == 220  # 20 steps (overflow_steps) of overflows on every logged step
    assert "overflowed on every logged step since step 200" in alert.message
