"""CommsMeter on real torchrun runs (gloo, CPU): counts and bytes per step equal what the
model's sizes and its FSDP/TP structure imply, and the local gradient norm before the
data-parallel reduction equals an unsharded model's gradient on the rank's own data."""

from __future__ import annotations

import datetime
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from trainvitals.hooks import comms
from trainvitals.trainer.model import PRESETS, ModelConfig, Transformer

SCRIPT = Path(__file__).with_name("comms_script.py")
F32 = 4  # bytes per element: the CPU run trains, gathers and reduces in float32


def _run(tmp_path: Path, dp: int, tp: int) -> list[dict]:
    """The worker under torchrun (gloo): one JSON result per rank."""
    out = tmp_path / f"dp{dp}tp{tp}"
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={dp * tp}", str(SCRIPT), str(out), str(dp), str(tp)]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(dp * tp)]


def expected_per_step(cfg: ModelConfig, dp: int, tp: int, batch: int, seq: int) -> dict:
    """Collectives of one training step on one rank, derived from the model's sizes.

    FSDP2 (dp > 1): each block is all-gathered for forward and again for backward (it is
    resharded after forward); the root (embedding, final norm, head) stays gathered from
    forward to backward. One reduce-scatter per FSDP unit. A unit's buffer holds its
    parameters' tensor-parallel shards, each padded along dim 0 to a multiple of dp.
    Tensor parallelism (tp > 1; Megatron's split, trainer/parallel.py), each all-reduce of a
    (batch, seq, dim) activation: forward, the embedding and every wo and w2 (rowwise);
    backward, the input gradient of every wq, wk, wv, w1, w3 and of the head (colwise). The
    head's logits are all-gathered whole in forward.
    """
    dim, ffn, vocab, layers = cfg.dim, cfg.ffn_dim, cfg.vocab_size, cfg.n_layers

    def unit_bytes(shapes: list[tuple[int, int]]) -> int:
        return F32 * sum(math.ceil(rows / dp) * dp * cols for rows, cols in shapes)

    block = unit_bytes(
        [(dim, 1), (dim, 1)]  # attention_norm, ffn_norm: replicated over tp
        + [(dim // tp, dim)] * 3  # wq, wk, wv: colwise, output rows sharded
        + [(dim, dim // tp)]  # wo: rowwise, input columns sharded
        + [(ffn // tp, dim)] * 2  # w1, w3
        + [(dim, ffn // tp)]  # w2
    )
    root = unit_bytes([(vocab // tp, dim), (dim, 1), (vocab // tp, dim)])
    expected = dict.fromkeys([f"{k}_{w}" for k in comms.KINDS for w in ("count", "bytes")], 0.0)
    if dp > 1:
        expected["all_gather_count"] = 2 * layers + 1
        expected["all_gather_bytes"] = 2 * layers * block + root
        expected["reduce_scatter_count"] = layers + 1
        expected["reduce_scatter_bytes"] = layers * block + root
    if tp > 1:
        all_reduces = 1 + layers * (2 + 5) + 1
        expected["all_reduce_count"] = all_reduces
        expected["all_reduce_bytes"] = all_reduces * batch * seq * dim * F32
        expected["all_gather_count"] += 1
        expected["all_gather_bytes"] += batch * seq * vocab * F32
    return expected


def _assert_run(results: list[dict], dp: int, tp: int) -> None:
    from tests.hooks.comms_script import GLOBAL_BATCH, SEQ, STEPS

    expected = expected_per_step(PRESETS["tiny"], dp, tp, GLOBAL_BATCH // dp, SEQ)
    for rank, result in enumerate(results):
        for variant, run in result.items():
            where = f"rank {rank}, {variant}"
            assert run["covers_grads"], where
            assert len(run["steps"]) == STEPS
            first, *armed = run["steps"]
            assert all(math.isnan(v) for v in first["take"].values()), f"{where}: unarmed"
            for took in [s["take"] for s in armed] + [run["take2"]]:
                if variant == "fp16_reduce":  # the reduce-scatter carries fp16
                    took = {**took, "reduce_scatter_bytes": 2 * took["reduce_scatter_bytes"]}
                assert {k: took[k] for k in expected} == expected, where
                # gloo: FSDP's blocking collectives are timed by the host, DTensor's by the
                # hooks that wait for them (forward) and time their graph node (backward).
                assert took["reduce_scatter_time_s"] > 0, where
                assert took["all_gather_time_s"] > 0, where
                reduced_s = took["all_reduce_time_s"]
                assert reduced_s > 0 if tp > 1 else reduced_s == 0, where
            assert first["local_grad_sumsq"] == 0.0, f"{where}: counted while disarmed"
            for step in armed:
                ref = step["reference_sumsq"]
                assert ref > 0 and step["local_grad_sumsq"] == pytest.approx(ref, rel=1e-5), where
            assert all(v == 0 for v in run["after_close"].values()), f"{where}: after close"


@pytest.mark.slow
def test_dp2_tp2_counts_bytes_and_local_grad_norm(tmp_path: Path) -> None:
    _assert_run(_run(tmp_path, dp=2, tp=2), dp=2, tp=2)


@pytest.mark.slow
def test_dp2_tp1_counts_bytes_and_local_grad_norm(tmp_path: Path) -> None:
    """Also FSDP with an fp16 reduce dtype, which divides the reduce-scatter input by 2
    before the comm sees it: the meter multiplies it back."""
    results = _run(tmp_path, dp=2, tp=1)
    assert all("fp16_reduce" in r for r in results)
    _assert_run(results, dp=2, tp=1)


def test_single_process_has_no_collectives() -> None:
    torch.manual_seed(0)
    model = Transformer(PRESETS["tiny"])
    meter = comms.CommsMeter(model, None, torch.device("cpu"))
    meter.arm(True)
    model(torch.randint(0, 256, (2, 8))).sum().backward()
    took = meter.take(1)
    assert all(v == 0 for v in took.values()), took
    assert not meter.covers_grads and meter.local_grad_sumsq.item() == 0
    meter.close()
    with pytest.raises(ValueError, match="n_steps"):
        meter.take(0)


def test_nccl_completions_are_added_by_kind() -> None:
    """The completion hook's arithmetic, fed WorkInfo-like records (NCCL needs a GPU)."""
    tally = comms._Tally()
    box = [tally]

    def info(op: str, ms: float) -> SimpleNamespace:
        return SimpleNamespace(
            op_type=SimpleNamespace(name=op), active_duration=datetime.timedelta(milliseconds=ms)
        )

    comms._on_completion(box, info("_ALLGATHER_BASE", 2.0))
    comms._on_completion(box, info("ALLREDUCE", 3.0))
    comms._on_completion(box, info("BROADCAST", 5.0))  # not a kind we report
    comms._on_completion(box, info("_REDUCE_SCATTER_BASE", -1.0))  # timing was off
    box[0] = None
    comms._on_completion(box, info("ALLREDUCE", 7.0))  # after close(): dropped
    _count, _bytes, _host_time_s, time_s, _untimed = tally.take()
    assert time_s == pytest.approx({"all_gather": 2e-3, "reduce_scatter": 0.0, "all_reduce": 3e-3})
