"""Checkpoint and resume with torch.distributed.checkpoint (DCP), so restarts are real.

    <dir>/step-00000007/   DCP shards of the model and optimizer after step 7
    <dir>/step-00000007/trainer.json   step, run id, LR-scheduler state and the settings
                                       the shards depend on (preset, model, seq_len)
    <dir>/latest          name of the newest complete checkpoint (written last, atomically)

Every rank writes its own shards (FSDP x TP state dicts stay sharded); a crash in the
middle of a save leaves `latest` pointing at the previous complete checkpoint. `--resume`
starts from the newest one when there is one, so the same command line serves a first
start and every restart (under torchrun's `--max-restarts` too). Resuming keeps the run id,
so the restarted job continues the same run in the collector, and the monitor records
`checkpoint` and `restart` events from which the analyzer computes goodput. A checkpoint
saved with other settings is refused, naming what differs (one saved before checkpoints
recorded their settings loads as before).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict


@dataclass(frozen=True)
class Resumed:
    step: int  # the last step the checkpoint holds; training goes on at step + 1
    run_id: str
    path: Path
    load_s: float


def _name(step: int) -> str:
    return f"step-{step:08d}"


def path_of(root: Path, step: int) -> Path:
    """The folder of the checkpoint that holds the state after `step`."""
    return root / _name(step)


def finish(root: Path, step: int, meta: dict) -> None:
    """Rank 0, once every rank's shards of `step` are written: its trainer.json, then
    `latest` (atomically): from here on the checkpoint is complete."""
    path = path_of(root, step)
    (path / "trainer.json").write_text(json.dumps(meta))
    tmp = root / "latest.tmp"
    tmp.write_text(_name(step))
    os.replace(tmp, root / "latest")  # atomic: a reader sees the old or the new name


def save(
    root: Path,
    step: int,
    run_id: str,
    model: nn.Module,
    optimizer,
    scheduler,
    rank: int,
    config: dict | None = None,
) -> float:
    """Collective: every rank saves its shards. Returns the seconds the save took.
    `config`: the settings a resume must match (TrainConfig.checkpoint_meta())."""
    start = time.perf_counter()
    path = root / _name(step)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    if rank == 0:
        meta = {"step": step, "run_id": run_id, "scheduler": scheduler.state_dict()}
        if config is not None:
            meta["config"] = config
        finish(root, step, meta)
    if dist.is_initialized():
        dist.barrier()  # nobody trains on while rank 0 may still be writing `latest`
    return time.perf_counter() - start


def complete(root: Path) -> dict[int, Path]:
    """{step: folder} of the complete checkpoints under `root` (those with trainer.json;
    an async save in flight, or one cut short, has none)."""
    out = {}
    for path in root.glob("step-*"):
        step = path.name.removeprefix("step-")
        if step.isdigit() and (path / "trainer.json").is_file():
            out[int(step)] = path
    return dict(sorted(out.items()))


ROLLED_BACK = "rolled-back"  # where roll_back moves the checkpoints it sets aside


def roll_back(root: Path, at_most_step: int) -> int | None:
    """Make the newest complete checkpoint holding a step <= `at_most_step` the one a
    resume loads; set every newer folder aside under <root>/rolled-back/ (kept for a
    post-mortem, never loaded, never overwritten by the re-run's saves). Returns its step,
    None when there is none (the resume starts from scratch). Not while a job saves."""
    keep = [s for s in complete(root) if s <= at_most_step]
    target = keep[-1] if keep else None
    aside = root / ROLLED_BACK
    for path in sorted(root.glob("step-*")):
        step = path.name.removeprefix("step-")
        if step.isdigit() and (target is None or int(step) > target):
            aside.mkdir(exist_ok=True)
            dest = aside / f"{path.name}.{time.time_ns()}"
            os.replace(path, dest)
    if target is None:
        (root / "latest").unlink(missing_ok=True)
    else:
        tmp = root / "latest.tmp"
        tmp.write_text(_name(target))
        os.replace(tmp, root / "latest")
    return target


def latest(root: Path) -> Path | None:
    marker = root / "latest"
    return root / marker.read_text().strip() if marker.exists() else None


def read_meta(root: Path, config: dict | None = None) -> dict | None:
    """trainer.json of the newest checkpoint under `root` (None: there is none). ValueError
    when it is damaged, or when it was saved with settings other than `config`."""
    path = latest(root)
    if path is None:
        return None
    try:
        meta = json.loads((path / "trainer.json").read_text())
    except (OSError, ValueError) as e:
        raise ValueError(
            f"checkpoint {path} (named by {root / 'latest'}) is incomplete or damaged: {e}; "
            "point `latest` at an intact step-* folder, or start without --resume"
        ) from e
    saved = meta.get("config")
    if config is not None and saved is not None:  # older checkpoints did not record it
        want = json.loads(json.dumps(config))  # as the saved one went through JSON
        differ = [
            f"{name} {saved_value!r} (now {want_value!r})"
            for name, (saved_value, want_value) in _diff(saved, want).items()
        ]
        if differ:
            raise ValueError(
                f"checkpoint {path} was saved with {', '.join(differ)}; resume with the "
                "settings it was saved with, or start afresh in another --checkpoint-dir"
            )
    meta["path"] = str(path)
    return meta


def _diff(saved: dict, want: dict, prefix: str = "") -> dict[str, tuple]:
    """{dotted name: (saved, wanted)} of the entries of `want` that differ, nested dicts
    flattened (what the saved one holds beyond them, such as an older dp and tp, is not
    compared)."""
    out = {}
    for key in sorted(want.keys()):
        a, b = saved.get(key), want.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out |= _diff(a, b, f"{prefix}{key}.")
        elif a != b:
            out[f"{prefix}{key}"] = (a, b)
    return out


def resume(
    root: Path, model: nn.Module, optimizer, scheduler, config: dict | None = None
) -> Resumed | None:
    """Collective: load the newest checkpoint under `root` into model, optimizer, scheduler.
    ValueError, before loading anything, when it was saved with settings other than `config`."""
    start = time.perf_counter()
    meta = read_meta(root, config)
    if meta is None:
        return None
    path = Path(meta["path"])
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    scheduler.load_state_dict(meta["scheduler"])
    return Resumed(meta["step"], meta["run_id"], path, time.perf_counter() - start)


def restore_lr(optimizer: torch.optim.Optimizer, scheduler) -> None:
    """After load: the optimizer's LR is the scheduler's, not the one saved mid-spike."""
    for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr(), strict=True):
        group["lr"] = lr
