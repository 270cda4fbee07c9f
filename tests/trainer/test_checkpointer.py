"""The checkpoint schedule (steps, or minutes turned into steps on an injected clock), async
saves that are complete only once written, rollback, and the data windows a re-run skips.
One process, a small real model, real DCP."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from trainvitals.trainer import checkpoint
from trainvitals.trainer.checkpointer import Checkpointer
from trainvitals.trainer.data import ByteBatches, advance_to, data_index, parse_windows


class Events:
    """The monitor's events and declared pauses, as the checkpointer uses them."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, int, dict]] = []
        self.pauses: list[str] = []  # each declared pause's phase, once it ended
        self.paused = False

    @contextlib.contextmanager
    def pause(self, phase: str) -> Iterator[None]:
        self.paused = True
        yield
        self.paused = False
        self.pauses.append(phase)

    def event(self, kind: str, step: int, rank: int = -1, detail: dict | None = None) -> None:
        self.rows.append((kind, step, {**(detail or {}), "in_pause": self.paused}))


def model_and_optimizer():
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)


def run(saver: Checkpointer, steps: int, clock: list[float] | None = None) -> None:
    model, optimizer, scheduler = model_and_optimizer()
    for step in range(steps):
        if clock is not None:
            clock[0] += 6.0  # every step takes 6 s of the injected clock
        saver.after_step(step, "r", model, optimizer, scheduler)
    saver.wait()


def test_minutes_are_turned_into_steps_from_the_measured_step_time(tmp_path: Path) -> None:
    clock, events = [0.0], Events()
    saver = Checkpointer(tmp_path, 0, {}, events, every_min=1.0, clock=lambda: clock[0])
    run(saver, 40, clock)
    # Steps 0-5 timed at 6 s each: one minute is 10 steps, counted from step 5.
    assert sorted(checkpoint.complete(tmp_path)) == [15, 25, 35]
    assert [s for k, s, _ in events.rows if k == "checkpoint"] == [15, 25, 35]
    # Each synchronous save was a declared pause (the watchdog gives it liveness.pause_s).
    assert events.pauses == ["checkpoint"] * 3
    assert all(d["in_pause"] for k, _, d in events.rows if k == "checkpoint")


def test_an_async_save_is_complete_only_once_written(tmp_path: Path) -> None:
    events = Events()
    saver = Checkpointer(tmp_path, 0, {"preset": "x"}, events, every_steps=5, async_save=True)
    model, optimizer, scheduler = model_and_optimizer()
    for step in range(5):
        saver.after_step(step, "r", model, optimizer, scheduler)
    assert saver._pending is not None  # in flight: not complete, not `latest`
    assert checkpoint.complete(tmp_path) == {} and checkpoint.latest(tmp_path) is None
    saver.wait()
    assert list(checkpoint.complete(tmp_path)) == [4]
    meta = json.loads((checkpoint.latest(tmp_path) / "trainer.json").read_text())
    assert (meta["step"], meta["config"]) == (4, {"preset": "x"})
    kinds = [(k, s) for k, s, _ in events.rows]
    assert kinds == [("checkpoint_stall", 4), ("checkpoint", 4)]
    stall, done = events.rows[0][2], events.rows[1][2]
    assert stall["stall_s"] >= 0 and done["async"] and done["save_s"] >= done["stall_s"]
    assert events.pauses == ["checkpoint", "checkpoint"]  # the copy to host, the wait


def test_roll_back_sets_newer_checkpoints_aside(tmp_path: Path) -> None:
    saver = Checkpointer(tmp_path, 0, {}, Events(), every_steps=5)
    run(saver, 20)
    (tmp_path / "step-00000022").mkdir()  # a save cut short: no trainer.json
    assert list(checkpoint.complete(tmp_path)) == [4, 9, 14, 19]
    assert checkpoint.roll_back(tmp_path, 12) == 9
    assert checkpoint.latest(tmp_path).name == "step-00000009"
    assert list(checkpoint.complete(tmp_path)) == [4, 9]
    aside = sorted(p.name.split(".")[0] for p in (tmp_path / "rolled-back").iterdir())
    assert aside == ["step-00000014", "step-00000019", "step-00000022"]
    assert checkpoint.roll_back(tmp_path, 3) is None  # none clean: start from scratch
    assert checkpoint.latest(tmp_path) is None


def test_skipped_data_windows() -> None:
    skipped = parse_windows(["3:5", "9"])
    assert [data_index(s, skipped) for s in range(7)] == [0, 1, 2, 6, 7, 8, 10]
    batches = ByteBatches(b"abcdefghij" * 10, 4, 2, seed=0)
    advance_to(batches, 6)
    assert batches.drawn == 6
    for bad in ("5:3", "a:b", "-1:2", "3:"):
        with pytest.raises(ValueError, match="--skip-data"):
            parse_windows([bad])
