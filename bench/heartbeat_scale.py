"""The collector's CPU for the heartbeats of 100,000 ranks every 5 s.

Starts `trainvitals collector` on 127.0.0.1 (a subprocess with a fresh store: validation,
the DuckDB write and the liveness watchdog all run as in production) and POSTs to
/api/v1/heartbeats one interval's worth of heartbeats, as fast as it takes them, in three
shapes:
- `--per-node` ranks per request, as a node's leader would batch its ranks (8 GPUs), for
  `--node-sample` ranks, scaled to all of them (the full 12,500 requests per interval take
  many minutes on a small shared machine; the cost per request is what is measured);
- one request per rank, as every rank sending its own does (`--sample` ranks, scaled);
- `--per-proxy` ranks per request, as a proxy tier (an OpenTelemetry Collector, say) would.
Each shape sends a warm-up interval first (a rank's first heartbeat costs more: the
watchdog learns it), then the measured one. The collector's CPU time (user + system, all
threads, /proc/PID/stat) over the measured interval, scaled to `--ranks`, is the figure:
CPU seconds per `--interval-s`, and the fraction of one core that is. The sender runs in
this process on the same machine; its CPU is not counted.

    python bench/heartbeat_scale.py | tee bench/results/heartbeat_scale.txt

`--baseline REV` instead compares this tree's collector with the collector of git revision
REV, side by side: both run at once, and rounds of one-rank heartbeats (the shape where
the cost per request is all there is) alternate between them, in turn first. The figure is
the ratio of their CPU per request, which the machine's load moves far less than either.

    python bench/heartbeat_scale.py --baseline e472487~1 | tee bench/results/middleware.txt
"""

from __future__ import annotations

import argparse
import os
import queue
import tempfile
import threading
import time
from pathlib import Path

import httpx
import orjson
from ingest import Collector
from revision import checkout, revision_argv

from trainvitals.schema import SCHEMA_VERSION


def bodies(run_id: str, ranks: range, per_request: int, t: float) -> list[bytes]:
    """JSON heartbeat batches of `per_request` consecutive ranks each."""
    out = []
    for first in range(ranks.start, ranks.stop, per_request):
        group = list(range(first, min(first + per_request, ranks.stop)))
        n = len(group)
        cols = {
            "rank": group,
            "time_unix_s": [t] * n,
            "host": [f"node{r // 8}" for r in group],
            "step_started": [100] * n,
            "step_finished": [99] * n,
            "phase": ["forward"] * n,
        }
        doc = {"schema_version": SCHEMA_VERSION, "run_id": run_id, "heartbeats": cols}
        out.append(orjson.dumps(doc))
    return out


def post_all(url: str, batches: list[bytes], connections: int) -> float:
    """POST every batch on `connections` connections; seconds it took. Fails on a non-202."""
    work: queue.Queue = queue.Queue()
    for b in batches:
        work.put(b)
    errors: list[str] = []

    def worker() -> None:
        headers = {"content-type": "application/json"}
        with httpx.Client(timeout=60, headers=headers) as client:
            while True:
                try:
                    body = work.get_nowait()
                except queue.Empty:
                    return
                r = client.post(f"{url}/api/v1/heartbeats", content=body)
                if r.status_code != 202:
                    errors.append(f"{r.status_code}: {r.text}")

    start = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(connections)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise SystemExit(f"collector refused heartbeats: {errors[0]}")
    return time.perf_counter() - start


def shape(collector: Collector, label: str, ranks: int, per_request: int, args) -> float:
    """Collector CPU seconds per interval for `ranks` ranks (scaled to args.ranks)."""
    run_id = f"hb-{per_request}"
    warm = bodies(run_id, range(ranks), per_request, time.time())
    post_all(collector.url, warm, args.connections)
    measured = bodies(run_id, range(ranks), per_request, time.time() + 1)
    cpu0 = collector.cpu_s()
    wall_s = post_all(collector.url, measured, args.connections)
    cpu_s = collector.cpu_s() - cpu0
    per_interval_s = cpu_s * args.ranks / ranks
    print(
        f"{label}: {len(measured):,} requests of {per_request} ranks ({ranks:,} ranks) in "
        f"{wall_s:.1f} s; collector CPU {cpu_s:.2f} s, {cpu_s / len(measured) * 1e3:.2f} ms per "
        f"request -> {per_interval_s:.2f} s per {args.interval_s:g} s interval for "
        f"{args.ranks:,} ranks = {per_interval_s / args.interval_s:.2f} of one core",
        flush=True,
    )
    return per_interval_s


def side_by_side(args) -> None:
    """CPU per one-rank heartbeat request: this tree's collector against REV's."""
    with tempfile.TemporaryDirectory() as tmp:
        root = checkout(args.baseline, Path(tmp) / "baseline")
        collectors = {
            "this tree": Collector(Path(tmp) / "new.duckdb"),
            args.baseline: Collector(Path(tmp) / "old.duckdb", launcher=revision_argv(root)),
        }
        ranks = range(min(args.sample, args.ranks))
        cpu_s = dict.fromkeys(collectors, 0.0)
        requests = 0
        try:
            for c in collectors.values():  # a rank's first heartbeat costs more (above)
                post_all(c.url, bodies("hb", ranks, 1, time.time()), args.connections)
            for i in range(args.rounds):
                batch = bodies("hb", ranks, 1, time.time())
                order = list(collectors.items())
                for label, c in order if i % 2 == 0 else order[::-1]:
                    cpu0 = c.cpu_s()
                    post_all(c.url, batch, args.connections)
                    cpu_s[label] += c.cpu_s() - cpu0
                requests += len(batch)
        finally:
            for c in collectors.values():
                c.stop()
    ms = {label: s * 1e3 / requests for label, s in cpu_s.items()}
    new, old = ms.values()
    print(
        f"collector CPU per one-rank heartbeat request, {requests:,} requests each in "
        f"{args.rounds} alternating rounds: {new:.3f} ms (this tree) against {old:.3f} ms "
        f"({args.baseline}); ratio {new / old:.3f} (load average {os.getloadavg()[0]:.1f})"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=100_000)
    p.add_argument("--interval-s", type=float, default=5.0)
    p.add_argument("--per-node", type=int, default=8)
    p.add_argument("--per-proxy", type=int, default=1000)
    p.add_argument("--sample", type=int, default=2000, help="ranks sent one request each")
    p.add_argument("--node-sample", type=int, default=20_000, help="ranks sent per node")
    p.add_argument("--connections", type=int, default=4)
    p.add_argument("--baseline", metavar="REV", help="compare with git revision REV (above)")
    p.add_argument("--rounds", type=int, default=10, help="rounds per collector (--baseline)")
    args = p.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", flush=True)
    if args.baseline:
        side_by_side(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        collector = Collector(Path(tmp) / "hb.duckdb")
        try:
            node_ranks = min(args.node_sample, args.ranks)
            node = shape(collector, "per node", node_ranks, args.per_node, args)
            single = shape(collector, "per rank", min(args.sample, args.ranks), 1, args)
            proxy = shape(collector, "per proxy", args.ranks, args.per_proxy, args)
        finally:
            collector.stop()
    core = args.interval_s
    print(
        f"heartbeats of {args.ranks:,} ranks every {args.interval_s:g} s: collector CPU "
        f"{node:.1f} s per interval ({node / core:.2f} cores) with {args.per_node} ranks per "
        f"request, {single:.1f} s ({single / core:.2f} cores) with one request per rank, "
        f"{proxy:.2f} s ({proxy / core:.2f} cores) with {args.per_proxy} per request"
    )


if __name__ == "__main__":
    main()
