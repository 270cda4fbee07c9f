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
For each it prints the collector's CPU seconds (user + system, all threads, from /proc)
per MB of request body, and that figure against a valid batch's of the same endpoint and
encoding (a native JSON batch for native ingest and heartbeats, an OTLP protobuf request
of complete rows for OTLP), with the answers' status codes and the collector's peak RSS.
All the while a thread asks /healthz every 20 ms; the slowest answer is printed. Targets
(issue 18): no family above 3x, /healthz within 100 ms throughout. The headline is the
last line.

    python bench/adversarial.py --memory | tee bench/results/adversarial.txt
    python bench/adversarial.py --short   # the CI form (tests/collector/test_adversarial_bench.py)
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
from pathlib import Path

import httpx
import orjson
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)

from trainvitals.dashboard.launch import free_port
from trainvitals.demo import wait_healthy
from trainvitals.schema import SCHEMA_VERSION

JSON = {"content-type": "application/json"}
PROTOBUF = {"content-type": "application/x-protobuf"}
STEP_FIELDS = ("time_unix_s", "loss", "grad_norm", "step_time_s", "tokens_per_s",
               "tflops_per_s_per_device", "mfu_ratio", "tokens")  # fmt: skip


class Collector:
    """`trainvitals collector` on a free port, in a subprocess."""

    def __init__(self, store: Path, env: dict[str, str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [sys.executable, "-m", "trainvitals", "collector", "--store", str(store)]
        self.proc = subprocess.Popen(
            [*argv, "--port", str(self.port)], env={**os.environ, **env}, stdout=subprocess.DEVNULL
        )
        wait_healthy(f"{self.url}/healthz", self.proc, timeout_s=600)

    def cpu_s(self) -> float:
        """CPU seconds the collector process has used (user + system, all threads)."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def peak_rss_mb(self) -> float:
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(status.split("VmHWM:")[1].split()[0]) / 1024

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(120)


class HealthProbe(threading.Thread):
    """Asks /healthz every 20 ms; keeps the slowest answer, in seconds."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.failures = url, 0
        self.family = ""  # the family being sent; slowest answer per family, in seconds
        self.worst_s: dict[str, float] = {}
        self._done = threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=600) as client:
            while not self._done.wait(0.02):
                start = time.perf_counter()
                try:
                    ok = client.get(f"{self.url}/healthz").status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.failures += not ok
                took = time.perf_counter() - start
                self.worst_s[self.family] = max(self.worst_s.get(self.family, 0.0), took)

    def stop(self) -> None:
        self._done.set()
        self.join()


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


def _otlp(n_rows: int, n_runs: int, fields: tuple[str, ...], seq: int) -> bytes:
    request = ExportMetricsServiceRequest()
    scope = request.resource_metrics.add().scope_metrics.add()
    for f in fields:
        points = scope.metrics.add(name=f"trainvitals.steps.{f}").gauge.data_points
        for i in range(n_rows):
            point = points.add(as_double=1.0)
            point.attributes.add(key="run_id").value.string_value = f"r{seq}-{i % n_runs}"
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
    return "/v1/metrics", PROTOBUF, _otlp(n, max(1500, n // 4), STEP_FIELDS, seq)


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


def measure(c: Collector, build: Callable, size: int, repeats: int) -> tuple[float, set[int]]:
    """(collector CPU seconds per MB of body, the status codes answered)."""
    statuses, cpu_s, mb = set(), 0.0, 0.0
    with httpx.Client(timeout=600) as client:
        for seq in range(repeats):
            path, headers, body = build(size, seq)
            before = c.cpu_s()
            r = client.post(f"{c.url}{path}", content=body, headers=headers)
            # The writer and the analyzer finish behind the answer: wait for an idle queue.
            while client.get(f"{c.url}/healthz").json()["queue_depth_batches"]:
                time.sleep(0.01)
            cpu_s += c.cpu_s() - before
            mb += len(body) / 1e6
            statuses.add(r.status_code)
    return cpu_s / mb, statuses


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
    args = p.parse_args()
    if args.memory:
        memory_check(28.0, 8)
    size_mb, repeats = (0.5, 2) if args.short else (args.mb, args.repeats)
    size = int(size_mb * 1e6)
    env = {"TRAINVITALS_MAX_BODY_BYTES": str(4 * size + 2**20)}
    env["TRAINVITALS_MAX_DECODING_BYTES"] = env["TRAINVITALS_MAX_BODY_BYTES"]
    with tempfile.TemporaryDirectory() as tmp:
        c = Collector(Path(tmp) / "store.duckdb", env)
        probe = HealthProbe(c.url)
        probe.start()
        try:
            results = {}
            for name, (build, _) in FAMILIES.items():
                probe.family = name
                results[name] = measure(c, build, size, repeats)
        finally:
            probe.stop()
            peak_mb = c.peak_rss_mb()
            c.stop()
    print(f"requests of {size_mb:g} MB, {repeats} per family; load average "
          f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")  # fmt: skip
    print(f"{'family':<16} {'status':<10} {'CPU s/MB':>9} {'x valid':>8} {'/healthz ms':>12}")
    worst_name, worst = "", 0.0
    for name, (_, baseline) in FAMILIES.items():
        per_mb, statuses = results[name]
        ratio = per_mb / results[baseline][0]
        if ratio > worst:
            worst_name, worst = name, ratio
        codes = ",".join(map(str, sorted(statuses)))
        healthz_ms = probe.worst_s.get(name, 0.0) * 1000
        print(f"{name:<16} {codes:<10} {per_mb:>9.4f} {ratio:>8.2f} {healthz_ms:>12.0f}")
    print(f"collector peak RSS {peak_mb:.0f} MB; /healthz failures {probe.failures}")
    print(
        f"worst family {worst_name} at {worst:.2f}x a valid batch's CPU per MB (target 3x); "
        f"slowest /healthz {max(probe.worst_s.values()) * 1000:.0f} ms (target 100 ms)"
    )


if __name__ == "__main__":
    main()
