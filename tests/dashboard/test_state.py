"""Where clicking an alert takes the user."""

from __future__ import annotations

from trainvitals.dashboard.state import JUMP_WIDTH_STEPS, jump_for


def test_a_layer_culprit_opens_the_layers_view_centred_on_the_step() -> None:
    jump = jump_for("r", step=5000, last_step=100_000, layer=3, rank=7)
    assert jump.view == "Layers"
    assert jump.start < 5000 < jump.end
    assert jump.end - jump.start + 1 == JUMP_WIDTH_STEPS


def test_a_rank_culprit_opens_ranks_and_no_culprit_the_overview() -> None:
    assert jump_for("r", step=10, last_step=1000, rank=2).view == "Ranks"
    assert jump_for("r", step=10, last_step=1000).view == "Overview"


def test_the_window_stays_inside_the_run() -> None:
    early = jump_for("r", step=3, last_step=100_000)
    late = jump_for("r", step=99_999, last_step=100_000)
    short = jump_for("r", step=20, last_step=40)
    assert (early.start, early.end) == (0, JUMP_WIDTH_STEPS - 1)
    assert late.end == 100_000
    assert late.end - late.start + 1 == JUMP_WIDTH_STEPS
    assert (short.start, short.end) == (0, 40)
