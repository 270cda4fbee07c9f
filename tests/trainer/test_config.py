"""TrainConfig: every field checked, with a message naming it, before any process starts."""

from __future__ import annotations

import math

import pytest

from trainvitals.trainer.config import TrainConfig


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
        ({"run_id": "r" * 201}, "run_id 'rrrr"),
        ({"run_id": "a b"}, "run_id 'a b' is not valid"),
        ({"collector": "http://[::1"}, r"TrainConfig.collector .* is not a valid URL"),
        ({"otlp_endpoint": "localhost:4318"}, "TrainConfig.otlp_endpoint must be an http"),
        ({"inject": ["nan:step=abc"]}, "--inject 'nan:step=abc': step must be a whole number"),
        ({"dp": 2, "inject": ["crash:rank=2,step=1"]}, "rank 2 >= world size 2"),
    ],
)
def test_bad_fields_are_refused_by_name(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TrainConfig(**change)


def test_the_documented_special_values_are_accepted() -> None:
    cfg = TrainConfig(grad_clip=math.inf, weight_decay=0, canary_every=0, peak_flops_per_s=0)
    assert cfg.grad_clip == math.inf and cfg.run_id == ""
