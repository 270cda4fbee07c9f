"""What a crafted request costs the collector, against a valid batch of the same size.

Starts `trainvitals collector` on 127.0.0.1 (a subprocess, fresh store) and sends it, family
by family, requests of about `--mb` MB each built to be expensive:
- otlp-rejected: OTLP protobuf of steps rows that each lack required fields (every row
  is rejected, each with its own example);
- gzip-members: a gzip body of empty members with the valid batch in the last one;
- json-deep: a column nested thousands of lists deep;
- json-wide: a table of a hundred thousand unknown fields;
- otlp-many-runs: OTLP protobuf of complete steps rows of 1,500 runs or more;
- huge-string: a runs row whose model name fills the body;
- heartbeats-huge: a heartbeat batch of the whole size (decoded where heartbeats are).
For each it prints the collector's CPU seconds (user + system, all threads, its decoding
process included, from /proc) per MB of request body, and that figure against a valid
batch's of the same endpoint and encoding (a native JSON batch for native ingest and
heartbeats, an OTLP protobuf request of complete rows for OTLP), with the answers' status
codes and the collector's peak RSS (its processes' peaks added up). A request counts until
the write queue is empty, the live analysis has caught up and the collector is at rest
again (its CPU under a fifth of a core): the detectors' work on what it stored is its cost
too, not the next family's. A second table gives the figures up to the commit (the queue
empty), the analysis left out, as the bench measured before. Each request's runs are new
ones (a resend costs next to nothing). Before the families, one valid request of each
kind is sent, not measured: the first large body starts the decoding process
(collector/decoding.py).
All the while a process of its own asks /healthz every 20 ms (a thread of the bench was
delayed by the bench's own work); the slowest answer per family is printed. Targets
(issue 18): no family above 3x, /healthz within 100 ms throughout. `--burn N` adds N
processes spinning on a core each, for the figures under load from outside. The headline
is the last line.

    python bench/adversarial.py --memory | tee bench/results/adversarial.txt
    python bench/adversarial.py --short   # the CI form (tests/collector/test_adversarial_bench.py)
    python bench/adversarial.py --families otlp-many-runs --burn 2
    python bench/adversarial.py --families otlp-many-runs --baseline REV   # REV's, then ours
"""

from __future__ import annotations

import argparse
import gzip
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path

import httpx
import orjson
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from revision import checkout, revision_argv

from trainvitals.dashboard.launch import free_port
from trainvitals.demo import wait_healthy
from trainvitals.schema import SCHEMA_VERSION

JSON = {"content-type": "application/json"}
PROTOBUF = {"content-type": "application/x-protobuf"}
_LAG = "trainvitals_collector_analysis_lag_seconds"
IDLE_S = 5.0  # /healthz is asked of the idle collector this long first
# A collector at rest (the /healthz probe every 20 ms, its threads' ticks) uses about
# 0.05 of a core; at work, one core or more.
QUIET_CORES = 0.2
STEP_FIELDS = ("time_unix_s", "loss", "grad_norm", "step_time_s", "tokens_per_s",
               "tflops_per_s_per_device", "mfu_ratio", "tokens")  # fmt: skip


