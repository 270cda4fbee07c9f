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


def test_training_steps_never_sync_with_the_host(model) -> None:
    """Logged and unlogged steps, optimizer included (the timing hook), under CUDA's
    sync-debug mode."""
    monitor = attach(model, exporter=InMemoryExporter(), peak_flops_per_s=1e15, log_every=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    _step(model, monitor)  # first step: one-time set-up (index tensors, pinned buffers)
    opt.step()
    opt.zero_grad()
    torch.cuda.set_sync_debug_mode("error")  # any synchronising CUDA call now raises
    try:
        for _ in range(4):
            _step(model, monitor)
            opt.step()
            opt.zero_grad(set_to_none=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    monitor.close()


def test_cuda_compute_time_and_maxima(model) -> None:
    out = InMemoryExporter()
    monitor = attach(model, exporter=out, peak_flops_per_s=1e15, log_every=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(6):
        _step(model, monitor)
        opt.step()
        opt.zero_grad(set_to_none=True)
    monitor.close()
    ranks = out.rows("ranks")
    timed = [r["compute_time_s"] for r in ranks if r["compute_time_s"] is not None]
    assert len(timed) >= 3 and all(0 < t < 10 for t in timed), timed
    assert all(r["memory_used_bytes"] > 0 for r in ranks[1:])
    assert all(r["act_max_abs"] > 0 for r in out.rows("layers"))


def test_a_logged_steps_compute_time_is_the_mean_of_the_steps_since_the_last(model) -> None:
    """At log_every=4 with one heavy step in four, a logged step reports the mean GPU time
    of the four steps before it (the device finished them: the test waits for it), not its
    own light step's, and not the heavy step's."""
    out = InMemoryExporter()
    monitor = attach(model, exporter=out, peak_flops_per_s=1e15, log_every=4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    a = torch.randn(4096, 4096, device="cuda")
    measured_s = []
    for i in range(9):
        x = torch.randint(0, 256, (4, 128), device="cuda")
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x)
        if i % 4 == 1:  # the heavy step: 30 fp32 products of 4096^3 on the stream
            for _ in range(30):
                a = torch.tanh(a @ a)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), x.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        end.record()
        monitor.step(loss=loss, tokens=x.numel())
        torch.cuda.synchronize()  # the test's, so that every earlier step is finished
        measured_s.append(start.elapsed_time(end) / 1e3)
    monitor.close()
    reported = {r["step"]: r["compute_time_s"] for r in out.rows("ranks")}
    for step in (4, 8):
        window = measured_s[step - 4 : step]
        expected_s = sum(window) / 4
        assert reported[step] == pytest.approx(expected_s, rel=0.25), (step, reported, measured_s)
        assert reported[step] < 0.7 * max(window), "the heavy step alone"
        assert reported[step] > 1.5 * measured_s[step], "the logged (light) step alone"


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


def test_non_finite_outputs_between_logged_steps_are_counted(model) -> None:
    """On CUDA the per-step max-abs is one fused inf-norm over the block outputs: a NaN and
    a -inf on unlogged steps must come through it into the logged step's record."""
    poison = {1: float("nan"), 2: float("-inf")}
    step_now = [0]

    def poisoned(_module, _inputs, output):  # registered before attach: runs first
        bad = poison.get(step_now[0])
        return output if bad is None else output.index_fill(-1, output.new_tensor([0]).long(), bad)

    model.layers[0].register_forward_hook(poisoned)
    out = InMemoryExporter()
    monitor = attach(model, exporter=out, peak_flops_per_s=1e15, log_every=4)
    index = monitor.layers.names.index("layers.0")
    for step in range(5):
        step_now[0] = step
        _step(model, monitor)
        model.zero_grad(set_to_none=True)
    monitor.close()
    (row,) = [r for r in out.rows("layers") if r["step"] == 4 and r["layer"] == index]
    assert row["act_nonfinite_steps"] == 2
    assert row["act_max_abs"] == "NaN"  # the max of steps 1 to 4; JSON has no NaN literal


def test_a_logged_steps_forward_and_backward_hold_no_parameter_copy(model) -> None:
    """The copy behind update RMS lives only while the optimizer steps: the forward and
    backward of a logged step peak no higher than an unlogged step's, give or take much
    less than one copy of the parameters."""
    monitor = attach(model, exporter=InMemoryExporter(), peak_flops_per_s=1e15, log_every=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    peaks = {}
    for step in range(4):  # 0 and 2 are logged; AdamW's state exists from step 1 on
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        _step(model, monitor)
        torch.cuda.synchronize()
        peaks[step] = torch.cuda.max_memory_allocated()  # what is held counts too
        opt.step()
        opt.zero_grad(set_to_none=True)
    monitor.close()
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert peaks[2] - peaks[3] < param_bytes / 2, (peaks, param_bytes)


def test_block_outputs_read_beside_the_backward_match_torch(model) -> None:
    """Block outputs are read on the monitor's own stream while the backward runs: RMS,
    max-abs and exact non-finite counts still equal torch's on the same tensors, and the
    output the model returns, which its caller may change in place, is read on the training
    stream."""

    def one_nan(_module, _inputs, output):  # registered before attach: the monitor sees it
        output = output.clone()
        output[0, 0, 0] = float("nan")
        return output

    model.layers[1].register_forward_hook(one_nan)
    kept: dict[str, torch.Tensor] = {}
    names = {"layers.0": model.layers[0], "layers.1": model.layers[1], "output": model.output}
    for name, module in names.items():
        module.register_forward_hook(lambda _m, _i, out, name=name: kept.__setitem__(name, out))
    out = InMemoryExporter()
    monitor = attach(model, exporter=out, peak_flops_per_s=1e15, log_every=1)
    streams: dict[str, list] = {name: [] for name in names}
    read = monitor.activations._read

    def recording(pending, **kw):
        for index, *_ in pending:
            streams.get(monitor.layers.names[index], []).append(torch.cuda.current_stream())
        return read(pending, **kw)

    monitor.activations._read = recording
    _step(model, monitor)
    expected = {  # sync: test only
        name: (
            t.float().square().mean().sqrt().item(),
            t.float().abs().max().item(),
            int(t.isfinite().logical_not().sum()),
        )
        for name, t in kept.items()
    }
    monitor.close()
    side = monitor.activations._side
    assert streams == {"layers.0": [side], "layers.1": [side],
                       "output": [torch.cuda.current_stream()]}  # fmt: skip
    assert expected["layers.1"][2] == 1 and expected["output"][2] > 0  # the NaN spread
    rows = {monitor.layers.names[r["layer"]]: r for r in out.rows("layers")}
    for name, (rms, max_abs, nonfinite) in expected.items():
        row = rows[name]
        assert float(row["act_rms"]) == pytest.approx(rms, rel=1e-5, nan_ok=True), name
        assert float(row["act_max_abs"]) == pytest.approx(max_abs, rel=1e-6, nan_ok=True), name
        assert row["act_nonfinite_count"] == nonfinite, name
