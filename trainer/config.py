"""The reference trainer's settings: one dataclass, and CLI flags that mirror it."""

from __future__ import annotations

import argparse
import dataclasses
import math
import warnings
from dataclasses import dataclass, field

from trainvitals import checks
from trainvitals.schema import check_run_id

from .presets import PRESETS

# What each TrainConfig field means; also the --help of its flag.
FLAG_HELP = {
    "preset": "model size: a key of trainer/presets.py",
    "steps": "optimizer steps",
    "dp": "data-parallel (FSDP) degree",
    "tp": "tensor-parallel degree",
    "global_batch": "sequences per step, over all data-parallel ranks",
    "seq_len": "tokens per sequence; 0: the preset's max_seq_len",
    "lr": "peak learning rate",
    "min_lr_ratio": "cosine decays to lr * min_lr_ratio",
    "warmup_steps": "learning-rate warm-up steps; -1: a tenth of the run",
    "weight_decay": "AdamW weight decay",
    "grad_clip": "clip the global gradient norm to this; inf: no clipping",
    "seed": "seed of the weights and the data order",
    "device": "auto: cuda when available, else cpu",
    "dtype": "compute dtype under autocast; auto: bfloat16 on cuda, float32 on cpu",
    "corpus_bytes": "bytes of the synthetic training corpus",
    "collector": "collector base URL; empty: no HTTP export",
    "telemetry_file": "also append every telemetry batch to this JSON-lines file",
    "otlp_endpoint": "also send OTLP/HTTP metrics here, e.g. http://host:4318/v1/metrics",
    "run_id": "run id (1-128 of A-Z a-z 0-9 . _ : @ + = -, first a letter or digit); empty: new",
    "log_every": "the small reference runs log every step; the hooks default to 10",
    "peak_flops_per_s": "0: from the device table or measured",
    "count_flops": "MFU from the FLOPs the hooks count over the first step (FlopCounterMode), "
    "not from the PaLM formula",
    "canary_every": "steps between SDC canary fingerprints (on logged steps); 0: off",
    "hooks": '"off" trains without trainvitals (to measure what the hooks cost)',
    "stopped_interval_s": "period of the hooks' stopped clock on CPU ranks (the time a process "
    "was stopped, for the straggler detector); 0: off",
    "checkpoint_dir": "DCP checkpoints go here (with --resume, a run goes on from the newest)",
    "checkpoint_every": "steps between checkpoints; 0: never",
    "checkpoint_every_min": "minutes of training between checkpoints (turned into steps); 0: never",
    "checkpoint_async": "save checkpoints with DCP async_save: training waits only for the copy",
    "resume": "go on from the newest checkpoint in checkpoint_dir, if there is one",
    "inject": "a fault to inject, repeatable, e.g. nan:step=30 (kinds and keys: trainer/faults.py)",
    "skip_data": "data windows FIRST:LAST never trained on (repeatable): a bad stretch of data",
    "rerun_step": "train from the checkpoint up to this step, print its loss on its batch "
    "(`rerun-loss STEP LOSS`, rank 0) and stop, saving nothing: the supervisor's re-run; -1: off",
}


