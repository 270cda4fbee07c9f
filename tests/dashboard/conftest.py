"""Fixtures of the dashboard tests: a canned collector API served over real HTTP."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from tests.conftest import free_port


@pytest.fixture
def free_tcp_port() -> int:
    """A TCP port on 127.0.0.1 that a test may listen on."""
    return free_port()


@pytest.fixture
def unused_url() -> str:
    """The URL of a collector that is not running: nothing listens on its port."""
    return f"http://127.0.0.1:{free_port()}"


# An answer: (status, JSON body or raw bytes), or a function of the query parameters
# returning one (e.g. a per-metric grid).
Answer = tuple[int, Any] | Callable[[dict[str, str]], tuple[int, Any]]


@dataclass
class CannedCollector:
    """An HTTP server answering GET path -> (status, JSON body or raw bytes)."""

    url: str
    routes: dict[str, Answer] = field(default_factory=dict)
    # (path, query parameters) of every request, in arrival order.
    requests: list[tuple[str, dict[str, str]]] = field(default_factory=list)


def _handler(canned: CannedCollector) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            parts = urlsplit(self.path)
            # A repeated parameter (metric=a&metric=b) as a list, any other as its value.
            query = {k: v[0] if len(v) == 1 else v for k, v in parse_qs(parts.query).items()}
            canned.requests.append((parts.path, query))
            answer = canned.routes.get(parts.path, (404, {"detail": "not found"}))
            status, body = answer(query) if callable(answer) else answer
            raw = body if isinstance(body, bytes) else json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def log_message(self, *args: object) -> None:
            pass  # keep pytest output to the failures

    return Handler


@pytest.fixture(scope="session")
def two_runs(tmp_path_factory) -> Iterator[str]:
    """URL of a live collector holding runs "baseline" and "faulty" (two_runs.py)."""
    from tests.dashboard.two_runs import start_two_runs

    collector = start_two_runs(tmp_path_factory.mktemp("two_runs") / "store.duckdb")
    yield collector.url
    collector.stop()


@pytest.fixture
def canned_collector() -> Iterator[CannedCollector]:
    """A live HTTP server on 127.0.0.1 whose answers a test sets in `.routes`."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    canned = CannedCollector(url=f"http://127.0.0.1:{server.server_port}")
    server.RequestHandlerClass = _handler(canned)
    # A short poll interval: shutdown() waits up to one interval (default 0.5 s).
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield canned
    server.shutdown()
    server.server_close()
    thread.join()
