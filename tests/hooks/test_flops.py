"""FLOPs per token, the peak table, and plans, checked against published figures."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from trainvitals.hooks.flops import PEAKS, flops_per_token, lookup_peak, peak_flops
from trainvitals.plan import plan

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
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 0 and "9e+25 FLOPs" in r.stdout and "13.9 days" in r.stdout


def test_a_run_without_its_own_flops_count_says_its_mfu_is_an_estimate() -> None:
    from torch import nn

    from trainvitals.hooks import InMemoryExporter, attach
    from trainvitals.hooks.flops import FLOPS_ESTIMATE

    def run_row(**kwargs) -> dict:
        cnn = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 2))
        out = InMemoryExporter()
        monitor = attach(cnn, exporter=out, peak_flops_per_s=1e12, **kwargs)
        loss = cnn(torch.randn(2, 1, 8, 8)).sum()
        loss.backward()
        monitor.step(loss=loss, tokens=2)
        monitor.close()
        return out.rows("runs")[0]

    assert run_row()["flops_source"] == FLOPS_ESTIMATE
    assert run_row(flops_per_token=1.2e4)["flops_source"] == "configured"
