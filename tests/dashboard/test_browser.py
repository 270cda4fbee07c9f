"""The dashboard in a real browser: Debian's chromium, driven by Playwright, on 127.0.0.1.

Streamlit renders Vega-Lite charts as SVG, so a test can count the marks a chart drew:
points on a line, cells of a heatmap. Screenshots go to artifacts/dashboard/ (ignored by
git) for a person, or CI, to look at.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.conftest import REPO, free_port, patience_s, wait_until
from tests.dashboard.canned import canned_run
from trainvitals.dashboard.launch import dashboard_command

CHROMIUM = Path("/usr/bin/chromium")
# No sandbox: CI runs as root in a container. The rest keeps chromium off the network.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-quic",
]
ARTIFACTS = REPO / "artifacts" / "dashboard"
# Hang guards, not speed limits: streamlit's start and a page's render took over 30 s each
# on 2 cores at load 20 (a refresh is 2 s on an idle box). Every Playwright wait of a page
# (locators, clicks, navigation) gets RENDER_TIMEOUT_MS (open_page).
STARTUP_TIMEOUT_S = 300
RENDER_TIMEOUT_MS = patience_s(180) * 1000
# Polls of what a chart drew (wait_until scales it the same way).
DRAWN_TIMEOUT_S = 180

pytestmark = [
    pytest.mark.slow,  # a browser, a collector and a dashboard: `make test` only
    pytest.mark.skipif(
        not CHROMIUM.exists(),
        reason=f"needs Debian's chromium at {CHROMIUM} (`make test` installs it)",
    ),
]


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield browser
        browser.close()


def open_page(browser, width: int, height: int):
    """A new page whose every wait (locators, clicks, navigation) allows RENDER_TIMEOUT_MS,
    not Playwright's default 30 s."""
    page = browser.new_page(viewport={"width": width, "height": height})
    page.set_default_timeout(RENDER_TIMEOUT_MS)
    return page