@dataclass
class TrainConfig:
    preset: str = "tiny"
    steps: int = 200
    dp: int = 1
    tp: int = 1
    global_batch: int = 8
    seq_len: int = 0
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = -1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    device: str = "auto"
    dtype: str = "auto"
    corpus_bytes: int = 2_000_000
    collector: str = ""
    telemetry_file: str = ""
    otlp_endpoint: str = ""
    run_id: str = ""
    log_every: int = 1
    peak_flops_per_s: float = 0.0
    count_flops: bool = False
    canary_every: int = 50
    hooks: str = "on"
    stopped_interval_s: float = 0.01
    checkpoint_dir: str = ""
    checkpoint_every: int = 0
    checkpoint_every_min: float = 0.0
    checkpoint_async: bool = False
    resume: bool = False
    inject: list[str] = field(default_factory=list)
    skip_data: list[str] = field(default_factory=list)
    rerun_step: int = -1

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(
                f"TrainConfig.preset must be one of {sorted(PRESETS)}, got {self.preset!r}"
            )
        for name in ("steps", "dp", "tp", "global_batch", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"TrainConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.global_batch % self.dp:
            raise ValueError(
                f"TrainConfig.global_batch ({self.global_batch}) "
                f"must be divisible by dp ({self.dp})"
            )
        if self.seq_len < 0 or self.seq_len > PRESETS[self.preset].max_seq_len:
            raise ValueError(
                f"TrainConfig.seq_len must be in [0, {PRESETS[self.preset].max_seq_len}] "
                f"for preset {self.preset!r}, got {self.seq_len}"
            )
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"TrainConfig.device must be auto, cpu or cuda, got {self.device!r}")
        if self.device == "cuda":
            import torch  # here: the CLI defers importing torch otherwise

            if not torch.cuda.is_available():
                raise ValueError(
                    "TrainConfig.device is cuda, but this torch sees no CUDA device "
                    f"(torch {torch.__version__}, built with CUDA {torch.version.cuda}); "
                    "use --device cpu or auto"
                )
        # ByteBatches draws windows of seq_len + 1 bytes (inputs and the next-byte targets)
        # from the corpus, with replacement: any dp draws from one corpus.
        if self.corpus_bytes < self.seq_len_or_max + 2:
            raise ValueError(
                f"TrainConfig.corpus_bytes ({self.corpus_bytes}) must be at least seq_len + 2 "
                f"= {self.seq_len_or_max + 2} for one training window"
            )
        if self.hooks not in ("on", "off"):
            raise ValueError(f"TrainConfig.hooks must be on or off, got {self.hooks!r}")
        if not (math.isfinite(self.stopped_interval_s) and self.stopped_interval_s >= 0):
            raise ValueError(
                f"TrainConfig.stopped_interval_s must be >= 0, got {self.stopped_interval_s}"
            )
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(
                f"TrainConfig.dtype must be auto, float32 or bfloat16, got {self.dtype!r}"
            )
        if self.warmup_steps == -1:
            self.warmup_steps = max(1, self.steps // 10)
        if not 0 <= self.warmup_steps <= self.steps:
            raise ValueError(
                f"TrainConfig.warmup_steps must be -1 (auto) or in [0, steps={self.steps}], "
                f"got {self.warmup_steps}"
            )
        checks.positive("TrainConfig.lr", self.lr)
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"TrainConfig.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        checks.non_negative("TrainConfig.weight_decay", self.weight_decay)
        # clip_grad_norm_ scales the gradients to at most grad_clip: 0 would zero them all.
        if not self.grad_clip > 0:
            raise ValueError(
                f"TrainConfig.grad_clip must be > 0 (inf: no clipping), got {self.grad_clip}"
            )
        checks.non_negative("TrainConfig.canary_every", self.canary_every)
        if self.peak_flops_per_s:  # 0: from the device table or measured
            checks.positive("TrainConfig.peak_flops_per_s", self.peak_flops_per_s)
        if self.run_id:  # else the monitor makes one up
            check_run_id(self.run_id)  # the collector would refuse every batch
        for name in ("collector", "otlp_endpoint"):
            if getattr(self, name):
                checks.http_url(f"TrainConfig.{name}", getattr(self, name))
        if self.checkpoint_every < 0 or (self.checkpoint_every and not self.checkpoint_dir):
            raise ValueError("TrainConfig.checkpoint_every must be >= 0 and needs checkpoint_dir")
        if self.checkpoint_every_min < 0 or (self.checkpoint_every_min and not self.checkpoint_dir):
            raise ValueError(
                "TrainConfig.checkpoint_every_min must be >= 0 and needs checkpoint_dir"
            )
        if self.checkpoint_async and not (self.checkpoint_every or self.checkpoint_every_min):
            warnings.warn(
                "TrainConfig.checkpoint_async is ignored: no checkpoint_every(_min)", stacklevel=2
            )
        if self.skip_data:
            from .data import parse_windows

            parse_windows(self.skip_data)
        if not -1 <= self.rerun_step < self.steps:
            raise ValueError(
                f"TrainConfig.rerun_step must be -1 (off) or in [0, steps={self.steps}), "
                f"got {self.rerun_step}"
            )
        if self.resume and not self.checkpoint_dir:
            raise ValueError("TrainConfig.resume needs checkpoint_dir")
        if self.inject:  # refused here, before torchrun starts, rather than on every rank
            from .faults import FaultInjector  # here: it imports torch, which the CLI defers

            for f in FaultInjector(self.inject, rank=0, world_size=self.world_size).faults:
                if f.step >= self.steps:  # it would never happen
                    raise ValueError(
                        f"--inject {f.kind} at step {f.step}: step >= steps ({self.steps}); "
                        f"the run's last step is {self.steps - 1}"
                    )

    @property
    def world_size(self) -> int:
        return self.dp * self.tp

    @property
    def seq_len_or_max(self) -> int:
        """The sequence length trained on: seq_len, or the preset's max_seq_len when 0."""
        return self.seq_len or PRESETS[self.preset].max_seq_len

    def checkpoint_meta(self) -> dict:
        """What a checkpoint's shards depend on; a resume with other values is refused.
        Not dp and tp: DCP reshards the weights onto another mesh (an elastic restart on
        fewer or more ranks)."""
        return {
            "preset": self.preset,
            "model": PRESETS[self.preset].to_dict(),
            "seq_len": self.seq_len_or_max,
        }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per TrainConfig field: --global-batch for global_batch, and so on."""
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        text = FLAG_HELP[f.name]
        if f.default_factory is list:  # repeatable: --inject A --inject B
            parser.add_argument(
                flag, action="append", default=[], dest=f.name, metavar="SPEC", help=text
            )
        elif isinstance(f.default, bool):  # a switch: --resume
            parser.add_argument(flag, action="store_true", dest=f.name, help=text)
        else:
            text += f" (default {f.default!r})"
            parser.add_argument(
                flag, type=type(f.default), default=f.default, dest=f.name, help=text
            )


def from_args(args: argparse.Namespace) -> TrainConfig:
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    return TrainConfig(**{k: v for k, v in vars(args).items() if k in names})
