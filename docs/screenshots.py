"""Take the README's screenshots of the dashboard, one per view, of a run with faults.

    python docs/screenshots.py --train                     # trains the runs it shows
    python docs/screenshots.py --store run.duckdb          # replays it (trainvitals dashboard)
    python docs/screenshots.py --collector http://127.0.0.1:8000
    python docs/screenshots.py --store gpu_runs.duckdb --run gpu-faulty --views Overview \
        --suffix=-power                                    # power: bench/gpu_power_run.sh

`--train` starts a collector on a temporary store and trains two real 4-rank CPU runs into
it with the reference trainer: "faulty" (a loss spike, a straggler and a faulty unit
injected; logged every LOG_EVERY steps, as hooks log by default) and "baseline" (clean, for
the Compare view); about 5 minutes on 2 cores. CPU runs have no power readings: the power
screenshots replay the store of two 1-GPU runs that bench/gpu_power_run.sh makes where a GPU
is lent. Drives Debian's chromium through Playwright and writes docs/dashboard-<view>.png,
each cropped to the page's content; the Layers view follows two layers in its
drill-down, the Nodes view lists the slowest node's ranks.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from trainvitals.dashboard.launch import free_port
from trainvitals.demo import wait_healthy

DOCS = Path(__file__).resolve().parent
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking"]
CHROMIUM_ARGS += ["--disable-component-update", "--disable-sync", "--disable-quic"]
VIEWS = ("Overview", "Layers", "Ranks", "Nodes", "Health", "Compare")
RUN_ID = "faulty"
LOG_EVERY = 4
FAULTS = ("spike:step=32", "straggler:rank=1,step=48,slowdown=0.5", "sdc:rank=2,step=64")
WIDTH_PX = 1400
# Time for a view's charts to draw after the page says it is done (Vega renders after).
SETTLE_S = 3.0


def serve(args: argparse.Namespace, port: int) -> subprocess.Popen:
    """`trainvitals dashboard` on 127.0.0.1:port, replaying --store or reading --collector."""
    source = ["--store", str(args.store)] if args.store else ["--collector", args.collector]
    argv = [sys.executable, "-m", "trainvitals", "dashboard", *source, "--port", str(port)]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def train(collector: str, run_id: str, args: argparse.Namespace, faults: tuple[str, ...]) -> None:
    """A 4-rank (dp 2 x tp 2) run of the reference trainer, reported to `collector`."""
    injected = [arg for fault in faults for arg in ("--inject", fault)]
    argv = [sys.executable, "-m", "trainvitals", "train", "--nproc", "4", "--dp", "2",
            "--tp", "2", "--steps", str(args.steps), "--device", args.device, "--log-every",
            str(LOG_EVERY), "--canary-every", str(2 * LOG_EVERY), "--run-id", run_id,
            "--collector", collector, *injected]  # fmt: skip
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)


def trained_collector(store: Path, args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    """A collector on `store` holding the baseline and the faulty run; (process, URL)."""
    port = free_port()
    argv = [sys.executable, "-m", "trainvitals", "collector", "--store", str(store)]
    proc = subprocess.Popen([*argv, "--port", str(port)], stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(f"{url}/healthz", proc)
    train(url, "baseline", args, ())
    train(url, RUN_ID, args, FAULTS)
    time.sleep(SETTLE_S)  # the collector's analyzer runs about a second behind
    return proc, url


def open_on_demand(page, view: str) -> None:
    """What a user opens in a view: two layers followed, the slowest node's ranks."""
    if view == "Layers":
        page.get_by_test_id("stMultiSelect").filter(has_text="Layers to follow").click()
        for name in ("layers.0", "output"):
            page.get_by_role("option", name=name).first.click()
        page.keyboard.press("Escape")
    elif view == "Nodes":
        page.get_by_test_id("stSelectbox").filter(has_text="Ranks of node").click()
        page.get_by_role("option").first.click()


def shoot(url: str, out_dir: Path, run_id: str | None, views: tuple[str, ...], suffix: str) -> None:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": WIDTH_PX, "height": 1000})
        for view in views:
            # A deep link per view (docs/dashboard.md), as an alert's link opens one.
            page.goto(f"{url}/?view={view}" + (f"&run={run_id}" if run_id else ""))
            page.get_by_role("radio", name=view, checked=True).wait_for(timeout=60_000)
            page.wait_for_load_state("networkidle")
            time.sleep(SETTLE_S)
            open_on_demand(page, view)
            time.sleep(SETTLE_S)
            # Streamlit scrolls inside its main block: grow the window to hold all of it.
            height = page.get_by_test_id("stMainBlockContainer").bounding_box()["height"]
            page.set_viewport_size({"width": WIDTH_PX, "height": int(height) + 40})
            time.sleep(SETTLE_S)
            path = out_dir / f"dashboard-{view.lower()}{suffix}.png"
            page.screenshot(path=path)
            print(f"{path}: {path.stat().st_size / 1024:.0f} KB")
        browser.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--train", action="store_true", help="train runs with faults first")
    source.add_argument("--store", type=Path, help="DuckDB store to replay")
    source.add_argument("--collector", help="collector base URL")
    parser.add_argument("--steps", type=int, default=80, help="steps per trained run")
    parser.add_argument("--device", default="cpu", help="device of the trained runs")
    parser.add_argument("--port", type=int, default=8599, help="dashboard port")
    parser.add_argument("--out", type=Path, default=DOCS)
    parser.add_argument(
        "--run", help="run to show (default: the trained faulty run, else the newest)"
    )
    parser.add_argument("--views", default=",".join(VIEWS), help="comma-separated views to shoot")
    parser.add_argument("--suffix", default="", help="added to each file name, e.g. -power")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        collector = None
        if args.train:
            collector, args.collector = trained_collector(Path(tmp) / "store.duckdb", args)
        proc = serve(args, args.port)
        try:
            url = f"http://127.0.0.1:{args.port}"
            wait_healthy(f"{url}/_stcore/health", proc, timeout_s=120)
            views = tuple(v.strip() for v in args.views.split(","))
            unknown = set(views) - set(VIEWS)
            if unknown:
                parser.error(f"--views: unknown {sorted(unknown)}; choose from {', '.join(VIEWS)}")
            shoot(url, args.out, args.run or (RUN_ID if args.train else None), views, args.suffix)
        finally:
            for p in (proc, collector):
                if p is not None:
                    p.terminate()
                    p.wait(30)


if __name__ == "__main__":
    main()
