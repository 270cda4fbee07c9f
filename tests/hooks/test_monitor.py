"""The monitor on a single-process model: records, logging interval, and no host syncs."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch.distributed._functional_collectives import AsyncCollectiveTensor

from trainvitals.hooks import InMemoryExporter, Monitor, NullMonitor, attach
from trainvitals.hooks.activations import split_by_stream
from trainvitals.trainer.model import PRESETS, Transformer

SYNCING = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")


def _train(monitor, model, steps: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = torch.randint(0, 256, (2, 16), generator=gen)
        loss = F.cross_entropy(model(x).flatten(0, 1), x.flatten())
        loss.backward()
        monitor.step(loss=loss, tokens=x.numel(), lr=0.1)
        opt.step()
        opt.zero_grad()


@pytest.fixture
def model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(PRESETS["tiny"])


@pytest.mark.slow
def test_records_for_every_logged_step_and_layer(model) -> None:
    out = InMemoryExporter()
    monitor = attach(model, exporter=out, log_every=2, peak_flops_per_s=1e12, run_id="t")
    _train(monitor, model, 7)
    monitor.close()
    (run,) = out.rows("runs")
    assert run["n_layers"] == 5 and run["world_size"] == 1 and run["peak_flops_per_s"] == 1e12
    assert [r["step"] for r in out.rows("steps")] == [0, 2, 4, 6]
    assert len(out.rows("layers")) == 4 * 5 and len(out.rows("ranks")) == 4
    for row in out.rows("layers"):
        assert row["grad_norm"] > 0 and row["act_rms"] > 0
    step = out.rows("steps")[0]
    assert step["tokens"] == 32 and 0 < step["mfu_ratio"] < 1


def test_global_grad_norm_equals_torch_clip_norm(model) -> None:
    out = InMemoryExporter()
    monitor = attach(model, exporter=out, peak_flops_per_s=1e12, log_every=1)
    x = torch.randint(0, 256, (2, 16))
    F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
    monitor.step(loss=torch.tensor(1.0), tokens=32)
    expected = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9).item()
    monitor.close()
    assert out.rows("steps")[0]["grad_norm"] == pytest.approx(expected, rel=1e-6)


def test_training_step_makes_no_host_sync(model, monkeypatch) -> None:
    """Forward (activation hooks), backward, monitor.step and the optimizer step (timing
    hook), on a logged and an unlogged step: nothing is read back to the host."""
    monitor = attach(model, exporter=InMemoryExporter(), peak_flops_per_s=1e12, log_every=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls: list[str] = []
    training_thread = threading.current_thread()
    for name in SYNCING:
        original = getattr(torch.Tensor, name)

        def spy(self, *a, _name=name, _orig=original, **k):
            if threading.current_thread() is training_thread:
                calls.append(_name)
            return _orig(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, spy)
    x = torch.randint(0, 256, (2, 16))
    for _ in range(4):
        loss = F.cross_entropy(model(x).flatten(0, 1), x.flatten())
        loss.backward()
        monitor.step(loss=loss, tokens=32)
        opt.step()
        opt.zero_grad()
    assert calls == []
    monkeypatch.undo()
    monitor.close()


@pytest.mark.slow
def test_maxima_and_nonfinite_counts_accumulate_between_logged_steps(model) -> None:
    """A NaN and a spike on unlogged steps reach the next logged step's records."""
    out = InMemoryExporter()
    monitor = attach(model, exporter=out, log_every=4, peak_flops_per_s=1e12, run_id="t")
    block = model.layers[0]
    seen_max: list[float] = []
    step = {"n": 0}

    def poison(_m, _i, output):
        if step["n"] == 5:  # unlogged: logged steps are 0, 4, 8
            output = output.clone()
            output[0, 0, :3] = float("nan")
        if step["n"] == 2:
            output = output * 100.0
        seen_max.append(output.detach().abs().nan_to_num(0.0).max().item())
        return output

    block.register_forward_hook(poison, prepend=True)  # the monitor's hook sees the result
    x = torch.randint(0, 256, (2, 16))
    for n in range(9):  # no optimizer step: the NaN gradients of step 5 stay in step 5
        step["n"] = n
        loss = F.cross_entropy(model(x).flatten(0, 1), x.flatten())
        loss.backward()
        monitor.step(loss=loss, tokens=32)
        model.zero_grad()
    monitor.close()
    layer0 = {r["step"]: r for r in out.rows("layers") if r["layer"] == 1}  # layers.0
    steps = {r["step"]: r for r in out.rows("steps")}
    assert layer0[4]["act_max_abs"] == pytest.approx(max(seen_max[1:5]), rel=1e-6)
    assert layer0[4]["act_max_abs"] > 50 * layer0[0]["act_max_abs"]  # the spike at step 2
    assert layer0[4]["act_nonfinite_steps"] == 0 and steps[4]["nonfinite_steps"] == 0
    assert layer0[8]["act_nonfinite_steps"] == 1  # step 5's NaNs, seen although unlogged
    assert steps[8]["nonfinite_steps"] == 1
    assert layer0[8]["act_max_abs"] == "NaN"  # on the wire: JSON has no NaN literal
    assert layer0[8]["act_nonfinite_count"] == 0  # the values of step 8 itself are finite


