"""What the user has chosen, kept in Streamlit session state across views and refreshes.

The run, the step window and the view are widgets outside the live fragment, so a refresh
never touches them, and every view reads the same run and window. The window is stored per
run under WINDOWS_KEY, which is ours: Streamlit forgets the state of a widget that one run
of the script does not draw, and the slider is redrawn with a new range whenever the run
grows, so the slider's own state is rewritten from ours before each draw.

Clicking an alert asks for a jump (`request_jump`). The jump is applied at the start of
the next full run (`apply_pending_jump`), before the widgets it moves are drawn: Streamlit
refuses to change a widget's value once the widget is on the page.
"""

from __future__ import annotations

from dataclasses import dataclass

import streamlit as st

from trainvitals.dashboard.charts import MAX_HEATMAP_STEPS

VIEWS = ("Overview", "Layers", "Ranks", "Health")
VIEW_KEY = "view"
RUN_KEY = "run"
SLIDER_KEY = "steps"
WINDOWS_KEY = "windows"  # run_id -> (first step, last step, follows the live end)
PENDING_JUMP_KEY = "pending_jump"
NO_SELECTION = {"selection": {"rows": [], "columns": [], "cells": []}}
# Steps shown around an alert after a jump: the widest window in which each column of a
# heatmap with few rows is a single step (the collector merges steps beyond this).
JUMP_WIDTH_STEPS = MAX_HEATMAP_STEPS


@dataclass(frozen=True)
class Window:
    """A step window; `end` None means "up to the latest step" (it follows a live run)."""

    start: int = 0
    end: int | None = None


@dataclass(frozen=True)
class Jump:
    """Where clicking an alert takes the user: a view and a step window."""

    run_id: str
    view: str
    start: int
    end: int


def jump_for(
    run_id: str, step: int, last_step: int, rank: int | None = None, layer: int | None = None
) -> Jump:
    """The jump to an alert at `step`: the layer view for a layer culprit, ranks for a rank.

    The window is JUMP_WIDTH_STEPS wide, centred on the step where the run allows it.

    >>> jump_for("r", step=1000, last_step=5000, layer=3)
    Jump(run_id='r', view='Layers', start=850, end=1149)
    """
    view = "Layers" if layer is not None else "Ranks" if rank is not None else "Overview"
    latest_start = max(0, last_step - JUMP_WIDTH_STEPS + 1)
    start = min(max(0, step - JUMP_WIDTH_STEPS // 2), latest_start)
    return Jump(run_id, view, start, min(last_step, start + JUMP_WIDTH_STEPS - 1))


def request_jump(jump: Jump, clear_key: str) -> None:
    """Move to `jump` on a full rerun of the script (which this call starts).

    `clear_key` is the table the jump was chosen in: its selection is cleared, so that it
    does not jump again when the table is drawn next.
    """
    st.session_state[PENDING_JUMP_KEY] = (jump, clear_key)
    st.rerun()


def apply_pending_jump() -> None:
    """Apply a requested jump; call before the run, window and view widgets are drawn."""
    pending: tuple[Jump, str] | None = st.session_state.pop(PENDING_JUMP_KEY, None)
    if pending is None:
        return
    jump, clear_key = pending
    st.session_state[clear_key] = NO_SELECTION
    st.session_state[RUN_KEY] = jump.run_id
    st.session_state[VIEW_KEY] = jump.view
    _windows()[jump.run_id] = (jump.start, jump.end, False)


def pick_view() -> str:
    """The view selector; its choice survives refreshes and jumps."""
    st.session_state.setdefault(VIEW_KEY, VIEWS[0])
    return st.segmented_control(
        "View", VIEWS, key=VIEW_KEY, required=True, label_visibility="collapsed"
    )


def pick_window(run_id: str, last_step: int) -> Window:
    """Sidebar step-window slider. A window whose right end is on the last step follows it."""
    if last_step < 1:
        return Window()  # a slider needs two distinct ends
    windows = _windows()
    first, last, follow = windows.get(run_id, (0, last_step, True))
    last = last_step if follow else min(last, last_step)
    st.session_state[SLIDER_KEY] = (min(first, last), last)

    def remember() -> None:
        new_first, new_last = st.session_state[SLIDER_KEY]
        windows[run_id] = (new_first, new_last, new_last == last_step)

    st.sidebar.slider(
        "Steps",
        min_value=0,
        max_value=last_step,
        key=SLIDER_KEY,
        on_change=remember,
        help="Leave the right end on the last step to follow a live run.",
    )
    return Window(min(first, last), None if follow else last)


def _windows() -> dict[str, tuple[int, int, bool]]:
    return st.session_state.setdefault(WINDOWS_KEY, {})
