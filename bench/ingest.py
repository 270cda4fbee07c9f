"""How much telemetry one collector ingests on this machine, the fleet simulator sending it.

Starts `trainvitals collector` on 127.0.0.1 (a subprocess with a fresh store), sends it a
simulated `--ranks`-rank, `--layers`-layer run for `--seconds` from this process
(trainvitals.sender: binary msgpack batches on `--connections` connections), and prints:
- sustained points/s: a point is one numeric value of one row (steps, layers and ranks);
- ingest request latency, p50 and p99, as the sender sees it (POST to 202, i.e. committed);
- /metrics scrape time during the run (one scrape every `--scrape-every` s);
- how long the live analyzer needed to catch up after the last batch;
- rows stored against rows sent, per table: the collector is stopped and its store is
  opened read-only and counted;
then, with a `--wide-ranks`-rank run in the same collector, the /metrics scrape time; and the
full-range steps query of a 1,000,000-step run (the store bench/dashboard_scale.py builds).
The simulator and the collector share this machine's cores; the load average is printed
with the figures. Prints the headline figure last.

    python bench/ingest.py | tee bench/results/ingest.txt
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import duckdb
import httpx
from dashboard_scale import RUN_ID as QUERY_RUN
from dashboard_scale import build_store
from prometheus_client.parser import text_string_to_metric_families

from trainvitals.collector.memory import DEFAULT_MEMORY_LIMIT
from trainvitals.dashboard.launch import free_port
from trainvitals.demo import wait_healthy
from trainvitals.sender import send
from trainvitals.simulate import FleetSpec, simulate

TABLES = ("steps", "layers", "ranks", "events")


class Collector:
    """`trainvitals collector` on a free port, in a subprocess."""

    def __init__(self, store: Path, *extra: str, launcher: list[str] | None = None) -> None:
        """launcher: argv that runs `trainvitals` (bench/revision.py: another revision's)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        launcher = launcher or [sys.executable, "-m", "trainvitals"]
        argv = [*launcher, "collector", "--store", str(store)]
        self.proc = subprocess.Popen([*argv, "--port", str(self.port), *extra])
        wait_healthy(f"{self.url}/healthz", self.proc, timeout_s=600)

    def cpu_s(self) -> float:
        """CPU seconds the collector process has used (user + system, all threads)."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def rss_mb(self, which: str = "VmRSS") -> float:
        """Resident memory now (VmRSS) or at its peak so far (VmHWM), in MB."""
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(status.split(f"{which}:")[1].split()[0]) / 1024

    def stop(self) -> None:
        self.proc.terminate()  # uvicorn shuts down cleanly: the store is flushed and closed
        self.proc.wait(120)


def own_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def scrape_ms(url: str) -> tuple[float, str]:
    start = time.perf_counter()
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return (time.perf_counter() - start) * 1e3, text


def metric(text: str, name: str) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise KeyError(name)


def percentile(values: list[float], q: float) -> float:
    """The q-quantile as the value at rank floor(q n) of the sorted values."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def ms(values: list[float]) -> str:
    return f"p50 {statistics.median(values):.0f} ms, max {max(values):.0f} ms"


def phase(label: str, collector: Collector, spec: FleetSpec, args, rate: float | None) -> dict:
    """Send `spec` for `args.seconds` (as fast as taken, or paced at `rate` points/s)."""
    scrapes: list[float] = []
    stop = threading.Event()

    def scraper() -> None:
        while not stop.wait(args.scrape_every):
            scrapes.append(scrape_ms(collector.url)[0])

    threading.Thread(target=scraper, daemon=True).start()
    cpu0, own0, write0 = collector.cpu_s(), own_cpu_s(), write_stats(collector.url)
    try:
        report = send(
            simulate(spec),
            collector.url,
            connections=args.connections,
            batch_points=args.batch_points,
            duration_s=args.seconds,
            rate=rate,
        )
    finally:
        stop.set()
    collector_cpu, own_cpu = collector.cpu_s() - cpu0, own_cpu_s() - own0
    seconds, batches, commits = (
        b - a for a, b in zip(write0, write_stats(collector.url), strict=True)
    )
    caught_up = time.perf_counter()
    while metric(scrape_ms(collector.url)[1], "trainvitals_collector_analysis_lag_seconds"):
        time.sleep(0.1)
    caught_up = time.perf_counter() - caught_up
    lat = [x * 1e3 for x in report.latencies_s]
    figures = {
        "rate": report.points / report.elapsed_s,
        "p50": percentile(lat, 0.5),
        "p99": percentile(lat, 0.99),
        "elapsed": report.elapsed_s,
        "report": report,
        "peak_mb": collector.rss_mb("VmHWM"),
    }
    print(f"\n{label}")
    print(f"  sent {report.summary()}")
    print(f"  sustained: {figures['rate']:,.0f} points/s over {report.elapsed_s:.1f} s")
    print(f"  ingest request latency: p50 {figures['p50']:.0f} ms, p99 {figures['p99']:.0f} ms, "
          f"max {max(lat):.0f} ms")  # fmt: skip
    print(f"  CPU: collector {collector_cpu / report.elapsed_s:.2f} cores, simulator and sender "
          f"{own_cpu / report.elapsed_s:.2f} cores; the writer was busy {seconds:.1f} s, "
          f"committing {batches:.0f} batches in {commits:.0f} transactions; collector "
          f"memory {collector.rss_mb():,.0f} MB, peak {figures['peak_mb']:,.0f} MB")  # fmt: skip
    print(f"  /metrics scrape during ingest: {ms(scrapes)} ({len(scrapes)} scrapes)")
    print(f"  live analysis caught up {caught_up:.1f} s after the last batch was acknowledged")
    return figures


def write_stats(url: str) -> tuple[float, float, float]:
    text = scrape_ms(url)[1]
    return (
        metric(text, "trainvitals_collector_write_seconds_total"),
        metric(text, "trainvitals_collector_written_batches_total"),
        metric(text, "trainvitals_collector_commits_total"),
    )


def ingest(args: argparse.Namespace, store: Path) -> dict:
    """Saturation, then the target rate, then a wide run; returns the headline's figures."""
    runs = {
        name: FleetSpec(ranks, args.layers, step_time_s=1.0, steps=steps, run_id=name)
        for name, ranks, steps in (
            ("saturation", args.ranks, 10**8),
            ("target", args.ranks, 10**8),
            ("wide", args.wide_ranks, 20),
        )
    }
    print(f"{args.ranks:,} ranks x {args.layers} layers, {args.connections} connections, about "
          f"{args.batch_points:,} points per request")  # fmt: skip
    collector = Collector(store, "--memory-limit", args.memory_limit)
    try:
        saturation = phase(
            "as fast as the collector takes it:", collector, runs["saturation"], args, None
        )
        target = phase(
            f"paced at {args.rate:,.0f} points/s:", collector, runs["target"], args, args.rate
        )
        wide_report = send(simulate(runs["wide"]), collector.url, batch_points=10**6)
        assert not wide_report.rejected, wide_report.rejected[:3]
        wide_scrapes = []
        for _ in range(10):
            took, text = scrape_ms(collector.url)
            wide_scrapes.append(took)
        assert 'run_id="wide"' in text
        print(f"\n/metrics scrape with a {args.wide_ranks:,}-rank run: {ms(wide_scrapes)}")
    finally:
        collector.stop()

    sent = {
        "saturation": saturation["report"].rows_sent,
        "target": target["report"].rows_sent,
        "wide": wide_report.rows_sent,
    }
    print("rows sent and stored (the stopped collector's store, read-only):")
    equal = True
    with duckdb.connect(str(store), read_only=True) as con:
        for run, rows in sent.items():
            for table in TABLES:
                (stored,) = con.execute(
                    f"SELECT count(*) FROM {table} WHERE run_id = ?", [run]
                ).fetchone()
                equal &= stored == rows[table]
                print(f"  {run:<10} {table:<6} sent {rows[table]:>10,}  stored {stored:>10,}")
    print(f"rows stored = rows sent: {equal}")
    points = saturation["report"].points + target["report"].points + wide_report.points
    size = sum(f.stat().st_size for f in store.parent.glob(store.name + "*") if f.is_file())
    print(f"store: {size / 1e9:.2f} GB on disk for {points:,} points, {size / points:.1f} "
          "bytes per point")  # fmt: skip
    return {
        "saturation": saturation,
        "target": target,
        "equal": equal,
        "wide_scrape": statistics.median(wide_scrapes),
    }


def step_query(args: argparse.Namespace, tmp: Path) -> float:
    store = args.query_store or tmp / "query.duckdb"
    if not store.exists():
        start = time.perf_counter()
        build_store(store, 1_000_000, args.query_ranks, args.layers, 10, 100)
        print(f"built a 1,000,000-step store in {time.perf_counter() - start:.0f} s")
    collector = Collector(store, "--memory-limit", args.memory_limit)
    try:
        url = f"{collector.url}/api/v1/runs/{QUERY_RUN}/steps"
        httpx.get(url, timeout=60).raise_for_status()  # warm: first read of the file
        times = []
        for _ in range(10):
            start = time.perf_counter()
            body = httpx.get(url, timeout=60).json()
            times.append((time.perf_counter() - start) * 1e3)
    finally:
        collector.stop()
    assert body["columns"]["step"][-1] >= 999_000, "the query did not cover the whole run"
    print(f"full-range steps query of 1,000,000 steps ({len(body['columns']['step'])} buckets "
          f"of {body['bucket_steps']} steps): {ms(times)}")  # fmt: skip
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=60.0, help="of each phase")
    parser.add_argument("--rate", type=float, default=1e6, help="paced phase, points/s")
    parser.add_argument("--connections", type=int, default=4)
    parser.add_argument("--batch-points", type=int, default=250_000)
    parser.add_argument("--scrape-every", type=float, default=2.0)
    parser.add_argument("--wide-ranks", type=int, default=16_384)
    parser.add_argument("--query-ranks", type=int, default=1024, help="ranks of the query store")
    parser.add_argument("--query-store", type=Path, help="reuse or keep the 1M-step store")
    parser.add_argument("--skip-query", action="store_true")
    parser.add_argument("--memory-limit", default=DEFAULT_MEMORY_LIMIT, help="the collectors'")
    args = parser.parse_args()

    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} before", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        figures = ingest(args, Path(tmp) / "ingest.duckdb")
        query = None if args.skip_query else step_query(args, Path(tmp))
    print(f"load average {os.getloadavg()[0]:.1f} after")
    sat, target = figures["saturation"], figures["target"]
    query_text = "" if query is None else f"; full-range steps query of 1M steps {query:.0f} ms"
    print(
        f"one collector, 2 cores shared with the simulator, {args.ranks:,} ranks x "
        f"{args.layers} layers: {sat['rate']:,.0f} points/s sustained for {sat['elapsed']:.0f} s; "
        f"at {target['rate']:,.0f} points/s request p99 {target['p99']:.0f} ms; rows stored "
        f"{'=' if figures['equal'] else '!='} sent; /metrics at {args.wide_ranks:,} ranks "
        f"{figures['wide_scrape']:.0f} ms{query_text}; collector memory peak "
        f"{target['peak_mb']:,.0f} MB under --memory-limit {args.memory_limit}"
    )


if __name__ == "__main__":
    main()
