"""attach() on the models and loops users bring: outputs of every shape, sparse gradients,
losses and learning rates of every type, validation between steps. Telemetry never raises
into the training loop, and what it reports is still right."""

from __future__ import annotations

import math

import numpy as np
import orjson
import pytest
import torch
from torch import nn

from trainvitals.hooks import InMemoryExporter, JsonlExporter, attach


class _DictOut(nn.Module):
    """A backbone returning a dict, as Hugging Face models do."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return {"last_hidden_state": self.proj(x), "mask": x > 0}


class _Router(nn.Module):
    """An MoE router: (expert indices, weights); the indices come first."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(8, 4)

    def forward(self, x):
        weights = self.gate(x).softmax(-1)
        return weights.argmax(-1), weights


class _Model(nn.Module):
    def __init__(self, sparse: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8, sparse=sparse)
        self.backbone = _DictOut()
        self.router = _Router()
        self.head = nn.Linear(8, 16)

    def forward(self, ids):
        h = self.backbone(self.embed(ids))["last_hidden_state"]
        _, weights = self.router(h)
        return self.head(h * weights.sum(-1, keepdim=True))


def _loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 16, (2, 6), generator=torch.Generator().manual_seed(seed))


def _watched(model: nn.Module | None = None, log_every: int = 1):
    """(model, its exporter, its monitor) for a test run."""
    model, out = model or _Model(), InMemoryExporter()
    return model, out, attach(model, exporter=out, peak_flops_per_s=1e12, log_every=log_every)


def test_dict_and_integer_outputs_are_read_past(tmp_path) -> None:
    torch.manual_seed(0)
    model, out, monitor = _watched()
    for step in range(2):
        loss = _loss(model, _ids(step))
        loss.backward()
        monitor.step(loss=loss, tokens=12)
        model.zero_grad()
    monitor.close()
    names = orjson.loads(out.rows("runs")[0]["layer_names_json"])
    act = {names[r["layer"]]: r["act_rms"] for r in out.rows("layers") if r["step"] == 1}
    with torch.no_grad():  # what the hooks should have read: the dict's first tensor
        hidden = model.backbone(model.embed(_ids(1)))["last_hidden_state"]
        weights = model.router(hidden)[1]
    assert act["backbone"] == pytest.approx(hidden.square().mean().sqrt().item(), rel=1e-5)
    assert act["router"] == pytest.approx(weights.square().mean().sqrt().item(), rel=1e-5)


def test_a_sparse_gradient_is_measured_by_its_values() -> None:
    torch.manual_seed(0)
    model, out, monitor = _watched(_Model(sparse=True))
    ids = torch.tensor([[1, 1, 2, 3, 3, 3]])  # repeated rows: the sparse grad is uncoalesced
    loss = _loss(model, ids)
    loss.backward()
    monitor.step(loss=loss, tokens=6)
    expected = model.embed.weight.grad.to_dense().norm().item()
    monitor.close()
    (embed,) = [r for r in out.rows("layers") if r["layer"] == 0]
    assert embed["grad_norm"] == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (2.5, 2.5),  # loss.item(), read by the user
        (np.float32(2.5), 2.5),
        (torch.tensor([1.0, 2.0, 4.5]), 2.5),  # per-sample losses: their mean
    ],
)
def test_losses_of_every_type(given, expected) -> None:
    model, out, monitor = _watched()
    _loss(model, _ids()).backward()
    monitor.step(loss=given, tokens=12)
    monitor.close()
    assert out.rows("steps")[0]["loss"] == pytest.approx(expected)


def test_tokens_zero_still_reports_the_loss() -> None:
    model, out, monitor = _watched()
    _loss(model, _ids()).backward()
    monitor.step(loss=torch.tensor(1.75), tokens=0)  # a weighted mean would be 0/0
    monitor.close()
    assert out.rows("steps")[0]["loss"] == pytest.approx(1.75)