class Collector:
    """`trainvitals collector` on a free port, in a subprocess."""

    def __init__(self, store: Path, env: dict[str, str], launcher: list[str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        launcher = launcher or [sys.executable, "-m", "trainvitals"]  # revision.py: another's
        argv = [*launcher, "collector", "--store", str(store)]
        self.proc = subprocess.Popen(
            [*argv, "--port", str(self.port)], env={**os.environ, **env}, stdout=subprocess.DEVNULL
        )
        wait_healthy(f"{self.url}/healthz", self.proc, timeout_s=600)

    def _tree(self) -> list[int]:
        """The collector's pid and its children's (decode workers, collector/decoding.py)."""
        pids = [self.proc.pid]
        for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
            pids += [int(p) for p in (task / "children").read_text().split()]
        return pids

    def cpu_s(self) -> float:
        """CPU seconds the collector has used (user + system, all threads), its children's
        included: those running and those it has waited for."""
        total = 0
        for i, pid in enumerate(self._tree()):
            with suppress(FileNotFoundError):
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                total += sum(int(f) for f in fields[11 : 15 if i == 0 else 13])
        return total / os.sysconf("SC_CLK_TCK")

    def wait_quiet(self, interval_s: float = 0.25, timeout_s: float = 120.0) -> None:
        """Until the collector uses under QUIET_CORES of CPU over `interval_s`: the analysis
        lag reads 0 once the analysis has taken every due step, while it may still work on
        them for seconds (3,000 new runs), which the next family would be charged with."""
        deadline = time.monotonic() + timeout_s
        before = self.cpu_s()
        while time.monotonic() < deadline:
            time.sleep(interval_s)
            now = self.cpu_s()
            if now - before < QUIET_CORES * interval_s:
                return
            before = now

    def peak_rss_mb(self) -> float:
        """Peak resident memory of the collector and its children, added up, in MB."""
        total = 0
        for pid in self._tree():
            with suppress(FileNotFoundError):
                status = Path(f"/proc/{pid}/status").read_text()
                total += int(status.split("VmHWM:")[1].split()[0])
        return total / 1024

    def analysis_lag_s(self) -> float:
        """From /metrics (its scrapes, a few ms each, are counted with the request)."""
        text = httpx.get(f"{self.url}/metrics", timeout=600).text
        line = next(x for x in text.splitlines() if x.startswith(_LAG))
        return float(line.split()[-1])

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(120)


# Asks URL/healthz every 20 ms; prints each answer's start (time.time()), seconds, status.
_PROBE = """
import sys, time, httpx
with httpx.Client(timeout=600) as client:
    while True:
        start, t0 = time.time(), time.perf_counter()
        try:
            ok = client.get(sys.argv[1] + "/healthz").status_code == 200
        except httpx.HTTPError:
            ok = False
        print(start, time.perf_counter() - t0, int(ok), flush=True)
        time.sleep(0.02)
"""


class HealthProbe:
    """Asks /healthz every 20 ms from a process of its own (in a thread of this one, the
    bench's own work building bodies delayed it too); keeps the slowest answer per family,
    in seconds, by when the request was sent."""

    def __init__(self, url: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _PROBE, url], stdout=subprocess.PIPE, text=True
        )
        self.failures = 0
        self.windows: list[tuple[str, float]] = []  # (family, when it began)
        self.worst_s: dict[str, float] = {}
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def begin(self, family: str) -> None:
        self.windows.append((family, time.time()))

    def _read(self) -> None:
        for line in self.proc.stdout:
            start, took, ok = line.split()
            family = next((f for f, t in reversed(self.windows) if t <= float(start)), None)
            if family is None:
                continue
            self.failures += ok == "0"
            self.worst_s[family] = max(self.worst_s.get(family, 0.0), float(took))

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)
        self._reader.join(60)


def burn(processes: int) -> list[subprocess.Popen]:
    """`processes` processes that spin on a core each: load from outside the collector."""
    spin = [sys.executable, "-c", "while True: pass"]
    return [subprocess.Popen(spin) for _ in range(processes)]


# ------------------------------------------------------------------ request bodies
# Each builder takes a size in bytes and returns (path, headers, body) of about that size.


def _steps_doc(run_id: str, n: int, start: int = 0) -> dict:
    cols = {f: [1.0] * n for f in STEP_FIELDS}
    cols["tokens"] = [512] * n
    cols["step"] = list(range(start, start + n))
    return {"schema_version": SCHEMA_VERSION, "run_id": run_id, "steps": cols}


