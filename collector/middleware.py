"""The app's one middleware: the read token, request counting, the decode budget's release.

Pure ASGI, not Starlette's `BaseHTTPMiddleware` (`@app.middleware("http")`): that one runs
every request's app in a task of its own and passes the response back through a memory
stream, a cost paid on each request, heartbeats included (bench/heartbeat_scale.py
--baseline measures it side by side with an older revision; docs/benchmarks.md).
"""

from __future__ import annotations

from typing import Any

import orjson
from starlette.datastructures import State
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .heartbeat import PATH as HEARTBEATS_PATH
from .ingest import bearer_matches
from .limits import release_for

OPEN_PATHS = frozenset({"/healthz", "/readyz"})  # probes: no data in them
# Their routers check the write (ingest) token (ingest.check_token).
WRITE_PATHS = frozenset({"/api/v1/ingest", HEARTBEATS_PATH, "/v1/metrics"})
# A 4xx to these is a rejected batch too (OTLP counts its own, with its rpc status body).
_BATCH_PATHS = frozenset({"/api/v1/ingest", HEARTBEATS_PATH})
_UNAUTHORIZED = orjson.dumps(
    {"detail": "missing or wrong bearer token (reads need the read token)"}
)


class CollectorMiddleware:
    """Reads need the read token (or the write token where no read token is set): the
    query API holds every run's data, and /docs and /openapi.json map it. Writes check the
    write token in their routers; probes stay open. A refused read answers 401 here, before
    any counting (as it did). Every other answer is counted by status in /metrics, an
    unhandled error as the 500 the server answers to it (Starlette's ServerErrorMiddleware,
    outside this one), and the body's share of the decode budget (limits.py) is given back.
    """

    def __init__(self, app: ASGIApp, reader_token: str, state: State) -> None:
        self.app = app
        self.reader_token = reader_token
        self.state = state  # the FastAPI app's state: the live state, once the lifespan made it

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        guarded = path not in OPEN_PATHS and path not in WRITE_PATHS
        if guarded and not bearer_matches(_header(scope, b"authorization"), self.reader_token):
            await _unauthorized(send)
            return
        status = 500  # unless the app starts an answer

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            release_for(Request(scope))
            self._count(path, status)

    def _count(self, path: str, status: int) -> None:
        """Count a request by status in /metrics; a 4xx to ingest is a rejected batch too."""
        live = getattr(self.state, "live", None)
        if live is None:
            return
        live.count_request(status)
        if path in _BATCH_PATHS and 400 <= status < 500:
            live.count_rejected()


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:  # ASGI servers give header names in lower case
            return value.decode("latin-1")
    return None


async def _unauthorized(send: Send) -> None:
    headers: list[tuple[bytes, bytes]] = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(_UNAUTHORIZED)).encode()),
        (b"www-authenticate", b"Bearer"),
    ]
    start: dict[str, Any] = {"type": "http.response.start", "status": 401, "headers": headers}
    await send(start)
    await send({"type": "http.response.body", "body": _UNAUTHORIZED})
