"""update_rms: the change the optimizer step before a logged step made, measured around that
step, for one optimizer, several, or a hand-written update."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from trainvitals.hooks import InMemoryExporter, attach
from trainvitals.trainer.model import PRESETS, Transformer

TOKENS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))


@pytest.fixture
def model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(PRESETS["tiny"])


def _rows(out: InMemoryExporter) -> dict[tuple[int, str], dict]:
    names = json.loads(out.rows("runs")[0]["layer_names_json"])
    return {(r["step"], names[r["layer"]]): r for r in out.rows("layers")}


def _expected_rms(lr: float, grad_norm: float, module: torch.nn.Module) -> float:
    """Plain SGD (no momentum, no decay): the change is -lr x gradient."""
    numel = sum(p.numel() for p in module.parameters())
    return lr * grad_norm / numel**0.5


def _steps(model, monitor, update, steps: int = 2) -> None:
    for _ in range(steps):
        F.cross_entropy(model(TOKENS).flatten(0, 1), TOKENS.flatten()).backward()
        monitor.step(loss=torch.tensor(1.0), tokens=TOKENS.numel())
        update()


def _logged_rows(model, update) -> dict[tuple[int, str], dict]:
    """The layers rows of two steps, each logged, with `update` after each."""
    out = InMemoryExporter()
    monitor = attach(model, exporter=out, log_every=1)
    _steps(model, monitor, update)
    monitor.close()
    return _rows(out)


def test_two_optimizers_and_a_frozen_layer_are_each_measured(model) -> None:
    """Embedding at lr 0.1, blocks and head at lr 0.01, the final norm in no optimizer:
    every layer's update RMS is its own lr x grad norm / sqrt(n), the norm's is 0."""
    embed = torch.optim.SGD(model.tok_embeddings.parameters(), lr=0.1)
    rest = torch.optim.SGD([*model.layers.parameters(), *model.output.parameters()], lr=0.01)

    def update() -> None:
        embed.step()
        rest.step()
        model.zero_grad()

    rows = _logged_rows(model, update)
    assert rows[0, "tok_embeddings"]["update_rms"] is None  # no step before the first
    for name, module, lr in [
        ("tok_embeddings", model.tok_embeddings, 0.1),
        ("layers.1", model.layers[1], 0.01),
        ("output", model.output, 0.01),
    ]:
        expected = _expected_rms(lr, rows[0, name]["grad_norm"], module)
        assert rows[1, name]["update_rms"] == pytest.approx(expected, rel=1e-5), name
    assert rows[1, "norm"]["update_rms"] == 0.0


def test_an_update_that_wrote_nan_weights_is_nan_not_unmeasured(model) -> None:
    """None says no update was measured; a step that wrote NaN into the weights must not
    read the same (a NaN gradient on step 0 reaches the weights through SGD)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    poisoned = [True]

    def update() -> None:
        if poisoned.pop() if poisoned else False:
            model.layers[0].attention.wq.weight.grad[0, 0] = float("nan")
        opt.step()
        opt.zero_grad()

    rows = _logged_rows(model, update)
    assert rows[0, "layers.0"]["update_rms"] is None  # no step before the first
    assert rows[1, "layers.0"]["update_rms"] == "NaN"  # on the wire: JSON has no NaN literal
    expected = _expected_rms(0.1, rows[0, "layers.1"]["grad_norm"], model.layers[1])
    assert rows[1, "layers.1"]["update_rms"] == pytest.approx(expected, rel=1e-5)


def test_a_hand_written_update_is_measured_at_the_step_boundary(model) -> None:
    @torch.no_grad()
    def update() -> None:
        for p in model.parameters():
            p -= 0.1 * p.grad
        model.zero_grad()

    rows = _logged_rows(model, update)
    expected = _expected_rms(0.1, rows[0, "layers.0"]["grad_norm"], model.layers[0])
    assert rows[1, "layers.0"]["update_rms"] == pytest.approx(expected, rel=1e-5)


def test_the_copy_lives_only_while_the_optimizer_steps(model) -> None:
    """With a torch optimizer, the parameters are copied in its pre-hook and the copy is
    gone after its post-hook: none is held through the next forward and backward."""
    monitor = attach(model, exporter=InMemoryExporter(), log_every=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    copies_seen: list[int] = []
    meter = monitor.update

    def count_copies(*_):  # runs after the meter's pre-hook, inside the step
        copies_seen.append(sum(len(c) for c in meter._before.values()))

    opt.register_step_pre_hook(count_copies)  # per-optimizer hooks run after global ones
    held = []

    def update() -> None:
        opt.step()
        opt.zero_grad()
        held.append((meter._boundary_copy, dict(meter._before)))

    _steps(model, monitor, update, steps=4)
    monitor.close()
    n = len(list(model.parameters()))
    # Steps 1 and 3 come before logged steps: their optimizer steps are measured.
    assert copies_seen == [0, n, 0, n]
    assert all(copy is None and before == {} for copy, before in held)