def test_numpy_and_tensor_learning_rates_reach_the_file(tmp_path) -> None:
    path = tmp_path / "t.jsonl"
    model = _Model()
    monitor = attach(model, exporter=JsonlExporter(str(path)), peak_flops_per_s=1e12, log_every=1)
    for lr in (np.float64(3e-4), torch.tensor(1e-4)):  # a numpy schedule; get_last_lr()
        _loss(model, _ids()).backward()
        monitor.step(loss=torch.tensor(2.0), tokens=12, lr=lr)
        model.zero_grad()
    monitor.close()
    steps = [orjson.loads(line).get("steps") for line in path.read_bytes().splitlines()]
    lrs = [lr for s in steps if s for lr in s["lr"]]
    assert lrs == pytest.approx([3e-4, 1e-4])


def test_an_exporter_that_raises_is_counted_as_dropped() -> None:
    class Refusing:
        def export(self, batch):
            raise TypeError("Type is not JSON serializable")

        def shutdown(self, timeout_s):
            pass

    model = _Model()
    monitor = attach(model, exporter=Refusing(), peak_flops_per_s=1e12, log_every=1)
    _loss(model, _ids()).backward()
    monitor.step(loss=torch.tensor(2.0), tokens=12)
    monitor.close()
    assert monitor.telemetry_dropped >= 1


def test_validation_between_steps_is_not_counted_as_the_step() -> None:
    torch.manual_seed(0)
    model, out, monitor = _watched(log_every=2)
    for step in range(3):
        loss = _loss(model, _ids(step))
        loss.backward()
        if step > 0:  # evaluation on an unlogged and a logged step, with NaN inputs
            model.eval()
            with torch.no_grad():
                model.head(torch.full((4, 8), math.nan))
                model.backbone(torch.full((4, 8), 1e6))
            model.train()
        monitor.step(loss=loss, tokens=12)
        model.zero_grad()
    monitor.close()
    (step,) = [r for r in out.rows("steps") if r["step"] == 2]
    assert step["nonfinite_count"] == 0 and step["nonfinite_steps"] == 0
    assert all(r["act_max_abs"] < 1e3 for r in out.rows("layers") if r["step"] == 2)


def test_a_compiled_model_is_watched_through_its_original() -> None:
    model = _Model()
    monitor = attach(torch.compile(model), exporter=InMemoryExporter(), peak_flops_per_s=1e12)
    assert monitor.layers.names == ["embed", "backbone", "router", "head"]
    monitor.close()