def _train_poisoned(model, monitor, steps: int, poison: Callable) -> None:
    """Steps without an optimizer; poison(step, output) may replace the first block's output
    before the monitor sees it. Closes the monitor."""
    step = {"n": 0}
    model.layers[0].register_forward_hook(lambda _m, _i, y: poison(step["n"], y), prepend=True)
    x = torch.randint(0, 256, (2, 16))
    for n in range(steps):
        step["n"] = n
        F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
        monitor.step(loss=torch.tensor(1.0), tokens=32)
        model.zero_grad()
    monitor.close()


def test_a_minus_inf_output_between_logged_steps_is_its_largest_magnitude(model) -> None:
    """One -inf on an unlogged step: the max-abs of the interval is +inf, and the step
    is counted (the CUDA path, a fused inf-norm, is in test_gpu.py)."""
    out = InMemoryExporter()

    def poison(step: int, output: torch.Tensor) -> torch.Tensor:
        if step != 1:
            return output
        output = output.clone()
        output[1, 2, 3] = float("-inf")
        return output

    _train_poisoned(model, attach(model, exporter=out, log_every=4), 5, poison)
    layer0 = {r["step"]: r for r in out.rows("layers") if r["layer"] == 1}
    assert layer0[4]["act_max_abs"] == "Infinity" and layer0[4]["act_nonfinite_steps"] == 1
    assert layer0[0]["act_nonfinite_steps"] == 0 and 0 < layer0[0]["act_max_abs"] < 100


@pytest.mark.slow
@pytest.mark.parametrize("total_steps", [11, None])
def test_the_steps_after_the_last_interval_are_logged_when_total_steps_is_known(
    model, total_steps
) -> None:
    """11 steps, logged every 4: a NaN output at step 9 lies after the last interval. With
    total_steps the last step (10) is logged and carries it; without, run_end counts the
    two steps that were not exported."""
    out = InMemoryExporter()
    monitor = attach(model, exporter=out, log_every=4, total_steps=total_steps)
    _train_poisoned(
        model, monitor, 11, lambda step, y: y.clone().fill_(float("nan")) if step == 9 else y
    )
    steps = {r["step"]: r for r in out.rows("steps")}
    (end,) = out.rows("events")
    tail = json.loads(end["detail"])["unlogged_tail_steps"]
    if total_steps is None:
        assert sorted(steps) == [0, 4, 8] and tail == 2
        return
    assert sorted(steps) == [0, 4, 8, 10] and tail == 0
    assert steps[8]["nonfinite_steps"] == 0 and steps[10]["nonfinite_steps"] == 1
    layer0 = {r["step"]: r for r in out.rows("layers") if r["layer"] == 1}
    assert layer0[10]["act_nonfinite_steps"] == 1 and layer0[10]["act_max_abs"] == "NaN"
    assert layer0[10]["act_nonfinite_count"] == 0  # step 10's own outputs are finite


