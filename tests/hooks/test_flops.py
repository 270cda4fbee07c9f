"""FLOPs per token (counted, configured or estimated), the peak table, and plans, checked
against published figures and hand counts."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode
from torch.utils.flop_counter import register_flop_formula

from tests.conftest import run_trainer
from trainvitals.hooks import InMemoryExporter, attach
from trainvitals.hooks.flops import (
    FLOPS_ESTIMATE,
    PEAKS,
    TP_NOT_COUNTED,
    flops_per_token,
    lookup_peak,
    peak_flops,
)
from trainvitals.plan import plan
from trainvitals.trainer.model import Transformer
from trainvitals.trainer.presets import PRESETS

# Vendor data sheets, dense tensor FLOP/s: the table must not drift silently.
PINNED = {
    "A100": (312e12, None), "H100": (989e12, 1979e12), "H200": (989e12, 1979e12),
    "B200": (2.25e15, 4.5e15), "GB200": (2.5e15, 5.0e15), "MI300X": (1307.4e12, 2614.9e12),
    "MI355X": (2516.6e12, 5033.2e12), "TPU v5p": (459e12, None),
}  # fmt: skip


def test_peak_table_is_pinned() -> None:
    assert {k: (p.bf16, p.fp8) for k, p in PEAKS.items()} == PINNED


@pytest.mark.parametrize(
    ("name", "key"),
    [("NVIDIA H100 80GB HBM3", "H100"), ("NVIDIA GB200", "GB200"), ("NVIDIA B200", "B200"),
     ("AMD Instinct MI300X", "MI300X"), ("TPU v5p chip", "TPU v5p")],
)  # fmt: skip
def test_device_detection(name: str, key: str) -> None:
    assert lookup_peak(name)[0] == key


def test_unknown_device_has_no_entry() -> None:
    assert lookup_peak("Some Future Accelerator") is None


@pytest.mark.parametrize(("tflops", "mfu_percent"), [(430, 43), (400, 40), (380, 38)])
def test_llama3_405b_mfu(tflops: float, mfu_percent: float) -> None:
    # Llama 3 (Dubey et al., 2024, table 4): BF16 TFLOP/s per H100 and the MFU they report.
    assert 100 * tflops * 1e12 / PEAKS["H100"].bf16 == pytest.approx(mfu_percent, abs=1)


def test_plan_100b_on_150t_tokens() -> None:
    p = plan(params=1e11, tokens=1.5e14, gpu="GB200", count=100_000, mfu=0.30)
    assert p.flops == pytest.approx(9e25)
    assert 12 <= p.days <= 16  # "about two weeks"
    with pytest.raises(ValueError, match="no fp8 peak"):
        plan(1e9, 1e9, "A100", 8, 0.4, precision="fp8")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"params": math.nan}, "params must be a finite number > 0"),
        ({"params": math.inf}, "params must be a finite number > 0"),
        ({"tokens": -1.0}, "tokens must be a finite number > 0"),
        ({"power_w": -700.0}, "power_w must be a finite number > 0"),
        ({"power_w": math.nan}, "power_w must be a finite number > 0"),
    ],
)
def test_plan_refuses_values_without_meaning(change: dict, message: str) -> None:
    args = {"params": 1e9, "tokens": 1e12, "gpu": "H100", "count": 8, "mfu": 0.4, **change}
    with pytest.raises(ValueError, match=message):
        plan(**args)


def test_flops_per_token_palm_formula() -> None:
    # 1,000 non-embedding parameters, 2 layers of 4 heads of 16, context 128.
    assert flops_per_token(1_256, 256, 2, 4, 16, 128) == 6 * 1_000 + 12 * 2 * 4 * 16 * 128


def test_cpu_peak_is_measured_and_labelled() -> None:
    value, source = peak_flops(torch.device("cpu"))
    assert value > 1e8 and source.startswith("measured:")
    assert peak_flops(torch.device("cpu"), override=5e12) == (5e12, "configured")
    with pytest.raises(ValueError, match="positive"):
        peak_flops(torch.device("cpu"), override=-1)


@pytest.mark.slow
def test_plan_command() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "trainvitals", "plan", "--params", "1e11", "--tokens", "1.5e14",
         "--gpu", "GB200", "--count", "100000", "--mfu", "0.3"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0 and "9e+25 FLOPs" in r.stdout and "13.9 days" in r.stdout


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 2))


# One step of _cnn on 2 images of 1 x 8 x 8, by hand (2 FLOPs per multiply-add):
# conv forward 2 x 2 images x 4 out channels x 6 x 6 positions x 9 taps = 5,184, and its
# weight gradient as much (the input needs no gradient); linear forward 2 x 2 x 144 x 2 =
# 1,152, backward twice that (input and weight gradients).
CNN_STEP_FLOPS = 5_184 + 5_184 + 1_152 + 2 * 1_152


def _train_cnn(model: nn.Module, steps: int = 3, **config) -> InMemoryExporter:
    out = InMemoryExporter()
    monitor = attach(model, exporter=out, peak_flops_per_s=1e12, log_every=1, **config)
    with torch.no_grad():
        model(torch.randn(2, 1, 8, 8))  # an evaluation before training: not a step
    for _ in range(steps):
        loss = model(torch.randn(2, 1, 8, 8)).sum()
        loss.backward()
        monitor.step(loss=loss, tokens=2)  # 2 images: the "tokens" of a CNN
    monitor.close()
    return out


def test_a_cnns_flops_are_counted_once_as_by_hand() -> None:
    out = _train_cnn(_cnn())
    (run,) = out.rows("runs")
    assert run["flops_per_token"] == CNN_STEP_FLOPS / 2  # 6 N: 6 x 330
    assert run["flops_source"].startswith("counted: torch FlopCounterMode over step 0")
    assert _get_current_dispatch_mode() is None  # the count ended with the first step
    for step in out.rows("steps"):  # every step's MFU rests on the count, the first too
        expected = step["tokens_per_s"] * CNN_STEP_FLOPS / 2 / 1e12
        assert step["tflops_per_s_per_device"] == pytest.approx(expected)


def test_a_run_given_its_flops_per_token_keeps_them() -> None:
    (run,) = _train_cnn(_cnn(), flops_per_token=1.2e4).rows("runs")
    assert (run["flops_per_token"], run["flops_source"]) == (1.2e4, "configured")


@torch.library.custom_op("trainvitals_test::double", mutates_args=())
def _double(x: torch.Tensor) -> torch.Tensor:
    return 2 * x


@_double.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def test_a_count_that_fails_leaves_the_estimate_and_says_why() -> None:
    @register_flop_formula(torch.ops.trainvitals_test.double)
    def _broken(x_shape, *args, **kwargs) -> int:
        raise RuntimeError("no formula for these shapes")

    class Doubling(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.cnn = _cnn()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.cnn(torch.ops.trainvitals_test.double(x))

    model = Doubling()
    out = _train_cnn(model)  # training goes on: the failure is the count's only
    (run,) = out.rows("runs")
    non_embedding = sum(p.numel() for p in model.parameters())
    assert run["flops_per_token"] == 6.0 * non_embedding
    assert run["flops_source"].startswith(FLOPS_ESTIMATE)
    assert "not counted: a FLOP formula failed" in run["flops_source"]
    assert "no formula for these shapes" in run["flops_source"]
    assert len(out.rows("steps")) == 3


def test_a_run_closed_before_any_step_sends_its_estimate() -> None:
    out = InMemoryExporter()
    attach(_cnn(), exporter=out, peak_flops_per_s=1e12).close()
    (run,) = out.rows("runs")
    assert run["flops_source"] == f"{FLOPS_ESTIMATE}; not counted: no step"


def _reference_flops_per_token(preset: str) -> float:
    """The reference model's training FLOPs per token by hand: 6 per weight of every
    matmul (the linear layers and the output head; embeddings and norms are none) plus
    attention 14 L H Q T: its forward's two matmuls (4 L H Q T) and a flash backward's
    five (the scores recomputed: 10 L H Q T), as torch counts them."""
    cfg = PRESETS[preset]
    model = Transformer(cfg)
    matmul = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    return 6.0 * matmul + 14.0 * cfg.n_layers * cfg.n_heads * cfg.head_dim * cfg.max_seq_len


@pytest.mark.slow
def test_the_reference_trainer_counts_as_by_hand_on_one_process_and_dp_ranks(
    tmp_path: Path,
) -> None:
    expected = _reference_flops_per_token("tiny")
    for nproc, layout in [(1, []), (2, ["--dp", "2"]), (4, ["--dp", "2", "--tp", "2"])]:
        path = tmp_path / f"{nproc}.jsonl"
        run_trainer(
            ["--steps", "2", "--global-batch", "4", "--count-flops", "--telemetry-file",
             str(path), *layout],
            nproc=nproc,
        )  # fmt: skip
        batches = map(orjson.loads, path.read_bytes().splitlines())
        (run,) = [b["runs"] for b in batches if "runs" in b]
        if nproc < 4:
            assert run["flops_per_token"] == [expected], nproc
            assert run["flops_source"][0].startswith("counted"), nproc
        else:  # tensor parallel: not counted, and said so
            assert run["flops_source"] == [f"{FLOPS_ESTIMATE}; not counted: {TP_NOT_COUNTED}"]
