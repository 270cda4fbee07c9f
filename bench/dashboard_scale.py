"""Is the dashboard responsive on a very long, very wide run? Measured on a synthetic store.

Builds a DuckDB store with the collector's own tables (trainvitals.schema.ddl) holding one
run of `--steps` steps on `--ranks` ranks, serves it with `trainvitals collector --replay`,
and times what the dashboard does on each view:
- first load (cold): a whole script run of the dashboard on that view (streamlit AppTest:
  requests, charts, serialisation) from a collector that has not answered its requests
  yet: what a user waits for when opening the view;
- refresh (warm): the next script run, the collector's answers cached;
- API: the requests a view issues (its `load` function), the first time (on a second
  collector, cold) and the median of `--repeats` more; and the bytes of chart data the
  page sends to the browser.
Each is measured over the whole run and over a 300-step window at its end (a post-mortem
zoomed in on a fault).

Every step is in `steps`; per-layer rows are written every `--layer-every` steps and
per-rank rows every `--rank-every` steps, as hooks logging at those intervals would (every
step x 1,024 ranks would be 10^9 rows, beyond this benchmark's disk and patience). The
values are synthetic but shaped like a run: a falling loss, a straggler rank, a rank whose
SDC canary disagrees, alerts and injected-fault events, ranks on hosts of 8 (the Nodes
view), and a second run to compare with (the Compare view). Prints the headline figures
(the slowest view's first load and refresh) on the last line.

    python bench/dashboard_scale.py --steps 1000000 --ranks 1024
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import duckdb

from trainvitals.dashboard import compare, health, layers, nodes, overview, ranks
from trainvitals.dashboard.client import CollectorClient
from trainvitals.dashboard.launch import APP_PATH, free_port, replay_collector_command
from trainvitals.dashboard.layers import DRILL_KEY
from trainvitals.dashboard.nodes import NODE_KEY
from trainvitals.dashboard.state import SLIDER_KEY, VIEW_KEY, WINDOWS_KEY, Window
from trainvitals.demo import wait_healthy
from trainvitals.schema import STORE_TABLES, ddl

RUN_ID = "scale"
OTHER_RUN_ID = "scale-baseline"
RANKS_PER_HOST = 8
STRAGGLER_NODE = (1024 // 3) // RANKS_PER_HOST  # the node of the straggler at 1,024 ranks


class _CompareLoad:
    """The Compare view's requests, as `load` functions do for the other views."""

    @staticmethod
    def load(client: CollectorClient, run, window: Window) -> None:
        for run_id in (RUN_ID, OTHER_RUN_ID):
            client.steps(run_id, max_points=compare.POINTS_PER_RUN)


VIEWS = {
    "Overview": overview,
    "Layers": layers,
    "Ranks": ranks,
    "Nodes": nodes,
    "Health": health,
    "Compare": _CompareLoad,
}
ZOOM_STEPS = 300


