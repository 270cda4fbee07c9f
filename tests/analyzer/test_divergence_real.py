"""A real divergence of the reference trainer (torchrun, 2 CPU ranks, gloo): a learning
rate too high to train (peak 1.0, warmed up over 60 of 90 steps) lets the loss stall, then
climb by a quarter within a few steps once the warm-up passes ~0.75. The analyzer, fed
the run's telemetry file batch by batch as the collector is, raises `loss_diverging` with
its onset where the climb began and names the last checkpoint saved before it."""

from __future__ import annotations

import statistics
from pathlib import Path

import orjson
import pytest

from tests.conftest import run_trainer
from trainvitals.analyzer import Analyzer
from trainvitals.schema import to_arrow

# Starts processes (torchrun, a collector, a browser...) or runs for seconds: `make test` only.
pytestmark = pytest.mark.slow

STEPS, CHECKPOINT_EVERY = 90, 10


def _replay(path: Path) -> tuple[list, dict[int, float], list[int]]:
    """(alerts, loss by step, checkpoint steps) of a telemetry file."""
    analyzer, alerts, losses, checkpoints = Analyzer(), [], {}, []
    for line in path.read_bytes().splitlines():
        run_id, tables = to_arrow(orjson.loads(line))
        alerts += analyzer.observe(run_id, tables)
        if "steps" in tables:
            steps = tables["steps"]
            losses.update(zip(steps["step"].to_pylist(), steps["loss"].to_pylist(), strict=True))
        if "events" in tables:
            events = tables["events"].to_pylist()
            checkpoints += [e["step"] for e in events if e["kind"] == "checkpoint"]
    return alerts, losses, checkpoints


def _climb_begins(losses: dict[int, float]) -> int:
    """Ground truth from the losses alone: the first step (past the first 30) whose loss
    is 10% above the median of the 20 before it."""
    for step in range(30, STEPS):
        before = statistics.median(losses[s] for s in range(step - 20, step))
        if losses[step] > 1.1 * before:
            return step
    raise AssertionError(f"the loss never climbed: {losses}")


def test_a_real_learning_rate_divergence_is_flagged_at_its_onset(tmp_path: Path) -> None:
    telemetry = tmp_path / "telemetry.jsonl"
    run_trainer(
        [
            "--dp", "2", "--tp", "1", "--steps", str(STEPS), "--run-id", "diverge",
            "--lr", "1.0", "--warmup-steps", "60",
            "--checkpoint-dir", str(tmp_path / "ckpt"),
            "--checkpoint-every", str(CHECKPOINT_EVERY),
            "--telemetry-file", str(telemetry),
        ],
        nproc=2,
    )  # fmt: skip
    alerts, losses, checkpoints = _replay(telemetry)
    climb = _climb_begins(losses)
    diverging = [a for a in alerts if a.kind == "loss_diverging" and not a.resolves]
    assert len(diverging) == 1, [(a.kind, a.step, a.message) for a in alerts]
    (alert,) = diverging
    # The onset is the last healthy step: at most one level window (10 logged steps)
    # before the first loss of the climb, never after it; raised within 20 steps.
    assert climb - 10 <= alert.start_step < climb, (climb, alert.start_step)
    assert alert.start_step < alert.step <= climb + 20, (climb, alert.step)
    saved = max(c for c in checkpoints if c < alert.start_step)
    assert f"Roll back to the checkpoint saved at step {saved}, the last before" in alert.message
