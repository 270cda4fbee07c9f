"""TrainConfig: every field checked, with a message naming it, before any process starts."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

from trainvitals.trainer.config import TrainConfig
from trainvitals.trainer.presets import PRESETS


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"lr": math.inf}, "TrainConfig.lr must be a finite number > 0"),
        ({"lr": 0}, "TrainConfig.lr must be a finite number > 0"),
        ({"min_lr_ratio": math.nan}, "TrainConfig.min_lr_ratio must be in"),
        ({"weight_decay": math.nan}, "TrainConfig.weight_decay must be a finite number >= 0"),
        ({"grad_clip": -1}, r"TrainConfig.grad_clip must be > 0"),
        ({"grad_clip": 0}, r"TrainConfig.grad_clip must be > 0"),
        ({"grad_clip": math.nan}, r"TrainConfig.grad_clip must be > 0"),
        ({"canary_every": -5}, "TrainConfig.canary_every must be a finite number >= 0"),
        ({"peak_flops_per_s": -1}, "TrainConfig.peak_flops_per_s must be a finite number > 0"),
        ({"peak_flops_per_s": math.nan}, "TrainConfig.peak_flops_per_s must be a finite"),
        ({"stopped_interval_s": -0.01}, "TrainConfig.stopped_interval_s must be >= 0"),
        ({"stopped_interval_s": math.nan}, "TrainConfig.stopped_interval_s must be >= 0"),
        ({"run_id": "r" * 201}, "run_id 'rrrr"),
        ({"run_id": "a b"}, "run_id 'a b' is not valid"),
        ({"collector": "http://[::1"}, r"TrainConfig.collector .* is not a valid URL"),
        ({"otlp_endpoint": "localhost:4318"}, "TrainConfig.otlp_endpoint must be an http"),
        ({"inject": ["nan:step=abc"]}, "--inject 'nan:step=abc': step must be a whole number"),
        ({"dp": 2, "inject": ["crash:rank=2,step=1"]}, "rank 2 >= world size 2"),
        (
            {"corpus_bytes": 30},
            r"TrainConfig.corpus_bytes \(30\) must be at least seq_len \+ 2 = 66",
        ),
        ({"seq_len": 16, "corpus_bytes": 17}, "at least seq_len \\+ 2 = 18"),
        (
            {"steps": 12, "inject": ["crash:rank=0,step=12"]},
            "--inject crash at step 12: step >= steps",
        ),
        (
            {"steps": 12, "inject": ["nan:step=40"]},
            "--inject nan at step 40: step >= steps \\(12\\)",
        ),
    ],
)
def test_bad_fields_are_refused_by_name(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TrainConfig(**change)


def test_the_documented_special_values_are_accepted() -> None:
    cfg = TrainConfig(grad_clip=math.inf, weight_decay=0, canary_every=0, peak_flops_per_s=0)
    assert cfg.grad_clip == math.inf and cfg.run_id == ""


def test_cuda_without_cuda_is_refused_by_name(monkeypatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(
        ValueError, match=r"TrainConfig.device is cuda, but this torch sees no CUDA"
    ):
        TrainConfig(device="cuda")
    assert TrainConfig(seq_len=16, corpus_bytes=18).corpus_bytes == 18  # one window: enough


def test_checkpoint_meta_names_what_the_shards_depend_on() -> None:
    """Not dp and tp: DCP reshards onto another mesh."""
    meta = TrainConfig(dp=2, seq_len=32).checkpoint_meta()
    assert meta == {"preset": "tiny", "model": PRESETS["tiny"].to_dict(), "seq_len": 32}


def test_a_run_with_monitoring_off_trains_and_ends_cleanly(tmp_path) -> None:
    # `--hooks off` is how the supervisor re-runs a step: it must end with exit status 0.
    r = subprocess.run(
        [sys.executable, "-m", "trainvitals", "train", "--hooks", "off", "--steps", "3",
         "--run-id", "hooks-off"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