def build_store(
    path: Path, steps: int, ranks_n: int, layers_n: int, layer_every: int, rank_every: int
) -> None:
    """Fill `path` with one synthetic run, in SQL (generating rows in Python takes minutes)."""
    straggler, sdc_rank = ranks_n // 3, (2 * ranks_n) // 3
    straggler_from, sdc_from, spike_at = int(steps * 0.4), int(steps * 0.7), int(steps * 0.25)
    canary_every = rank_every * 5
    con = duckdb.connect(str(path))
    for table in STORE_TABLES.values():
        con.execute(ddl(table))
    con.execute("SELECT setseed(0.5)")
    layer_names = [
        "tok_embeddings",
        *(f"layers.{i}" for i in range(layers_n - 3)),
        "norm",
        "output",
    ]
    tokens_per_step = 4 * 1024 * 1024
    con.execute(
        """INSERT INTO runs (run_id, started_unix_s, model, model_config_json, n_params, n_layers,
        layer_names_json, world_size, dp, tp, device_type, device_name, hosts_json,
        flops_per_token, peak_flops_per_s, peak_flops_source, power_source, power_unavailable,
        token_target) VALUES (?, 1.7e9, 'llama-70b', '{}', 70000000000, ?, ?, ?, ?, 8, 'cuda',
        'NVIDIA H100 80GB HBM3', ?, 4.2e11, 9.89e14, 'table:H100', 'nvml', '', ?)""",
        [
            RUN_ID,
            layers_n,
            json.dumps(layer_names),
            ranks_n,
            ranks_n // 8,
            json.dumps([f"node{r // RANKS_PER_HOST:05d}" for r in range(ranks_n)]),
            tokens_per_step * steps * 2,
        ],
    )
    # The run to compare with: steps only, started earlier (the main run is listed first).
    con.execute(
        f"""INSERT INTO runs (run_id, started_unix_s, model, model_config_json, n_params,
        n_layers, layer_names_json, world_size, dp, tp, device_type, device_name, hosts_json,
        flops_per_token, peak_flops_per_s, peak_flops_source)
        VALUES ('{OTHER_RUN_ID}', 1.6e9, 'llama-70b', '{{}}', 70000000000, 0, '[]', {ranks_n},
        {ranks_n // 8}, 8, 'cuda', 'NVIDIA H100 80GB HBM3', '[]', 4.2e11, 9.89e14, 'table:H100')"""
    )
    con.execute(
        f"""INSERT INTO steps (run_id, step, time_unix_s, loss, grad_norm, lr, tokens,
        step_time_s, tokens_per_s, tflops_per_s_per_device, mfu_ratio, power_w, energy_j)
        SELECT '{OTHER_RUN_ID}', i, 1.6e9 + 60 + i * 6.2, 2.1 + 8 / sqrt(i + 10), 0.5, 3e-4,
               {tokens_per_step}, 6.2, {tokens_per_step} / 6.2, 1.0, 0.4, {ranks_n} * 640.0,
               {ranks_n} * 640.0 * 6.2 * (i + 1)
        FROM range({steps}) t(i)"""
    )
    # 6.0 s per step (x1.05 after the straggler appears), a loss spike at spike_at.
    con.execute(
        f"""INSERT INTO steps (run_id, step, time_unix_s, loss, grad_norm, lr, tokens,
        step_time_s, tokens_per_s, tflops_per_s_per_device, mfu_ratio, power_w, energy_j)
        SELECT '{RUN_ID}', i, 1.7e9 + 60 + i * 6.0, 2 + 8 / sqrt(i + 10) + 0.02 * random()
               + CASE WHEN i = {spike_at} THEN 3 ELSE 0 END,
               0.5 + 0.1 * random() + CASE WHEN i = {spike_at} THEN 40 ELSE 0 END,
               3e-4, {tokens_per_step}, st, {tokens_per_step} / st,
               {tokens_per_step} / st * 4.2e11 / {ranks_n} / 1e12,
               {tokens_per_step} / st * 4.2e11 / {ranks_n} / 9.89e14,
               {ranks_n} * (650 + 50 * random()), {ranks_n} * 675.0 * 6.0 * (i + 1)
        FROM (SELECT i, 6.0 * (CASE WHEN i >= {straggler_from} THEN 1.05 ELSE 1 END)
                        * (0.98 + 0.04 * random()) AS st FROM range({steps}) t(i))"""
    )
    con.execute(
        f"""INSERT INTO layers (run_id, step, layer, grad_norm, act_rms, act_max_abs,
        param_norm, update_rms, nonfinite_count)
        SELECT '{RUN_ID}', s, l, (0.05 + 0.02 * random())
                                 * CASE WHEN s = {spike_at} AND l >= {layers_n // 2} THEN 500
                                   ELSE 1 END,
               1 + l * 0.1 + 0.05 * random(), 20 + random(), 100 + l, 1e-4 * (1 + random()), 0
        FROM range(0, {steps}, {layer_every}) a(s), range({layers_n}) b(l)"""
    )
    con.execute(
        f"""INSERT INTO ranks (run_id, step, rank, step_time_s, tokens_per_s, loss,
        grad_norm_local, compute_time_s, data_time_s, wait_time_s, power_w, energy_j,
        sm_clock_mhz, temperature_c, canary_fingerprint)
        SELECT '{RUN_ID}', s, r, 6.0, {tokens_per_step} / {ranks_n} / 6.0, 2.5, 0.5, c, 0.01,
               greatest(0, 5.4 - c), 650 + 50 * random(), 675.0 * 6.0 * (s + 1),
               1980 - 30 * random(), 60 + 5 * random(),
               CASE WHEN s % {canary_every} = 0
                    THEN hash(s) % 4503599627370496
                         + CASE WHEN r = {sdc_rank} AND s >= {sdc_from} THEN 1 ELSE 0 END
               END
        FROM (SELECT s, r, (5.0 + 0.2 * random())
                            * CASE WHEN r = {straggler} AND s >= {straggler_from} THEN 1.08
                              ELSE 1 END AS c
              FROM range(0, {steps}, {rank_every}) a(s), range({ranks_n}) b(r))"""
    )
    alerts = [
        (spike_at, "loss_spike", "warning", None, None, 5.0, 2.1),
        (straggler_from + rank_every, "straggler", "warning", straggler, None, 5.4, 5.1),
        (sdc_from, "sdc", "critical", sdc_rank, None, None, None),
    ]
    for step, kind, severity, rank, layer, value, baseline in alerts:
        con.execute(
            "INSERT INTO alerts (run_id, step, kind, severity, message, value, baseline, rank,"
            " layer, time_unix_s) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, 1.7e9 + ? * 6)",
            [RUN_ID, step, kind, severity, f"synthetic {kind}", value, baseline, rank, layer, step],
        )
    for step, rank, kind in (
        (spike_at, -1, "fault:spike"),
        (straggler_from, straggler, "fault:straggler"),
        (sdc_from, sdc_rank, "fault:sdc"),
    ):
        con.execute(
            "INSERT INTO events (run_id, step, rank, kind, detail, time_unix_s)"
            " VALUES (?, ?, ?, ?, '{}', 1.7e9 + ? * 6)",
            [RUN_ID, step, rank, kind, step],
        )
    con.close()