@contextmanager
def dashboard(collector_url: str) -> Iterator[str]:
    """`trainvitals dashboard`'s streamlit on a free port of 127.0.0.1; yields its URL."""
    port = free_port()
    proc = subprocess.Popen(
        dashboard_command(collector_url, port=port),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        assert proc.poll() is None, "streamlit exited"
        try:
            return httpx.get(f"{url}/_stcore/health", timeout=5.0).status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_until(healthy, timeout_s=STARTUP_TIMEOUT_S)
        yield url
    finally:
        # Clean-up only: the dashboard's own stop on SIGINT and SIGTERM is tested in
        # test_launch.py. Streamlit in the middle of a script run can outlast a minute's
        # wait with both cores saturated (a fresh-clone CI beside two busy loops): then
        # kill it, rather than fail a test whose checks passed.
        proc.terminate()
        try:
            proc.wait(patience_s(60))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def chart(page, title: str):
    """The chart whose SVG holds `title`; waits until it is on the page."""
    found = page.get_by_test_id("stVegaLiteChart").filter(has_text=title)
    found.first.wait_for(timeout=RENDER_TIMEOUT_MS)
    return found.first


def line_points(chart_locator) -> int:
    """Points of the chart's (first) line: one M and one L per point in the path."""
    path = chart_locator.locator("g.mark-line path").first.get_attribute("d")
    return path.count("L") + 1


def test_a_real_run_shows_mfu_power_and_the_layer_heatmap(browser, collector_with_run) -> None:
    run = httpx.get(f"{collector_with_run}/api/v1/runs").json()[0]
    steps = run["last_step"] + 1
    power = httpx.get(f"{collector_with_run}/api/v1/runs/{run['run_id']}/steps").json()
    has_power = any(power["columns"]["power_w"])
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with dashboard(collector_with_run) as url:
        page = open_page(browser, 1400, 2400)
        page.goto(url)
        assert line_points(chart(page, "Model FLOPs utilization")) == steps
        if has_power:
            assert line_points(chart(page, "Power, all devices")) == steps
        else:  # this host has no power source: the panel says so, naming what it tried
            alert = page.get_by_test_id("stAlert").filter(has_text="power")
            alert.first.wait_for(timeout=RENDER_TIMEOUT_MS)
        page.screenshot(path=ARTIFACTS / "overview.png", full_page=True)

        page.get_by_role("radio", name="Layers").click()
        heatmap = chart(page, "gradient L2 norm")
        cells = heatmap.locator("g.mark-rect.role-mark path")  # not the legend's gradient
        n_cells = steps * len(run["layer_names"])
        wait_until(lambda: cells.count() == n_cells, timeout_s=DRAWN_TIMEOUT_S)
        page.screenshot(path=ARTIFACTS / "layers.png", full_page=True)
    assert (ARTIFACTS / "layers.png").stat().st_size > 10_000


def test_a_live_run_refreshes_without_a_reload_and_keeps_view_and_window(
    browser, canned_collector
) -> None:
    canned_run(canned_collector, n_steps=5)
    with dashboard(canned_collector.url) as url:
        page = open_page(browser, 1400, 1200)
        page.goto(url)
        page.get_by_role("radio", name="Health").click()
        page.get_by_text("No alerts for this run.").wait_for(timeout=RENDER_TIMEOUT_MS)
        # One key at a time, each waited for: a key pressed while the page reruns after the
        # one before can land on a slider that is being replaced (seen on a loaded machine).
        for first_step in (1, 2):
            first_thumb = page.get_by_role("slider").first
            first_thumb.focus()
            first_thumb.press("ArrowRight")
            page.get_by_text(f"Steps {first_step} to the latest (4).").wait_for(
                timeout=RENDER_TIMEOUT_MS
            )
        page.evaluate("window.notReloaded = true")

        # The run grows by three steps and raises an alert; nothing in the page is touched.
        spike = {"step": 6, "kind": "loss_spike", "severity": "warning", "rank": None}
        spike |= {"layer": None, "message": "loss spike", "value": 9.0, "baseline": 3.0}
        canned_run(canned_collector, n_steps=8, alerts=[spike | {"time_unix_s": 1006.0}])
        # The new step and alert show in the same view, over the same window (from step 2).
        page.get_by_text("Steps 2 to the latest (7).").wait_for(timeout=RENDER_TIMEOUT_MS)
        chart(page, "loss_spike")  # on the alert timeline
        # The sidebar's step slider follows the run: its range reaches the new last step.
        # While the script reruns, the slider it is replacing may still be on the page (seen
        # on a loaded machine): wait until the one slider left reads 0 to 7.
        tick_bars = page.get_by_test_id("stSliderTickBar")
        wait_until(
            lambda: [t.split() for t in tick_bars.all_inner_texts()] == [["0", "7"]],
            timeout_s=DRAWN_TIMEOUT_S,
        )
        assert page.evaluate("window.notReloaded") is True
        assert page.get_by_role("radio", name="Health", checked=True).count() == 1


def test_an_alert_marker_shows_its_message_and_opens_health_at_its_step(browser, two_runs) -> None:
    from tests.dashboard.two_runs import STEPS

    with dashboard(two_runs) as url:
        page = open_page(browser, 1400, 2400)
        page.goto(f"{url}/?run=faulty&view=Overview")
        loss = chart(page, "Loss")
        # The markers' triangles: one per alert or event, at the top of the plot.
        triangles = loss.locator("g.mark-symbol.role-mark path")
        wait_until(lambda: triangles.count() == 2, timeout_s=DRAWN_TIMEOUT_S)
        spike = next(
            t for t in triangles.all() if "loss_spike" in (t.get_attribute("aria-label") or "")
        )
        spike.hover()
        tooltip = page.locator("#vg-tooltip-element")
        tooltip.filter(has_text="loss_spike").wait_for(timeout=RENDER_TIMEOUT_MS)
        assert "warning" in tooltip.inner_text()
        spike.click()
        # The marker's link, ?run=faulty&view=Health&step=225; the page then writes the
        # window it opened back into the address bar.
        page.wait_for_url("**run=faulty&view=Health**", timeout=RENDER_TIMEOUT_MS)
        page.get_by_role("radio", name="Health", checked=True).wait_for(timeout=RENDER_TIMEOUT_MS)
        timeline = chart(page, "Alerts and events")
        assert timeline.locator("g.mark-symbol.role-mark path").count() == 1  # the spike
        page.get_by_text(f"Steps 0 to the latest ({STEPS[-1]})").wait_for(timeout=RENDER_TIMEOUT_MS)


def test_a_deep_link_compares_runs_and_the_drill_down_follows_layers(browser, two_runs) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with dashboard(two_runs) as url:
        page = open_page(browser, 1400, 1800)
        page.goto(f"{url}/?run=faulty&view=Compare")
        loss = chart(page, "Loss")
        lines = loss.locator("g.mark-line.role-mark path")
        wait_until(lambda: lines.count() == 2, timeout_s=DRAWN_TIMEOUT_S)  # one line per run
        page.screenshot(path=ARTIFACTS / "compare.png", full_page=True)

        page.get_by_role("radio", name="Layers").click()
        page.get_by_text("Pick up to 8 layers").wait_for(timeout=RENDER_TIMEOUT_MS)
        page.get_by_test_id("stMultiSelect").filter(has_text="Layers to follow").click()
        page.get_by_role("option", name="block.1").click()
        page.keyboard.press("Escape")
        # The drill-down's line charts (the heatmaps above them draw no line), one per
        # statistic the run reported (no update RMS here), each the chosen layer's line.
        lines = page.get_by_test_id("stVegaLiteChart").locator("g.mark-line.role-mark path")
        try:
            wait_until(lambda: lines.count() == 2, timeout_s=DRAWN_TIMEOUT_S)
        finally:
            page.screenshot(path=ARTIFACTS / "layers-drill-down.png", full_page=True)
        page.get_by_test_id("stVegaLiteChart").filter(has_text="block.1").first.wait_for()
        assert "view=Layers" in page.url  # the address bar follows the view