@pytest.mark.slow
def test_long_interval_and_micro_batches_keep_every_maximum(model) -> None:
    """Over an interval longer than a fold (FOLD_STEPS) and with two forwards per step, the
    logged step still sees the largest output of any micro-batch and every bad step."""
    from trainvitals.hooks.activations import FOLD_STEPS

    every = FOLD_STEPS + 16
    out = InMemoryExporter()
    monitor = attach(model, exporter=out, log_every=every, peak_flops_per_s=1e12, run_id="t")
    now = {"step": 0, "micro": 0}
    seen_max: list[float] = []

    def spike(_m, _i, output):
        if (now["step"], now["micro"]) == (10, 0):  # before the first fold
            output = output * 100.0
        seen_max.append(output.detach().abs().max().item())
        return output

    def nan(_m, _i, output):
        if (now["step"], now["micro"]) == (every - 3, 1):  # after it
            output = output.clone()
            output[0, 0, 0] = float("nan")
        return output

    model.layers[0].register_forward_hook(spike, prepend=True)
    model.layers[1].register_forward_hook(nan, prepend=True)
    x = torch.randint(0, 256, (2, 16))
    for n in range(every + 1):
        now["step"] = n
        for micro in range(2):
            now["micro"] = micro
            F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
        loss = torch.tensor(float("inf") if n == 30 else 1.0)  # a bad loss on its own
        monitor.step(loss=loss, tokens=64)
        model.zero_grad()
    monitor.close()
    layers = {(r["step"], r["layer"]): r for r in out.rows("layers")}
    steps = {r["step"]: r for r in out.rows("steps")}
    assert set(steps) == {0, every}
    spiked = layers[every, 1]["act_max_abs"]  # layers.0: steps 1 to `every`, both micro-batches
    assert spiked == pytest.approx(max(seen_max[2:]), rel=1e-6)
    assert (
        spiked > 50 * layers[0, 1]["act_max_abs"] and layers[every, 1]["act_nonfinite_steps"] == 0
    )
    assert layers[every, 2]["act_max_abs"] == "NaN" and layers[every, 2]["act_nonfinite_steps"] == 1
    assert steps[every]["nonfinite_steps"] == 2  # the NaN output's step and the bad loss's


def test_nonfinite_values_of_a_logged_step_are_counted(model) -> None:
    out = InMemoryExporter()
    monitor = attach(model, exporter=out, log_every=1, peak_flops_per_s=1e12, run_id="t")

    def poison(_m, _i, output):
        output = output.clone()
        output[0, 0, :3] = float("inf")
        return output

    model.layers[0].register_forward_hook(poison, prepend=True)
    x = torch.randint(0, 256, (2, 16))
    F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
    monitor.step(loss=torch.tensor(1.0), tokens=32)
    monitor.close()
    layer0 = next(r for r in out.rows("layers") if r["layer"] == 1)
    assert layer0["act_nonfinite_count"] == 3 and layer0["act_nonfinite_steps"] == 1
    (step,) = out.rows("steps")
    grad_bad = sum(r["nonfinite_count"] for r in out.rows("layers"))
    assert grad_bad > 0 and step["nonfinite_count"] >= 3 + grad_bad
    # The rank's own gradient norm says so too: NaN, not null (null: not measured).
    (rank,) = out.rows("ranks")
    assert rank["grad_norm_local"] == "NaN"  # on the wire: JSON has no NaN literal


def test_data_time_is_the_wait_before_forward(model) -> None:
    out = InMemoryExporter()
    monitor = attach(model, exporter=out, log_every=1, peak_flops_per_s=1e12)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randint(0, 256, (2, 16))
    for _ in range(3):
        time.sleep(0.05)  # "loading" the batch
        loss = F.cross_entropy(model(x).flatten(0, 1), x.flatten())
        loss.backward()
        monitor.step(loss=loss, tokens=32)
        opt.step()
        opt.zero_grad()
    monitor.close()
    ranks = out.rows("ranks")
    assert all(0.05 <= r["data_time_s"] < r["step_time_s"] for r in ranks[1:])
    assert all(r["compute_time_s"] > 0 and r["grad_norm_local"] > 0 for r in ranks)
    # A CPU rank measures the time it was stopped (none here, but GIL waits: a little).
    assert all(0 <= r["stopped_time_s"] < r["step_time_s"] for r in ranks)


def test_bad_config_is_refused(model) -> None:
    with pytest.raises(ValueError, match="log_every"):
        attach(model, log_every=0)
    with pytest.raises(ValueError, match="total_steps must be >= 1, got 0"):
        attach(model, total_steps=0)
    with pytest.raises(ValueError, match="run_id 'my run/3' is not valid"):
        attach(model, run_id="my run/3")  # at attach, not as rejected batches later
    with pytest.raises(ValueError, match="stopped_interval_s must be >= 0, got -1"):
        attach(model, stopped_interval_s=-1)
    with pytest.raises(ValueError, match=r"loss_scaling must be one of \['none', 'dynamic'\]"):
        attach(model, loss_scaling="fp16")


def test_the_stopped_clock_can_be_turned_off(model) -> None:
    out = InMemoryExporter()
    monitor = attach(model, exporter=out, log_every=1, peak_flops_per_s=1e12,
                     stopped_interval_s=0)  # fmt: skip
    assert monitor.timer.stopped is None
    _train(monitor, model, 2)
    monitor.close()
    assert all(r.get("stopped_time_s") in (None, "NaN") for r in out.rows("ranks"))


