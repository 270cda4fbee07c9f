"""POST /api/v1/heartbeats: ranks' liveness, for the watchdog (collector/watchdog.py).

A small columnar batch, one rank's heartbeat or many (a node leader, a proxy):

    {"schema_version": 1, "run_id": "r1",
     "heartbeats": {"rank": [0, 1], "time_unix_s": [...], "host": [...],
                    "step_started": [...], "step_finished": [...], "phase": [...]}}

Validated whole as ingest validates (4xx naming the field, nothing stored of a bad batch;
the same bearer token), stamped with the collector's receive time and handed to the
watchdog, which judges it and writes it to the `heartbeats` table with the others of its
tick, half a second later (collector/watchdog.py says why). JSON or msgpack, optionally
gzip. 202: taken (not yet committed, unlike ingest).
A heartbeat is a few hundred bytes: decoded and validated on the event loop (tens of
microseconds), not on the thread pool, whose hand-off would cost more.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

from trainvitals.schema import SchemaError, heartbeats_to_arrow

from .decoding import Decoder, DecoderLost
from .deps import get_decoder, get_settings, get_store, get_watchdog
from .ingest import read_body, writable_decoder
from .settings import Settings
from .store import Store
from .watchdog import LiveWatchdog

router = APIRouter(tags=["heartbeats"])
# Bodies up to this size are decoded on the event loop (a heartbeat is a few hundred bytes;
# 64 KiB, a few hundred ranks' batch, decodes in about a millisecond); larger ones go where
# ingest's do (decoding.py): a 32 MB batch held the loop for seconds.
_ON_LOOP_BYTES = 64 * 1024
PATH = "/api/v1/heartbeats"


def decode_heartbeats(
    body: bytes, decode: Callable[[bytes], Any], received_unix_s: float
) -> tuple[str, Any]:
    """(run_id, pyarrow.Table) of a heartbeat batch; SchemaError naming what is wrong."""
    return heartbeats_to_arrow(decode(body), received_unix_s)


@router.post(PATH, status_code=202)
async def heartbeats(
    request: Request,
    settings: Annotated[Settings, Depends(get_settings)],
    store: Annotated[Store, Depends(get_store)],
    watchdog: Annotated[LiveWatchdog | None, Depends(get_watchdog)],
    decoder: Annotated[Decoder, Depends(get_decoder)],
    authorization: Annotated[str | None, Header()] = None,
) -> dict[str, Any]:
    """Take a batch of heartbeats for the watchdog and the store. 202 once taken."""
    received_unix_s = time.time()
    decode = writable_decoder(request, settings, store, authorization)
    try:
        body = await read_body(request, settings.max_body_bytes)
    except ClientDisconnect as e:  # a rank that died mid-request (torchrun's teardown)
        raise HTTPException(400, "the sender left before its body arrived") from e
    try:
        if len(body) <= _ON_LOOP_BYTES:
            run_id, table = heartbeats_to_arrow(decode(body), received_unix_s)
        else:  # a large batch (a proxy's, or a crafted one) must not stall the event loop
            run_id, table = await decoder.run(decode_heartbeats, body, decode, received_unix_s)
    except SchemaError as e:
        raise HTTPException(422, str(e)) from e
    except DecoderLost as e:
        raise HTTPException(503, str(e), headers={"Retry-After": "1"}) from e
    if watchdog is None:
        raise HTTPException(503, "the collector is not running its watchdog")
    if len(body) <= _ON_LOOP_BYTES:
        watchdog.observe(run_id, table)  # stored with the others at its next tick
    else:  # judging 66,000 ranks held the event loop for 300 ms
        await run_in_threadpool(watchdog.observe, run_id, table)
    return {"run_id": run_id, "accepted_rows": {"heartbeats": table.num_rows}}
