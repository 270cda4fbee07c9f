"""The collector app: lifespan (open the store, start the writer) and routers.

uvicorn --factory trainvitals.collector.main:app_from_env
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import orjson
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from trainvitals.analyzer import Analyzer

from . import heartbeat, ingest, metrics, otlp, query
from .analysis import follow
from .decoding import Decoder
from .gcguard import GcGuard
from .limits import DecodeBudget
from .middleware import CollectorMiddleware
from .settings import Settings
from .state import load_live_state
from .store import Store
from .watchdog import LiveWatchdog


class FastJSONResponse(JSONResponse):
    """orjson: faster than json, and writes NaN/inf as null instead of failing."""

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def _rebuild(watchdog: LiveWatchdog) -> None:
    """Restore the watchdog's runs from the store; a failure is logged and counted in its
    errors, and the collector starts without them (they are judged from their next
    heartbeats)."""
    try:
        restored = watchdog.rebuild()
    except Exception:
        logging.getLogger(__name__).exception(
            "could not rebuild the liveness watchdog from the store"
        )
        watchdog.errors += 1
        return
    if restored:
        logging.getLogger(__name__).info(
            "liveness watchdog: %d live run(s) restored from the store", len(restored)
        )


def create_app(
    settings: Settings | None = None,
    analysis_clock: Callable[[], float] = time.monotonic,
    watchdog_clock: Callable[[], float] = time.time,
) -> FastAPI:
    """analysis_clock: when a committed step is due for the live analysis (tests hold it
    still, and `Store.flush` analyses what is committed); watchdog_clock: the liveness
    watchdog's Unix time (collector/watchdog.py)."""
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        config = settings.analyzer()  # detector settings: file, TRAINVITALS_ANALYZER__*, --set
        store = Store(
            settings.store_path,
            read_only=settings.replay,
            queue_max_batches=settings.queue_max_batches,
            retention_days=settings.retention_days,
            memory_limit=settings.memory_limit,
        )
        # /metrics reads each run's latest values, loaded from the store (also in replay
        # mode) and kept by following the writer's commits (state.py).
        live = load_live_state(store)
        # The detectors follow the writer's commits too (analysis.py); none in replay mode.
        analyzer = Analyzer(config=config)
        analysis = None
        if not settings.replay:
            store.listen(live)  # first: /metrics has a batch by the time it is acknowledged
            analysis = follow(store, analyzer, live, clock=analysis_clock)
        app.state.live = live
        app.state.analysis = analysis
        store.start()
        _warn_if_open(settings)
        app.state.settings = settings
        app.state.decode_budget = DecodeBudget(settings.max_decoding_bytes)
        # Large bodies are decoded in a worker process, off this one's GIL (decoding.py).
        app.state.decoder = Decoder(settings.decode_workers, settings.decode_in_process_bytes)
        app.state.store = store
        # Liveness is judged on the clock, apart from the steps (collector/watchdog.py).
        app.state.watchdog = (
            None
            if settings.replay
            else LiveWatchdog(store, live, settings=config.liveness, clock=watchdog_clock)
        )
        if app.state.watchdog is not None:
            _rebuild(app.state.watchdog)  # the runs live before a restart (watchdog.py)
            app.state.watchdog.start()
        # Full garbage collections walk all of the above and hold the GIL: kept short by
        # freezing what lives long (gcguard.py). Last, so that the state loaded is frozen.
        gc_guard = GcGuard(settings.gc_max_objects) if settings.gc_max_objects else None
        if gc_guard is not None:
            gc_guard.start()
        try:
            yield
        finally:
            if app.state.watchdog is not None:
                app.state.watchdog.close()
            app.state.decoder.close()
            store.close()  # drains the queue: a clean stop loses nothing already accepted
            if gc_guard is not None:
                gc_guard.close()

    app = FastAPI(
        title="trainvitals collector",
        description="Ingests training telemetry into DuckDB; serves Prometheus and queries.",
        lifespan=lifespan,
        default_response_class=FastJSONResponse,
    )

    # Pure ASGI (collector/middleware.py): the read token, request counting, the budget.
    app.add_middleware(CollectorMiddleware, reader_token=settings.reader_token, state=app.state)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's default is fine but verbose; keep the field path and the reason.
        problems = [f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()]
        return FastJSONResponse({"detail": "; ".join(problems)}, status_code=422)

    @app.get("/healthz", tags=["health"])
    @app.head("/healthz", tags=["health"])  # load balancers and uptime checks probe with HEAD
    async def healthz(request: Request) -> dict[str, Any]:
        store: Store = request.app.state.store
        return {"status": "ok", "replay": store.read_only, "queue_depth_batches": store.queue_depth}

    @app.get("/readyz", tags=["health"])
    @app.head("/readyz", tags=["health"])
    async def readyz(request: Request) -> Response:
        """200 while the store takes writes (or serves a stored run); 503 naming why not (a
        full disk: the collector retries by itself, and is ready again once it can write)."""
        store: Store = request.app.state.store
        ready = store.unwritable is None
        body: dict[str, Any] = {"ready": ready, "replay": store.read_only}
        if not ready:
            body["reason"] = f"the store cannot take writes: {store.unwritable}"
        return FastJSONResponse(body, status_code=200 if ready else 503)

    app.include_router(ingest.router)
    app.include_router(heartbeat.router)  # POST /api/v1/heartbeats, for the watchdog
    app.include_router(query.router)
    app.include_router(metrics.router)
    app.include_router(otlp.router)  # POST /v1/metrics, see docs/otlp.md
    return app


def open_to_the_network(settings: Settings) -> str | None:
    """A warning if the collector listens beyond loopback with no token, else None."""
    if settings.host in ("127.0.0.1", "localhost", "::1") or settings.host.startswith("127."):
        return None
    tokens = {"reads": settings.reader_token}
    if not settings.replay:  # a replay takes no writes
        tokens["writes"] = settings.ingest_token
    unguarded = " and ".join(what for what, token in tokens.items() if not token)
    if not unguarded:
        return None
    return (
        f"WARNING: the collector listens on {settings.host} with no token for {unguarded}: "
        "anyone who can reach it can read every run's data or write into any run. Set "
        "--token (TRAINVITALS_INGEST_TOKEN) and --read-token (TRAINVITALS_READ_TOKEN)"
    )


def _warn_if_open(settings: Settings) -> None:
    if warning := open_to_the_network(settings):
        logging.getLogger(__name__).warning(warning)


def app_from_env() -> FastAPI:
    """Factory for `uvicorn --factory`: settings from TRAINVITALS_* environment variables."""
    return create_app(Settings())