def test_exporter_failure_never_reaches_training(model) -> None:
    class Broken:
        def export(self, batch):
            raise OSError("disk full")

        def shutdown(self, timeout_s):
            pass

    monitor = attach(model, exporter=Broken(), peak_flops_per_s=1e12)
    _train(monitor, model, 2)
    monitor.close()


def test_param_norm_and_update_rms_match_plain_sgd(model) -> None:
    out = InMemoryExporter()
    monitor = attach(model, exporter=out, peak_flops_per_s=1e12, log_every=1)
    embedding_norm = model.tok_embeddings.weight.norm().item()
    _train(monitor, model, 2)  # SGD, lr 0.1: the update is exactly -0.1 x gradient
    monitor.close()
    rows = {(r["step"], r["layer"]): r for r in out.rows("layers")}
    assert rows[0, 0]["param_norm"] == pytest.approx(embedding_norm, rel=1e-6)
    assert rows[0, 0]["update_rms"] is None  # no optimizer step before the first step
    numel = model.tok_embeddings.weight.numel()
    expected = 0.1 * rows[0, 0]["grad_norm"] / numel**0.5
    assert rows[1, 0]["update_rms"] == pytest.approx(expected, rel=1e-5)


@pytest.mark.slow
def test_the_canary_runs_on_the_first_logged_step_after_each_interval(model) -> None:
    """Logged every 3 steps, a canary every 4: it runs at 0, 6, 9 and 12, the first logged
    step at or after each multiple of 4 (at multiples of both, it ran at 0 and 12 only)."""
    out = InMemoryExporter()
    monitor = attach(model, exporter=out, log_every=3, canary_every=4, peak_flops_per_s=1e12)
    _train(monitor, model, 13)
    monitor.close()
    canaries = [r["step"] for r in out.rows("ranks") if r["canary_fingerprint"] is not None]
    assert canaries == [0, 6, 9, 12]


@pytest.mark.slow
def test_flush_exports_what_is_queued_without_ending_the_run(model) -> None:
    """What a process about to die calls (an injected crash): the steps and events queued
    so far reach the exporter, and no run_end says the run ended cleanly."""
    out = InMemoryExporter()
    monitor = attach(model, exporter=out, log_every=1, export_interval_s=60.0)
    _train(monitor, model, 2)
    monitor.event("fault", 1, rank=0, detail={"kind": "crash"})
    assert monitor.flush(timeout_s=30.0)
    assert [r["step"] for r in out.rows("steps")] == [0, 1]
    assert [r["kind"] for r in out.rows("events")] == ["fault"]
    monitor.close()
    assert [r["kind"] for r in out.rows("events")] == ["fault", "run_end"]


def test_the_returned_output_and_wrappers_are_read_in_stream_order() -> None:
    """On CUDA the block outputs are read on a side stream, except the one the model
    returns (its caller may change it in place; a view of it counts as it) and tensors
    without storage of their own, which the allocator cannot be told about. The split is
    the same on any device, so it is checked here on CPU."""
    block, head = torch.randn(4, 8), torch.randn(4, 3)
    wrapper = AsyncCollectiveTensor(torch.randn(4, 8))  # no storage of its own
    pending = [(0, block), (1, wrapper), (2, head)]
    inline, beside = split_by_stream(pending, head[:, 1:])  # the model returned a view
    assert [e[0] for e in inline] == [1, 2] and [e[0] for e in beside] == [0]
    inline, beside = split_by_stream(pending, None)  # read at step end: nothing returned
    assert [e[0] for e in inline] == [1] and [e[0] for e in beside] == [0, 2]
    # A returned wrapper is unwrapped first (AsyncCollectiveTensor: waited on) and compared.
    inline, _ = split_by_stream([(0, block), (2, head)], AsyncCollectiveTensor(head))
    assert [e[0] for e in inline] == [2]


def test_the_null_monitor_answers_everything_the_monitor_does() -> None:
    # Monitoring off (`trainvitals train --hooks off`, the supervisor's re-run of a step)
    # goes through the same loop: a method the null monitor lacks is a crash there.
    def public(cls: type) -> set[str]:
        return {name for name in dir(cls) if not name.startswith("_")}

    assert public(Monitor) <= public(NullMonitor), public(Monitor) - public(NullMonitor)
    monitor = NullMonitor("r")
    assert monitor.flush() is True and monitor.close() is None
    with pytest.raises(ValueError, match="pause phase must be one of"):
        monitor.pause("nap")
