"""The trainvitals dashboard: four views of one run, live or replayed, read from the collector.

    streamlit run dashboard/app.py -- --collector http://127.0.0.1:8000

or `trainvitals dashboard`. The collector URL comes from `--collector`, else the
TRAINVITALS_COLLECTOR_URL environment variable, else http://127.0.0.1:8000.

The sidebar holds the run and the step window, the top of the page the view (Overview,
Layers, Ranks, Nodes, Health, Compare); the URL carries them too (state.py: deep links).
They render on full reruns only and are kept in session state (state.py), so every view
shows the same run and window. Everything that shows data sits
in one fragment that reruns every REFRESH_S seconds, so a live run updates without
reloading the page or touching those choices. A collector in replay mode serves a stored
run that cannot change, so its page does not poll.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
from collections.abc import Mapping, Sequence
from urllib.parse import urlsplit

import streamlit as st

from trainvitals.dashboard import compare, health, layers, nodes, overview, ranks
from trainvitals.dashboard.client import (
    DEFAULT_URL,
    CollectorClient,
    CollectorError,
    CollectorUnavailable,
    RunNotFound,
    RunSummary,
)
from trainvitals.dashboard.state import (
    RUN_KEY,
    Window,
    apply_pending_jump,
    pick_view,
    pick_window,
    read_deep_link,
    write_deep_link,
)

URL_ENV_VAR = "TRAINVITALS_COLLECTOR_URL"
REFRESH_S = 2
# Short enough that a hung collector stalls one refresh, not the page.
REQUEST_TIMEOUT_S = 3.0


def collector_url(argv: Sequence[str], environ: Mapping[str, str]) -> str:
    """`--collector URL` (script args after streamlit's `--`), else the env var, else default."""
    # allow_abbrev=False: under a test runner argv is the runner's, and e.g. pytest's `--co`
    # must not be read as an abbreviation of --collector.
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--collector")
    args, _ = parser.parse_known_args(argv)
    return args.collector or environ.get(URL_ENV_VAR) or DEFAULT_URL


@st.cache_resource
def get_client(url: str) -> CollectorClient:
    """One client (one connection pool) per collector URL, shared by all sessions."""
    return CollectorClient(url, timeout_s=REQUEST_TIMEOUT_S)


def unreachable_message(url: str) -> str:
    """What to tell a user when nothing answers at `url`, including how to fix it."""
    port = urlsplit(url).port or 8000
    return (
        f"Cannot reach the trainvitals collector at {url}. Start one with "
        f"`trainvitals collector --store trainvitals.duckdb --port {port}`, or point the "
        f"dashboard at another one with `--collector URL` or ${URL_ENV_VAR}. "
        f"Retrying every {REFRESH_S} s."
    )


def main() -> None:
    """Render the page: sidebar choices, the view selector, then the chosen view's panel."""
    st.set_page_config(page_title="trainvitals", layout="wide")
    st.sidebar.title("trainvitals")
    url = collector_url(sys.argv[1:], os.environ)
    runs, problem = runs_or_problem(url)
    if problem:
        st.error(problem)
    elif not runs:
        st.info(f"The collector at {url} holds no runs yet; this page updates when one starts.")
    if problem or not runs:
        rerun_on_change(url, problem)
        return
    # Both before the widgets they move are drawn.
    for problem in read_deep_link({r.run_id: r.last_step for r in runs}):
        st.warning(problem)
    apply_pending_jump()
    run = pick_run(runs)
    window = pick_window(run.run_id, run.last_step or 0)
    view = pick_view()
    write_deep_link(run.run_id, view, window)
    # What the sidebar was drawn with: a change (a new run, a live run's new step) redraws
    # it, so that the step slider's range never lags the view.
    listed = tuple((r.run_id, r.last_step) for r in runs)
    if replaying(url):
        st.sidebar.caption("Replay: a stored run, read-only; the page does not refresh.")
        replay_panel(url, view, run.run_id, window, listed)
    else:
        st.sidebar.caption(f"Live: the view refreshes every {REFRESH_S} s.")
        live_panel(url, view, run.run_id, window, listed)


def runs_or_problem(url: str) -> tuple[list[RunSummary], str | None]:
    """The collector's runs, or a message saying why there are none to read; never raises."""
    try:
        return get_client(url).runs(), None
    except CollectorUnavailable:
        return [], unreachable_message(url)
    except CollectorError as e:
        return [], f"The collector at {url} answered with an error: {e}"


@st.fragment(run_every=REFRESH_S)
def rerun_on_change(url: str, shown_problem: str | None) -> None:
    """While the page shows an empty state, poll; rebuild the page once the state changes."""
    runs, problem = runs_or_problem(url)
    if runs or problem != shown_problem:
        st.rerun()


def pick_run(runs: list[RunSummary]) -> RunSummary:
    """Sidebar run selector, newest first, with the chosen run's metadata below it."""
    by_id = {r.run_id: r for r in runs}
    # keyed, so the choice survives the options growing when a new run starts.
    run_id = st.sidebar.selectbox(
        "Run (newest first)", list(by_id), format_func=lambda i: run_label(by_id[i]), key=RUN_KEY
    )
    run = by_id[run_id]
    st.sidebar.markdown(run_details(run))
    return run


def run_label(run: RunSummary) -> str:
    """Selector label: the run id, plus model and world size when the run sent them."""
    extras = [x for x in (run.model, run.world_size and f"{run.world_size} ranks") if x]
    return f"{run.run_id} ({', '.join(extras)})" if extras else run.run_id


def run_details(run: RunSummary) -> str:
    """Markdown lines describing what the run trains, on what, laid out how."""
    lines = []
    if run.n_params:
        lines.append(f"**params** {count_label(run.n_params)}")
    if run.world_size:
        lines.append(f"**ranks** {run.world_size} (dp {run.dp} x tp {run.tp})")
    if run.device_name or run.device_type:
        lines.append(f"**device** {run.device_name or run.device_type}")
    if run.started_unix_s:
        started = dt.datetime.fromtimestamp(run.started_unix_s, tz=dt.UTC)
        lines.append(f"**started** {started:%Y-%m-%d %H:%M:%S} UTC")
    return "  \n".join(lines) or "The run sent no metadata."


def count_label(n: int) -> str:
    """A count as people quote model sizes: 139584 -> "139.6 k", 7.0e9 -> "7.0 B"."""
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.1f} {suffix}"
    return str(n)


