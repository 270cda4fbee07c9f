"""POST /api/v1/heartbeats: ranks' liveness, for the watchdog (collector/watchdog.py).

A small columnar batch, one rank's heartbeat or many (a node leader, a proxy):

    {"schema_version": 1, "run_id": "r1",
     "heartbeats": {"rank": [0, 1], "time_unix_s": [...], "host": [...],
                    "step_started": [...], "step_finished": [...], "phase": [...]}}

Validated whole as ingest validates (4xx naming the field, nothing stored of a bad batch;
the same bearer token), stamped with the collector's receive time, committed to the
`heartbeats` table, then handed to the watchdog. JSON or msgpack, optionally gzip.
A heartbeat is a few hundred bytes: decoded and validated on the event loop (tens of
microseconds), not on the thread pool, whose hand-off would cost more.
"""

from __future__ import annotations

import asyncio
import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, HTTPException, Request

from trainvitals.schema import SchemaError, heartbeats_to_arrow

from .deps import get_settings, get_store
from .ingest import COMMIT_TIMEOUT_S, DECODERS, check_token, read_body
from .settings import Settings
from .store import QueueFull, Store, StoreError
from .watchdog import LiveWatchdog

router = APIRouter(tags=["heartbeats"])
PATH = "/api/v1/heartbeats"


def get_watchdog(request: Request) -> LiveWatchdog | None:
    return getattr(request.app.state, "watchdog", None)


@router.post(PATH, status_code=202)
async def heartbeats(
    request: Request,
    settings: Annotated[Settings, Depends(get_settings)],
    store: Annotated[Store, Depends(get_store)],
    watchdog: Annotated[LiveWatchdog | None, Depends(get_watchdog)],
    authorization: Annotated[str | None, Header()] = None,
) -> dict[str, Any]:
    """Store a batch of heartbeats and pass them to the watchdog. 202 once committed."""
    received_unix_s = time.time()
    check_token(settings, authorization)
    if store.read_only:
        raise HTTPException(409, "this collector serves a stored run read-only (replay mode)")
    ctype = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
    decode = DECODERS.get(ctype)
    if decode is None:
        raise HTTPException(
            415, f"content-type {ctype!r} is not supported; send one of {sorted(DECODERS)}"
        )
    body = await read_body(request, settings.max_body_bytes)
    try:
        run_id, table = heartbeats_to_arrow(decode(body), received_unix_s)
    except SchemaError as e:
        raise HTTPException(422, str(e)) from e
    try:
        committed = store.submit(run_id, {"heartbeats": table})
    except QueueFull as e:
        raise HTTPException(503, f"{e}; retry later", headers={"Retry-After": "1"}) from e
    except StoreError as e:
        raise HTTPException(409, str(e)) from e
    try:
        await asyncio.wait_for(asyncio.wrap_future(committed), COMMIT_TIMEOUT_S)
    except (StoreError, TimeoutError) as e:
        raise HTTPException(503, f"heartbeats not stored ({e or 'timed out'})") from e
    if watchdog is not None:
        watchdog.observe(run_id, table)
    return {"run_id": run_id, "accepted_rows": {"heartbeats": table.num_rows}}
