"""Checkpoint, crash, resume: a real 2-rank FSDP run restarts where its checkpoint left off."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from tests.conftest import run_trainer
from trainvitals.trainer.launch import torchrun_command
from trainvitals.trainer.presets import PRESETS

COMMON = ["--steps", "12", "--dp", "2", "--seed", "5", "--log-every", "1"]


def _read(path: Path) -> tuple[dict[int, float], list[tuple[str, int]], set[str]]:
    """(step -> loss, [(event kind, step)], run ids) of a telemetry file."""
    losses, events, run_ids = {}, [], set()
    for line in path.read_bytes().splitlines():
        batch = orjson.loads(line)
        run_ids.add(batch["run_id"])
        if s := batch.get("steps"):
            losses.update(zip(s["step"], s["loss"], strict=True))
        if e := batch.get("events"):
            events += [(k, st) for k, st in zip(e["kind"], e["step"], strict=True)]
    return losses, events, run_ids


@pytest.mark.slow
def test_resumed_run_continues_exactly_and_records_restart(tmp_path: Path) -> None:
    unbroken = tmp_path / "unbroken.jsonl"
    run_trainer([*COMMON, "--telemetry-file", str(unbroken)], nproc=2)

    run = tmp_path / "run.jsonl"
    ckpt = ["--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "4", "--resume"]
    # One command line for every attempt, as under torchrun --max-restarts.
    crashing = [*COMMON, *ckpt, "--telemetry-file", str(run), "--inject", "crash:rank=0,step=10"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first = subprocess.run(
        torchrun_command(2, crashing), capture_output=True, text=True, timeout=300, env=env
    )
    assert first.returncode != 0, "the crash fault must end the first attempt"
    assert (tmp_path / "ckpt" / "latest").read_text() == "step-00000007"
    _, events, _ = _read(run)  # rank 0 crashed, yet exported its steps and the ground truth
    assert ("fault:crash", 10) in events
    saved = orjson.loads((tmp_path / "ckpt" / "step-00000007" / "trainer.json").read_bytes())
    assert saved["config"] == {"preset": "tiny", "model": PRESETS["tiny"].to_dict(),
                               "seq_len": 64}  # fmt: skip

    second = run_trainer(crashing, nproc=2)  # the crash does not fire again
    assert "resumed from" in second.stdout and "at step 8" in second.stdout

    want, _, _ = _read(unbroken)
    got, events, run_ids = _read(run)
    assert len(run_ids) == 1, "the restarted job must continue the same run"
    for step in range(8, 12):  # the same weights, optimizer moments, LR and data
        assert abs(got[step] - want[step]) <= 1e-5 * abs(want[step]), (step, got, want)
    assert ("restart", 8) in events
    # The crashing rank wrote its crash once, as it stopped; the resumed attempt must not
    # write it again.
    assert ("fault:crash", 10) not in events[events.index(("restart", 8)) :]
    assert {("checkpoint", 3), ("checkpoint", 7), ("checkpoint", 11)} <= set(events)


@pytest.mark.slow
def test_a_damaged_checkpoint_is_refused_with_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "step-00000003").mkdir()
    (tmp_path / "latest").write_text("step-00000003")  # named, but never completed
    proc = subprocess.run(
        [sys.executable, "-m", "trainvitals", "train", "--steps", "3",
         "--checkpoint-dir", str(tmp_path), "--resume"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "incomplete or damaged" in proc.stderr and "Traceback" not in proc.stderr


def _checkpoint(root: Path, config: dict | None) -> None:
    """The trainer.json of a checkpoint at step 3 (the refusal comes before any shard is read)."""
    (root / "step-00000003").mkdir(parents=True)
    meta = {"step": 3, "run_id": "r", "scheduler": {}} | ({"config": config} if config else {})
    (root / "step-00000003" / "trainer.json").write_bytes(orjson.dumps(meta))
    (root / "latest").write_text("step-00000003")


@pytest.mark.slow
def test_a_checkpoint_of_other_settings_is_refused_naming_what_differs(tmp_path: Path) -> None:
    model = {**PRESETS["tiny"].to_dict(), "dim": 32}
    _checkpoint(tmp_path, {"preset": "tiny", "model": model, "seq_len": 32, "dp": 1, "tp": 1})
    proc = subprocess.run(
        [sys.executable, "-m", "trainvitals", "train", "--steps", "6",
         "--checkpoint-dir", str(tmp_path), "--resume"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "was saved with model.dim 32 (now 64), seq_len 32 (now 64);" in proc.stderr


def test_a_checkpoint_without_recorded_settings_is_still_accepted(tmp_path: Path) -> None:
    from trainvitals.trainer.checkpoint import read_meta
    from trainvitals.trainer.config import TrainConfig

    _checkpoint(tmp_path, None)  # saved before checkpoints recorded their settings
    assert read_meta(tmp_path, TrainConfig().checkpoint_meta())["step"] == 3