def replaying(url: str) -> bool:
    """Whether the collector replays a stored run; False if it cannot say (it then polls)."""
    try:
        return get_client(url).is_replay()
    except CollectorError:
        return False


def view_panel(
    url: str, view: str, run_id: str, window: Window, listed: tuple[tuple[str, int | None], ...]
) -> None:
    """The chosen view of the run, or an honest message saying why there is nothing to show."""
    client = get_client(url)
    try:
        runs = client.runs()
        if tuple((r.run_id, r.last_step) for r in runs) != listed:
            # A run started, vanished or logged a step: rebuild the sidebar (list, slider).
            st.rerun()
        run = next(r for r in runs if r.run_id == run_id)
        if run.last_step is None:
            st.info(f"Run {run_id} has not logged a step yet; this page updates when it does.")
            return
        st.caption(window_label(window, run.last_step))
        show_view(view, client, run, window, runs)
    except CollectorUnavailable:
        st.error(unreachable_message(url))
    except RunNotFound:
        st.warning(f"The collector no longer holds run {run_id}; pick another run.")
    except CollectorError as e:
        st.error(f"The collector at {url} answered with an error: {e}")


live_panel = st.fragment(run_every=REFRESH_S)(view_panel)
replay_panel = st.fragment(view_panel)


def show_view(
    view: str, client: CollectorClient, run: RunSummary, window: Window, runs: list[RunSummary]
) -> None:
    """Load what the view needs (all of it bucketed on the server), then draw it."""
    match view:
        case "Layers":
            layers.render(layers.load(client, run, window), run, window)
            layers.drill_down(client, run, window)
        case "Ranks":
            ranks.render(ranks.load(client, run, window), run, window)
        case "Nodes":
            nodes.render(nodes.load(client, run, window), run, window, client)
        case "Health":
            health.render(health.load(client, run, window), run, window)
        case "Compare":
            compare.render(client, run, runs)
        case _:
            overview.render(overview.load(client, run, window), run, window)


def window_label(window: Window, last_step: int) -> str:
    """E.g. "Steps 100 to 400 of 0 to 1,000", or "... to the latest (1,000)"."""
    if window.end is None:
        return f"Steps {window.start:,} to the latest ({last_step:,})."
    return f"Steps {window.start:,} to {window.end:,} of 0 to {last_step:,}."


# Streamlit (and AppTest) run this file as __main__; tests may import its helpers.
if __name__ == "__main__":
    main()