def warm_up_pages(store: Path, last_step: int) -> None:
    """Every view drawn once from a collector of its own, not timed: what one dashboard
    process pays once, whatever it shows next (imports, each view's first drawing: 0.3 to
    0.5 s more than its next one with the same answers, on 2 cores at load 5), is not
    charged to the first window timed. The timed collectors answer none of these."""
    proc, url = serve(store)
    try:
        for view in VIEWS:
            page_run(url, view, Window(), last_step)
    finally:
        proc.terminate()
        proc.wait(30)


def serve(store: Path) -> tuple[subprocess.Popen, str]:
    """`trainvitals collector --replay` on a free port; returns (process, base URL)."""
    port = free_port()
    proc = subprocess.Popen(replay_collector_command(store, port), stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(f"{url}/healthz", proc, timeout_s=300)  # it loads its state from the store
    return proc, url


def api_ms(client: CollectorClient, view, window: Window, repeats: int) -> tuple[float, float]:
    """Wall time of the view's requests (its `load`) in ms: the first time (the collector
    computes every answer: cold) and the median of `repeats` more (from its cache: warm)."""
    run = next(r for r in client.runs() if r.run_id == RUN_ID)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        view.load(client, run, window)
        times.append((time.perf_counter() - start) * 1e3)
    return times[0], statistics.median(times[1:])


def page_run(url: str, view: str, window: Window, last_step: int) -> tuple[float, float, int]:
    """(ms of the first run, ms of the next, bytes of chart and table data) of dashboard
    script runs showing `view`: the first load of the view (its on-demand parts too) and
    a refresh (warm)."""
    from streamlit.testing.v1 import AppTest

    os.environ["TRAINVITALS_COLLECTOR_URL"] = url
    at = AppTest.from_file(str(APP_PATH), default_timeout=300)
    at.session_state[VIEW_KEY] = view
    # What a user opens on demand, drawn too: two layers followed, the straggler's node.
    at.session_state[DRILL_KEY] = [0, 16]
    at.session_state[NODE_KEY] = f"node{STRAGGLER_NODE:05d}"
    end = last_step if window.end is None else window.end
    at.session_state[WINDOWS_KEY] = {RUN_ID: (window.start, end, window.end is None)}
    start = time.perf_counter()
    at.run()
    cold_ms = (time.perf_counter() - start) * 1e3
    start = time.perf_counter()
    at.run()
    ms = (time.perf_counter() - start) * 1e3
    if at.exception:
        raise RuntimeError(f"{view}: {at.exception[0].value}")
    assert at.session_state[SLIDER_KEY][0] == window.start
    sent = sum(e.proto.ByteSize() for e in [*at.get("vega_lite_chart"), *at.dataframe])
    return cold_ms, ms, sent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1_000_000)
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--layer-every", type=int, default=10)
    parser.add_argument("--rank-every", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--store", type=Path, help="reuse or keep this store (default: temp)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        store = args.store or Path(tmp) / "scale.duckdb"
        if not store.exists():
            start = time.perf_counter()
            build_store(
                store, args.steps, args.ranks, args.layers, args.layer_every, args.rank_every
            )
            print(f"built {store} in {time.perf_counter() - start:.0f} s", flush=True)
        with duckdb.connect(str(store), read_only=True) as con:
            rows = con.execute(
                "SELECT (SELECT count(*) FROM steps), (SELECT count(*) FROM layers), "
                "(SELECT count(*) FROM ranks)"
            ).fetchone()
        print(f"rows: steps {rows[0]:,}  layers {rows[1]:,}  ranks {rows[2]:,}")
        # Two collectors of the same store: pages are timed on one, requests on the other,
        # so that each meets every view's requests cold the first time.
        (api_proc, api_url), (page_proc, page_url) = serve(store), serve(store)
        try:
            warm_up_pages(store, args.steps - 1)
            report(api_url, page_url, args)
        finally:
            for proc in (api_proc, page_proc):
                proc.terminate()
                proc.wait(30)


def report(api_url: str, page_url: str, args: argparse.Namespace) -> None:
    last = args.steps - 1
    windows = {
        "whole run": Window(),
        f"last {ZOOM_STEPS} steps": Window(last - ZOOM_STEPS + 1, last),
    }
    worst_page = worst_cold = worst_api_cold = (0.0, "")
    most_bytes = 0
    # A shared machine's load moves these figures: print it with them.
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} before")
    print(
        f"{'view':<9} {'window':<16} {'API cold':>8} {'API ms':>8} {'1st load':>8} "
        f"{'refresh':>8} {'to browser':>11}"
    )
    with CollectorClient(api_url, timeout_s=300) as client:
        for name, view in VIEWS.items():
            for label, window in windows.items():
                cold, page, sent = page_run(page_url, name, window, last)
                api_cold, api = api_ms(client, view, window, args.repeats)
                print(
                    f"{name:<9} {label:<16} {api_cold:8.0f} {api:8.0f} {cold:8.0f} {page:8.0f} "
                    f"{sent / 1024:8.0f} KB",
                    flush=True,
                )
                worst_page = max(worst_page, (page, f"{name}, {label}"))
                worst_cold = max(worst_cold, (cold, f"{name}, {label}"))
                worst_api_cold = max(worst_api_cold, (api_cold, f"{name}, {label}"))
                most_bytes = max(most_bytes, sent)
    print(f"load average {os.getloadavg()[0]:.1f} after")
    print(
        f"{args.steps:,} steps x {args.ranks:,} ranks: slowest view cold (first load) "
        f"{worst_cold[0]:.0f} ms ({worst_cold[1]}), warm (refresh) {worst_page[0]:.0f} ms "
        f"({worst_page[1]}); a view's first requests at most {worst_api_cold[0]:.0f} ms "
        f"({worst_api_cold[1]}); at most {most_bytes / 1024:.0f} KB of chart data per view"
    )


if __name__ == "__main__":
    main()
