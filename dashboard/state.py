"""What the user has chosen, kept in Streamlit session state across views and refreshes.

The run, the step window and the view are widgets outside the live fragment, so a refresh
never touches them, and every view reads the same run and window. The window is stored per
run under WINDOWS_KEY, which is ours: Streamlit forgets the state of a widget that one run
of the script does not draw, and the slider is redrawn with a new range whenever the run
grows, so the slider's own state is rewritten from ours before each draw.

Clicking an alert asks for a jump (`request_jump`). The jump is applied at the start of
the next full run (`apply_pending_jump`), before the widgets it moves are drawn: Streamlit
refuses to change a widget's value once the widget is on the page.

Deep links: the page's URL carries the run, the view and the step window
(`?run=r1&view=Health&step=1200`, or `&start=1000&end=1400`). A session's first run reads
them (`read_deep_link`); every run writes the current choices back (`write_deep_link`),
so the address bar can be shared. Alert markers on the charts link to the Health view at
their step, and the Prometheus alerts to the run's Health view.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import streamlit as st

from trainvitals.dashboard.charts import MAX_HEATMAP_STEPS

VIEWS = ("Overview", "Layers", "Ranks", "Nodes", "Health", "Compare")
VIEW_KEY = "view"
RUN_KEY = "run"
SLIDER_KEY = "steps"
WINDOWS_KEY = "windows"  # run_id -> (first step, last step, follows the live end)
PENDING_JUMP_KEY = "pending_jump"
DEEP_LINK_READ_KEY = "deep_link_read"
LINK_PARAMS = ("run", "view", "step", "start", "end")
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


def parse_deep_link(
    params: Mapping[str, str], last_steps: Mapping[str, int | None]
) -> tuple[Jump | None, list[str]]:
    """The jump a URL's query parameters ask for, and a message for each one that is bad.

    `last_steps`: the collector's runs (id -> last logged step, None before the first).
    A bad parameter is left out, with a message saying why and what is accepted; the
    rest still apply. `step` centres a window on that step (as clicking an alert does);
    `start` and `end` give a window; without either, the whole run.

    >>> parse_deep_link({"run": "r", "step": "1000"}, {"r": 5000})
    (Jump(run_id='r', view='Health', start=850, end=1149), [])
    """
    problems = []
    if not params.get("run") and not params.get("view"):
        return None, problems
    run_id = params.get("run") or next(iter(last_steps), None)
    if run_id not in last_steps:
        known = ", ".join(list(last_steps)[:5])
        return None, [f"The link names run {run_id!r}, which this collector does not hold "
                      f"(it holds {known or 'no runs'}); showing the newest run."]  # fmt: skip
    view = params.get("view", "Health" if "step" in params else VIEWS[0])
    if view not in VIEWS:
        problems.append(f"The link's view {view!r} is not one of {', '.join(VIEWS)}; "
                        "showing the Overview.")  # fmt: skip
        view = VIEWS[0]
    last_step = last_steps[run_id] or 0
    numbers = {}
    for name in ("step", "start", "end"):
        if name not in params:
            continue
        text = params[name]
        if not text.isdigit():
            problems.append(
                f"The link's {name} {text!r} is not a step number; showing the whole run."
            )
            return Jump(run_id, view, 0, last_step), problems
        numbers[name] = int(text)
    if "step" in numbers:
        step = numbers["step"]
        if step > last_step:
            problems.append(f"Run {run_id} has no step {step:,} yet (its last is "
                            f"{last_step:,}); showing its last steps.")  # fmt: skip
        jump = jump_for(run_id, min(step, last_step), last_step)
        return Jump(run_id, view, jump.start, jump.end), problems
    start, end = numbers.get("start", 0), min(numbers.get("end", last_step), last_step)
    if start > end:
        problems.append(f"The link's window {start:,} to {end:,} is empty for run {run_id} "
                        f"(steps 0 to {last_step:,}); showing the whole run.")  # fmt: skip
        start, end = 0, last_step
    return Jump(run_id, view, start, end), problems


def read_deep_link(last_steps: Mapping[str, int | None]) -> list[str]:
    """On a session's first run, apply the URL's run, view and window; the problems found.

    Call before the run, window and view widgets are drawn.
    """
    if st.session_state.get(DEEP_LINK_READ_KEY):
        return []
    st.session_state[DEEP_LINK_READ_KEY] = True
    params = {k: st.query_params[k] for k in LINK_PARAMS if k in st.query_params}
    jump, problems = parse_deep_link(params, last_steps)
    if jump is not None:
        st.session_state[RUN_KEY] = jump.run_id
        st.session_state[VIEW_KEY] = jump.view
        last = last_steps[jump.run_id] or 0
        _windows()[jump.run_id] = (jump.start, jump.end, jump.end >= last and "end" not in params)
    return problems


def write_deep_link(run_id: str, view: str, window: Window) -> None:
    """Put the current run, view and window in the URL, so that it can be shared."""
    link = {"run": run_id, "view": view}
    if window != Window():
        link["start"] = str(window.start)
        if window.end is not None:
            link["end"] = str(window.end)
    if {k: st.query_params.get(k) for k in LINK_PARAMS} != {k: link.get(k) for k in LINK_PARAMS}:
        st.query_params.from_dict(link)


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