def test_a_compiled_ddp_model_is_watched_through_its_original(tmp_path) -> None:
    """compile(DDP(m)), the order torch's docs use, as DDP(compile(m)): m's layers, and DDP
    known as DDP (a one-rank gloo group in this process)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        model = _Model()
        for wrapped in (
            torch.compile(nn.parallel.DistributedDataParallel(model)),
            nn.parallel.DistributedDataParallel(torch.compile(model)),
        ):
            monitor = attach(wrapped, exporter=InMemoryExporter(), peak_flops_per_s=1e12)
            assert monitor.layers.names == ["embed", "backbone", "router", "head"]
            assert monitor.comms.covers_grads  # DDP's comm hook reads the local gradients
            monitor.close()
    finally:
        dist.destroy_process_group()


def test_a_second_monitor_on_one_model_is_refused_until_the_first_is_closed() -> None:
    model, _, first = _watched()
    with pytest.raises(ValueError, match="already attached to this model; close"):
        attach(model, exporter=InMemoryExporter())
    first.close()
    first.close()  # a second close does nothing (it once queued a second run_end)
    attach(model, exporter=InMemoryExporter()).close()


def test_a_model_with_parameters_on_the_meta_device_is_refused_at_attach() -> None:
    model = nn.Sequential(nn.Linear(4, 4, device="meta"), nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"'0.weight' is on the meta device; materialize"):
        attach(model, exporter=InMemoryExporter())


def test_a_model_without_parameters_is_refused_at_attach() -> None:
    with pytest.raises(ValueError, match="no parameters to monitor"):
        attach(nn.ReLU(), exporter=InMemoryExporter())


def test_a_float64_model_is_measured_in_float64() -> None:
    """The norm kernels refuse to narrow float64 to float32: a logged step raised."""
    torch.manual_seed(0)
    model, out, monitor = _watched(_Model().double())
    ids = _ids()
    loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
    loss.backward()
    monitor.step(loss=loss, tokens=12)
    monitor.close()
    head = next(r for r in out.rows("layers") if r["layer"] == 3)
    assert head["grad_norm"] == pytest.approx(
        torch.cat([p.grad.flatten() for p in model.head.parameters()]).norm().item(), rel=1e-12
    )
    assert head["act_rms"] == pytest.approx(model(ids).pow(2).mean().sqrt().item(), rel=1e-12)


class _Blocks(nn.Module):
    """Three blocks, run under activation checkpointing (reentrant or not) or not."""

    def __init__(self, reentrant: bool | None) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3))
        self.reentrant = reentrant

    def forward(self, x):
        for layer in self.layers:
            if self.reentrant is None:
                x = layer(x)
            else:
                x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=self.reentrant)
        return x


def _blocks_run(reentrant: bool | None, outputs: list) -> list[dict]:
    """Three logged steps of _Blocks; every block output's shape appended to `outputs`."""
    torch.manual_seed(0)
    model, out, monitor = _watched(_Blocks(reentrant))
    for layer in model.layers:
        layer.register_forward_hook(lambda _m, _i, o: outputs.append(o.shape))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        if step == 2:
            x[0, 0] = float("nan")  # a row of NaN in every block output, counted once
        loss = model(x.requires_grad_()).square().mean()  # reentrant checkpoints need one
        loss.backward()
        # The monitor holds a forward's outputs (as detached aliases of their storage)
        # until the forward returns, and recomputed ones not at all: none past backward.
        assert monitor.activations._pending == []
        monitor.step(loss=torch.tensor(0.0), tokens=4)
        opt.step()
        opt.zero_grad()
    monitor.close()
    return out.rows("layers")


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpointed_blocks_are_read_once_and_not_held(reentrant) -> None:
    """Recomputation inside backward is not counted again, and no block output, forward or
    recomputed, is kept alive past the backward by the monitor."""
    plain_outputs, checkpointed_outputs = [], []
    plain = _blocks_run(None, plain_outputs)
    # Without early stop the recomputation runs each block to its end, and so its hooks.
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):
        checkpointed = _blocks_run(reentrant, checkpointed_outputs)
    assert len(checkpointed_outputs) == 2 * len(plain_outputs)  # the recomputation ran
    assert len(plain) == len(checkpointed) == 9
    assert [r["act_nonfinite_count"] for r in plain[-3:]] == [8, 8, 8]
    for a, b in zip(plain, checkpointed, strict=True):
        for key in ("act_rms", "act_max_abs", "act_nonfinite_count", "grad_norm", "update_rms"):
            # None: no update before the first step; "NaN" on the wire, step 2's outputs.
            expected = pytest.approx(a[key], rel=1e-6) if isinstance(a[key], float) else a[key]
            assert b[key] == expected, (key, a, b)


