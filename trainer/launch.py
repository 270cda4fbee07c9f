"""`trainvitals train`: run the reference trainer, through torchrun when it has several ranks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from .config import TrainConfig


def torchrun_command(nproc: int, train_args: list[str]) -> list[str]:
    """argv that runs the trainer on `nproc` local ranks (torchrun picks a free port)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "trainvitals.trainer.train",
        *train_args,
    ]


def run(cfg: TrainConfig, nproc: int, train_args: list[str]) -> int:
    if nproc != cfg.world_size:
        print(f"error: --nproc {nproc} must equal dp x tp = {cfg.world_size}", file=sys.stderr)
        return 2
    if cfg.resume:  # refused here, once, rather than by every rank after torchrun started
        from .checkpoint import read_meta  # imports torch, which the CLI defers otherwise

        try:
            read_meta(Path(cfg.checkpoint_dir), cfg.checkpoint_meta())
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    if nproc == 1:
        from .train import main

        main(train_args)
        return 0
    # One BLAS thread per rank unless told otherwise (torchrun's own default, set here so it
    # does not print a banner about it).
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    return subprocess.call(torchrun_command(nproc, train_args), env=env)
