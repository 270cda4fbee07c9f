"""The real servers of the alerting path, on free ports of 127.0.0.1, started from the
compose file's commands: collector, Prometheus, Alertmanager, and the webhook receiver
that stands in for Slack or PagerDuty."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import yaml

from tests.conftest import free_port, wait_until

from . import runs
from .stack import (
    alertmanager_test_config,
    binary,
    compose_address,
    prometheus_test_config,
    replace_flags,
    service_command,
)


class Server:
    """A subprocess serving `url`, its output in `log`; ready once `url + ready_path` answers."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        url: str,
        ready_path: str,
        log: Path,
        env: dict[str, str] | None = None,
    ) -> None:
        self.name, self.url, self.log = name, url, log
        self.address = url.removeprefix("http://")
        env = {**os.environ, **(env or {})}
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
        self._ready_url = url + ready_path
        wait_until(self._ready, timeout_s=60, interval_s=0.2)

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            pytest.fail(f"{self.name} exited ({self.proc.returncode}):\n{self.log.read_text()}")
        try:
            return httpx.get(self._ready_url, timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_collector(tmp: Path) -> Server:
    port = free_port()
    local = {"--store": str(tmp / "store.duckdb"), "--host": "127.0.0.1", "--port": str(port)}
    argv = replace_flags(service_command("collector"), local)
    # The image's entry point is `trainvitals`; here the same CLI runs as a module.
    return Server(
        "collector",
        [sys.executable, "-m", "trainvitals", *argv],
        f"http://127.0.0.1:{port}",
        "/healthz",
        tmp / "collector.log",
        env={"TRAINVITALS_INGEST_TOKEN": runs.TOKEN},  # as compose passes TRAINVITALS_TOKEN
    )


def start_alertmanager(tmp: Path, webhook_url: str) -> Server:
    port = free_port()
    config = tmp / "alertmanager.yml"
    config.write_text(yaml.safe_dump(alertmanager_test_config(webhook_url)))
    local = {
        "--config.file": str(config),
        "--storage.path": str(tmp / "alertmanager-data"),
        "--web.listen-address": f"127.0.0.1:{port}",
    }
    argv = replace_flags(service_command("alertmanager"), local)
    return Server(
        "alertmanager",
        [binary("prometheus-alertmanager"), *argv],
        f"http://127.0.0.1:{port}",
        "/-/ready",
        tmp / "alertmanager.log",
    )


def start_prometheus(tmp: Path, collector: Server, alertmanager: Server) -> Server:
    port = free_port()
    local_address = {
        compose_address("collector"): collector.address,
        compose_address("alertmanager"): alertmanager.address,
        "localhost:9090": f"127.0.0.1:{port}",  # Prometheus scraping itself
    }
    config = tmp / "prometheus.yml"
    token_file = tmp / "collector-token"  # the compose secret's stand-in
    token_file.write_text(runs.TOKEN)
    config.write_text(yaml.safe_dump(prometheus_test_config(local_address, token_file=token_file)))
    local = {
        "--config.file": str(config),
        "--storage.tsdb.path": str(tmp / "tsdb"),
        "--web.listen-address": f"127.0.0.1:{port}",
    }
    argv = replace_flags(service_command("prometheus"), local)
    return Server(
        "prometheus",
        [binary("prometheus"), *argv],
        f"http://127.0.0.1:{port}",
        "/-/ready",
        tmp / "prometheus.log",
    )


class WebhookReceiver:
    """Alertmanager's webhook target: keeps (arrival time.monotonic(), alert) per alert."""

    def __init__(self) -> None:
        self.alerts: list[tuple[float, dict]] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                arrived = time.monotonic()
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                with receiver._lock:
                    receiver.alerts.extend((arrived, a) for a in body["alerts"])
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args) -> None:  # keep the test output clean
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_port}/alerts"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def received(self) -> list[tuple[float, dict]]:
        with self._lock:
            return list(self.alerts)

    def for_run(self, run_id: str) -> list[tuple[float, dict]]:
        return [(t, a) for t, a in self.received() if a["labels"].get("run_id") == run_id]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