class _ScaledInPlace(nn.Module):
    """Scales a layer's output in place after the layer returned (autograd allows it here:
    nothing saved that output)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.second = nn.Linear(8, 8)

    def forward(self, x):
        h = self.first(x)
        h.mul_(3.0)
        return self.second(h)


def test_a_layer_output_changed_in_place_is_warned_about_once(caplog) -> None:
    model, out, monitor = _watched(_ScaledInPlace())
    for _ in range(2):
        x = torch.randn(4, 8)
        loss = model(x).square().mean()
        loss.backward()
        monitor.step(loss=loss, tokens=4)
    monitor.close()
    warned = [r for r in caplog.records if "changed in place" in r.getMessage()]
    assert len(warned) == 1 and "'first'" in warned[0].getMessage()
    assert len(out.rows("layers")) == 4  # the run goes on, every step recorded


def test_a_head_tied_to_the_embedding_is_measured_once() -> None:
    """A weight two layers share (GPT-2's head and embedding) counts once: in the global
    gradient norm, and in the last layer that holds it; the other reports zero."""
    torch.manual_seed(0)
    model = _Model()
    model.head.weight = model.embed.weight  # (16, 8) both
    model, out, monitor = _watched(model)
    _loss(model, _ids()).backward()
    monitor.step(loss=torch.tensor(1.0), tokens=12)
    expected = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9).item()
    monitor.close()
    assert out.rows("steps")[0]["grad_norm"] == pytest.approx(expected, rel=1e-6)
    names = orjson.loads(out.rows("runs")[0]["layer_names_json"])
    layers = {names[r["layer"]]: r for r in out.rows("layers")}
    head_grad = torch.cat([model.embed.weight.grad.flatten(), model.head.bias.grad])
    assert layers["head"]["grad_norm"] == pytest.approx(head_grad.norm().item(), rel=1e-6)
    assert layers["embed"]["grad_norm"] == 0 and layers["embed"]["param_norm"] == 0


def _tokens_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "not the global count" in r.getMessage()]


def _train_with_tokens(model, monitor, micro_batches: int, tokens_per_id: int) -> None:
    """Four steps, each of `micro_batches` forwards of _ids(); `tokens` passed as
    tokens_per_id x the ids of the step (2: the global count of a job with dp = 2)."""
    for step in range(4):
        ids = [_ids(step * micro_batches + m) for m in range(micro_batches)]
        for x in ids:
            _loss(model, x).backward()
        monitor.step(loss=1.0, tokens=tokens_per_id * sum(x.numel() for x in ids))
        model.zero_grad()
    monitor.close()


@pytest.mark.parametrize("micro_batches", [1, 3])
def test_this_ranks_tokens_pass_without_a_warning(caplog, micro_batches) -> None:
    model, out, monitor = _watched()
    _train_with_tokens(model, monitor, micro_batches, tokens_per_id=1)
    assert _tokens_warnings(caplog) == []
    assert not [e for e in out.rows("events") if e["kind"] == "tokens_suspect"]
    assert [r["tokens"] for r in out.rows("steps")] == [12 * micro_batches] * 4


@pytest.mark.parametrize("micro_batches", [1, 3])
def test_a_global_token_count_is_warned_about_once_and_recorded(caplog, micro_batches) -> None:
    """What a dp = 2 job's user passes when they give the global batch's tokens: 2x the ids
    this rank's forwards saw (over gradient accumulation's micro-batches too)."""
    model, out, monitor = _watched()
    _train_with_tokens(model, monitor, micro_batches, tokens_per_id=2)
    seen = 12 * micro_batches
    (warning,) = _tokens_warnings(caplog)
    assert f"tokens={2 * seen}) at step 0" in warning and f"saw {seen} token ids" in warning
    (event,) = [e for e in out.rows("events") if e["kind"] == "tokens_suspect"]
    assert event["step"] == 0 and event["rank"] == 0
    assert orjson.loads(event["detail"]) == {"tokens": 2 * seen, "token_ids_seen": seen}
    assert len(out.rows("steps")) == 4  # the run goes on, every step recorded


class _KeywordIds(nn.Module):
    """Called as Hugging Face models are: input_ids, attention_mask and labels by keyword."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = _Model()

    def forward(self, input_ids, attention_mask, labels):
        logits = self.inner(input_ids * attention_mask)
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


@pytest.mark.parametrize(("tokens_per_id", "warned"), [(1, 0), (2, 1)])
def test_token_ids_passed_by_keyword_count_once_per_forward(caplog, tokens_per_id, warned) -> None:
    model, out, monitor = _watched(_KeywordIds())
    for step in range(2):
        ids = _ids(step)
        loss = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids)
        loss.backward()
        monitor.step(loss=loss, tokens=tokens_per_id * ids.numel())
        model.zero_grad()
    monitor.close()
    assert len(_tokens_warnings(caplog)) == warned
    assert len([e for e in out.rows("events") if e["kind"] == "tokens_suspect"]) == warned


def test_a_model_fed_floats_is_not_judged_on_its_tokens(caplog) -> None:
    model, out, monitor = _watched(_ScaledInPlace())
    x = torch.randn(4, 8)
    model(x).square().mean().backward()
    monitor.step(loss=1.0, tokens=10**6)  # no ids to compare with: nothing to say
    monitor.close()
    assert _tokens_warnings(caplog) == []
    assert not [e for e in out.rows("events") if e["kind"] == "tokens_suspect"]
