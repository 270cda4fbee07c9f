"""The monitor on a CUDA device: no host synchronisation, correct records. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trainvitals.hooks import InMemoryExporter, attach
from trainvitals.trainer.model import PRESETS, Transformer

pytestmark = pytest.mark.gpu


@pytest.fixture
def model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(PRESETS["small"]).cuda()


def _step(model, monitor) -> torch.Tensor:
    x = torch.randint(0, 256, (4, 128), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(x)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), x.flatten())
    loss.backward()
    monitor.step(loss=loss, tokens=x.numel())
    return loss


def test_logged_steps_never_sync_with_the_host(model) -> None:
    monitor = attach(model, exporter=InMemoryExporter(), peak_flops_per_s=1e15, log_every=1)
    _step(model, monitor)  # first step: one-time set-up (index tensors, pinned buffers)
    model.zero_grad()
    torch.cuda.set_sync_debug_mode("error")  # any synchronising CUDA call now raises
    try:
        for _ in range(3):
            _step(model, monitor)
            model.zero_grad(set_to_none=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    monitor.close()


def test_records_on_cuda_match_torch(model) -> None:
    out = InMemoryExporter()
    monitor = attach(model, exporter=out, peak_flops_per_s=1e15, log_every=1)
    loss = _step(model, monitor)
    expected = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9).item()  # sync: test only
    monitor.close()
    (step,) = out.rows("steps")
    assert step["grad_norm"] == pytest.approx(expected, rel=1e-5)
    assert step["loss"] == pytest.approx(loss.item(), rel=1e-6)
    assert len(out.rows("layers")) == PRESETS["small"].n_layers + 3  # + embedding, norm, head
    (run,) = out.rows("runs")
    assert run["device_type"] == "cuda"