def _rows_for(size: int, row_bytes: int) -> int:
    return max(1, size // row_bytes)


def valid_json(size: int, seq: int) -> tuple:
    n = _rows_for(size, len(orjson.dumps(_steps_doc("x", 1000))) // 1000)
    return "/api/v1/ingest", JSON, orjson.dumps(_steps_doc(f"valid-{seq}", n))


def _otlp(n_rows: int, n_runs: int, fields: tuple[str, ...], seq: int, runs: str = "r") -> bytes:
    request = ExportMetricsServiceRequest()
    scope = request.resource_metrics.add().scope_metrics.add()
    for f in fields:
        points = scope.metrics.add(name=f"trainvitals.steps.{f}").gauge.data_points
        for i in range(n_rows):
            point = points.add(as_double=1.0)
            point.attributes.add(key="run_id").value.string_value = f"{runs}{seq}-{i % n_runs}"
            point.attributes.add(key="step").value.int_value = i // n_runs
    return request.SerializeToString()


def _otlp_rows_for(size: int, n_fields: int) -> int:
    return _rows_for(size, len(_otlp(100, 1, STEP_FIELDS[:n_fields], 0)) // 100)


def valid_otlp(size: int, seq: int) -> tuple:
    n = _otlp_rows_for(size, len(STEP_FIELDS))
    return "/v1/metrics", PROTOBUF, _otlp(n, 1, STEP_FIELDS, seq)


def otlp_rejected(size: int, seq: int) -> tuple:
    return "/v1/metrics", PROTOBUF, _otlp(_otlp_rows_for(size, 1), 1, ("loss",), seq)


def otlp_many_runs(size: int, seq: int) -> tuple:
    n = _otlp_rows_for(size, len(STEP_FIELDS))
    return "/v1/metrics", PROTOBUF, _otlp(n, max(1500, n // 4), STEP_FIELDS, seq, runs="m")


def gzip_members(size: int, seq: int) -> tuple:
    member = gzip.compress(b"")
    valid = gzip.compress(orjson.dumps(_steps_doc(f"gz-{seq}", 10)))
    body = member * (size // len(member)) + valid
    return "/api/v1/ingest", {**JSON, "content-encoding": "gzip"}, body


def json_deep(size: int, seq: int) -> tuple:
    depth = size // 2
    column = "[" * depth + "]" * depth
    body = f'{{"schema_version":1,"run_id":"deep-{seq}","steps":{{"loss":{column}}}}}'
    return "/api/v1/ingest", JSON, body.encode()


def json_wide(size: int, seq: int) -> tuple:
    n = size // 12
    columns = b",".join(b'"f%07d":[1]' % i for i in range(n))
    body = b'{"schema_version":1,"run_id":"wide-%d","steps":{%s}}' % (seq, columns)
    return "/api/v1/ingest", JSON, body


def huge_string(size: int, seq: int) -> tuple:
    row = {"started_unix_s": 1000.0, "model": "m" * size, "model_config_json": "{}",
           "n_params": 10, "n_layers": 1, "layer_names_json": '["block.0"]', "world_size": 1,
           "dp": 1, "tp": 1, "device_type": "cpu", "device_name": "cpu", "hosts_json": '["h0"]',
           "flops_per_token": 60.0, "peak_flops_per_s": 1e12,
           "peak_flops_source": "measured"}  # fmt: skip
    doc = {"schema_version": SCHEMA_VERSION, "run_id": f"str-{seq}",
           "runs": {k: [v] for k, v in row.items()}}  # fmt: skip
    return "/api/v1/ingest", JSON, orjson.dumps(doc)


def heartbeats_huge(size: int, seq: int) -> tuple:
    n = max(1, size // 60)
    cols = {"rank": list(range(n)), "time_unix_s": [1.0] * n, "host": ["h"] * n,
            "step_started": [1] * n, "step_finished": [1] * n,
            "phase": ["forward"] * n}  # fmt: skip
    doc = {"schema_version": SCHEMA_VERSION, "run_id": f"hb-{seq}", "heartbeats": cols}
    return "/api/v1/heartbeats", JSON, orjson.dumps(doc)


# family -> (builder, baseline family)
FAMILIES: dict[str, tuple[Callable, str]] = {
    "valid-json": (valid_json, "valid-json"),
    "valid-otlp": (valid_otlp, "valid-otlp"),
    "otlp-rejected": (otlp_rejected, "valid-otlp"),
    "gzip-members": (gzip_members, "valid-json"),
    "json-deep": (json_deep, "valid-json"),
    "json-wide": (json_wide, "valid-json"),
    "otlp-many-runs": (otlp_many_runs, "valid-otlp"),
    "huge-string": (huge_string, "valid-json"),
    "heartbeats-huge": (heartbeats_huge, "valid-json"),
}


def measure(
    c: Collector, build: Callable, size: int, repeats: int, first_seq: int = 0
) -> tuple[float, float, set[int]]:
    """(collector CPU seconds per MB of body, the same up to the commit, the status codes
    answered). Each request's rows are new (`seq` numbers its runs): a resend would cost
    the store next to nothing."""
    statuses, cpu_s, commit_s, mb = set(), 0.0, 0.0, 0.0
    with httpx.Client(timeout=600) as client:
        for seq in range(first_seq, first_seq + repeats):
            path, headers, body = build(size, seq)
            before = c.cpu_s()
            r = client.post(f"{c.url}{path}", content=body, headers=headers)
            # The writer and the analyzer finish behind the answer: wait for an idle queue,
            # then for the analysis of what was committed, which waits 1 s for the rest of
            # each step (analyzer/live.py): up to then, the cost up to the commit.
            while client.get(f"{c.url}/healthz").json()["queue_depth_batches"]:
                time.sleep(0.01)
            commit_s += c.cpu_s() - before
            time.sleep(1.1)
            while c.analysis_lag_s() > 0:
                time.sleep(0.5)
            c.wait_quiet()
            cpu_s += c.cpu_s() - before
            mb += len(body) / 1e6
            statuses.add(r.status_code)
    return cpu_s / mb, commit_s / mb, statuses


def memory_check(size_mb: float, senders: int) -> None:
    """Peak RSS of a collector sent `senders` concurrent JSON bodies of `size_mb` MB, each
    refused with 422 (a negative step), with the default decode budget and without one."""
    n = int(size_mb * 1e6 / 36)  # about 36 bytes a row
    doc = _steps_doc("mem", n)
    doc["steps"]["step"] = [-1] * n
    body = orjson.dumps(doc)
    for label, budget in (("default budget", None), ("no budget", str(2**40))):
        env = {"TRAINVITALS_MAX_BODY_BYTES": str(len(body))}
        if budget:
            env["TRAINVITALS_MAX_DECODING_BYTES"] = budget
        else:  # the default, 64 MiB, unless one body is larger
            env["TRAINVITALS_MAX_DECODING_BYTES"] = str(max(len(body), 64 * 2**20))
        with tempfile.TemporaryDirectory() as tmp:
            c = Collector(Path(tmp) / "store.duckdb", env)
            codes: list[int] = []

            def send(c: Collector = c, codes: list[int] = codes) -> None:
                r = httpx.post(f"{c.url}/api/v1/ingest", content=body, headers=JSON, timeout=600)
                codes.append(r.status_code)

            threads = [threading.Thread(target=send) for _ in range(senders)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            peak = c.peak_rss_mb()
            c.stop()
        answered = ", ".join(f"{codes.count(k)}x {k}" for k in sorted(set(codes)))
        print(f"{senders} concurrent {len(body) / 1e6:.0f} MB bodies, {label}: "
              f"collector peak RSS {peak:.0f} MB ({answered})")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=float, default=8.0, help="size of each request (default 8 MB)")
    p.add_argument("--repeats", type=int, default=3, help="requests per family (default 3)")
    p.add_argument("--short", action="store_true", help="CI form: 0.5 MB, 2 requests each")
    p.add_argument(
        "--memory", action="store_true",
        help="first, peak RSS under 8 concurrent 28 MB bodies, with and without the budget",
    )  # fmt: skip
    p.add_argument(
        "--families", help="comma-separated families to send (their baselines are added)"
    )
    p.add_argument(
        "--burn", type=int, default=0, metavar="N",
        help="N processes spinning on a core each, all the while: load from outside",
    )  # fmt: skip
    p.add_argument(
        "--baseline", metavar="REV",
        help="first the same against the collector of git revision REV (bench/revision.py)",
    )  # fmt: skip
    args = p.parse_args()
    families = FAMILIES
    if args.families:
        chosen = set(args.families.split(","))
        unknown = chosen - FAMILIES.keys()
        if unknown:
            p.error(f"unknown families {sorted(unknown)}; known: {list(FAMILIES)}")
        chosen |= {FAMILIES[f][1] for f in chosen}
        families = {f: v for f, v in FAMILIES.items() if f in chosen}
    burners = burn(args.burn)
    try:
        if args.baseline:
            with tempfile.TemporaryDirectory() as tmp:
                root = checkout(args.baseline, Path(tmp) / "baseline")
                print(f"the collector of {args.baseline}:")
                run(args, families, revision_argv(root))
            print("this tree's collector:")
        run(args, families)
    finally:
        for b in burners:
            b.kill()


def run(
    args: argparse.Namespace,
    families: dict[str, tuple[Callable, str]],
    launcher: list[str] | None = None,
) -> None:
    load_before = os.getloadavg()[0]
    if args.memory:
        memory_check(28.0, 8)
    size_mb, repeats = (0.5, 2) if args.short else (args.mb, args.repeats)
    size = int(size_mb * 1e6)
    env = {"TRAINVITALS_MAX_BODY_BYTES": str(4 * size + 2**20)}
    env["TRAINVITALS_MAX_DECODING_BYTES"] = env["TRAINVITALS_MAX_BODY_BYTES"]
    if args.short:  # its bodies are under the default 512 KiB: decode them where large ones go
        env["TRAINVITALS_DECODE_IN_PROCESS_BYTES"] = str(64 * 1024)
    with tempfile.TemporaryDirectory() as tmp:
        c = Collector(Path(tmp) / "store.duckdb", env, launcher)
        probe = HealthProbe(c.url)
        try:
            # Not measured: the first large bodies start the decoding process.
            measure(c, valid_json, size, 1, first_seq=repeats)
            measure(c, valid_otlp, size, 1, first_seq=repeats)
            probe.begin("(idle)")  # what the machine alone makes of /healthz
            time.sleep(IDLE_S)
            results = {}
            for name, (build, _) in families.items():
                probe.begin(name)
                results[name] = measure(c, build, size, repeats)
            probe.begin("")  # the stop
        finally:
            probe.stop()
            peak_mb = c.peak_rss_mb()
            c.stop()
    burning = f", {args.burn} spinning processes beside it" if args.burn else ""
    print(f"requests of {size_mb:g} MB, {repeats} per family; load average "
          f"{load_before:.2f} before, {os.getloadavg()[0]:.2f} after, on {os.cpu_count()} "
          f"cores{burning}")  # fmt: skip
    print(f"{'family':<16} {'status':<10} {'CPU s/MB':>9} {'x valid':>8} {'/healthz ms':>12}")
    worst: dict[str, tuple[float, str]] = {}  # with the analysis, up to the commit
    for name, (_, baseline) in families.items():
        per_mb, _, statuses = results[name]
        ratio = per_mb / results[baseline][0]
        worst["all"] = max(worst.get("all", (0.0, "")), (ratio, name))
        codes = ",".join(map(str, sorted(statuses)))
        healthz_ms = probe.worst_s.get(name, 0.0) * 1000
        print(f"{name:<16} {codes:<10} {per_mb:>9.4f} {ratio:>8.2f} {healthz_ms:>12.0f}")
    print("the same up to the commit (the live analysis left out; CPU s/MB, x valid):")
    for name, (_, baseline) in families.items():
        per_mb = results[name][1]
        ratio = per_mb / results[baseline][1]
        worst["commit"] = max(worst.get("commit", (0.0, "")), (ratio, name))
        print(f"  to commit: {name:<16} {per_mb:>9.4f} {ratio:>8.2f}")
    idle_ms = probe.worst_s.get("(idle)", 0.0) * 1000
    print(f"/healthz of the idle collector, {IDLE_S:g} s before the families: slowest "
          f"{idle_ms:.0f} ms (the machine's own delays)")  # fmt: skip
    print(f"collector peak RSS {peak_mb:.0f} MB; /healthz failures {probe.failures}")
    (ratio, name), (commit_ratio, commit_name) = worst["all"], worst["commit"]
    print(
        f"worst family {name} at {ratio:.2f}x a valid batch's CPU per MB (up to the commit: "
        f"{commit_name} at {commit_ratio:.2f}x; target 3x); slowest /healthz "
        f"{max(probe.worst_s.get(f, 0) for f in families) * 1000:.0f} ms (target 100 ms)"
    )


if __name__ == "__main__":
    main()
