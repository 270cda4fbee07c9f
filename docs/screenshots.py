"""Take the README's screenshots of the dashboard, one per view, from a stored run.

    python docs/screenshots.py --store run.duckdb          # replays it (trainvitals dashboard)
    python docs/screenshots.py --collector http://127.0.0.1:8000

Drives Debian's chromium through Playwright and writes docs/dashboard-<view>.png, each
cropped to the page's content.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from trainvitals.demo import wait_healthy

DOCS = Path(__file__).resolve().parent
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking"]
CHROMIUM_ARGS += ["--disable-component-update", "--disable-sync", "--disable-quic"]
VIEWS = ("Overview", "Layers", "Ranks", "Health")
WIDTH_PX = 1400
# Time for a view's charts to draw after the page says it is done (Vega renders after).
SETTLE_S = 3.0


def serve(args: argparse.Namespace, port: int) -> subprocess.Popen:
    """`trainvitals dashboard` on 127.0.0.1:port, replaying --store or reading --collector."""
    source = ["--store", str(args.store)] if args.store else ["--collector", args.collector]
    argv = [sys.executable, "-m", "trainvitals", "dashboard", *source, "--port", str(port)]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def shoot(url: str, out_dir: Path) -> None:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": WIDTH_PX, "height": 1000})
        page.goto(url)
        for view in VIEWS:
            page.get_by_role("radio", name=view).click()
            page.get_by_role("radio", name=view, checked=True).wait_for()
            page.wait_for_load_state("networkidle")
            time.sleep(SETTLE_S)
            # Streamlit scrolls inside its main block: grow the window to hold all of it.
            height = page.get_by_test_id("stMainBlockContainer").bounding_box()["height"]
            page.set_viewport_size({"width": WIDTH_PX, "height": int(height) + 40})
            time.sleep(SETTLE_S)
            path = out_dir / f"dashboard-{view.lower()}.png"
            page.screenshot(path=path)
            print(f"{path}: {path.stat().st_size / 1024:.0f} KB")
        browser.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--store", type=Path, help="DuckDB store to replay")
    source.add_argument("--collector", help="collector base URL")
    parser.add_argument("--port", type=int, default=8599, help="dashboard port")
    parser.add_argument("--out", type=Path, default=DOCS)
    args = parser.parse_args()
    proc = serve(args, args.port)
    try:
        url = f"http://127.0.0.1:{args.port}"
        wait_healthy(f"{url}/_stcore/health", proc, timeout_s=120)
        shoot(url, args.out)
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main()
