"""POST /api/v1/ingest: columnar schema batches from the hooks (or anyone).

Validation happens whole before anything is queued: a bad batch gets a 4xx naming the
table and field, and none of its rows are stored.

msgpack bodies may carry numeric columns as binary (trainvitals/schema/codec.py):
decoding one is a memcpy and validating it a few vectorised passes per column, so a
request of 250,000 values costs milliseconds here; the commit is the rest (store.py,
docs/scaling.md).
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, HTTPException, Request
from fastapi.concurrency import run_in_threadpool

from trainvitals.schema import SchemaError, decode_json, decode_msgpack, to_arrow

from .decoding import Decoder, DecoderLost
from .deps import get_decoder, get_settings, get_store
from .limits import GzipError, OverBudget, TooLarge, gunzip, reserve_for
from .settings import Settings
from .store import Store, StoreError, Unavailable

router = APIRouter(tags=["ingest"])

COMMIT_TIMEOUT_S = 30.0
# Content type -> body decoder; both give the same batch document.
DECODERS = {
    "application/json": decode_json,
    "application/msgpack": decode_msgpack,
    "application/x-msgpack": decode_msgpack,
}


def check_token(settings: Settings, authorization: str | None) -> None:
    """401 unless `authorization` carries the write (ingest) token, where one is set."""
    if not bearer_matches(authorization, settings.ingest_token):
        raise HTTPException(
            401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"}
        )


def bearer_matches(authorization: str | None, expected: str) -> bool:
    """True if `expected` is '' (no token set) or `authorization` is 'Bearer <expected>'."""
    if not expected:
        return True
    # "<scheme> <token>"; the scheme is case-insensitive (RFC 7235 section 2.1).
    scheme, _, token = (authorization or "").strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(
        token.strip().encode(), expected.encode()
    )


def writable_decoder(
    request: Request, settings: Settings, store: Store, authorization: str | None
) -> Callable[[bytes], Any]:
    """The decoder of a write's content type, once its token and the store's mode allow it;
    401, 409 or 415 naming what is wrong otherwise. Ingest and heartbeats share it."""
    check_token(settings, authorization)
    if store.read_only:
        raise HTTPException(409, "this collector serves a stored run read-only (replay mode)")
    ctype = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
    decode = DECODERS.get(ctype)
    if decode is None:
        raise HTTPException(
            415, f"content-type {ctype!r} is not supported; send one of {sorted(DECODERS)}"
        )
    return decode


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused as soon as it exceeds `limit` bytes (before or after gzip).

    The bytes count against the collector's decode budget (limits.py) until the request is
    answered: 503 with Retry-After past it. gzip is undone on the thread pool.
    """
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("gzip", "identity"):
        raise HTTPException(
            415, f"content-encoding {encoding!r} is not supported; send gzip or none"
        )
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise HTTPException(413, f"body of {declared} bytes exceeds the limit of {limit} bytes")
    chunks, size = [], 0
    try:
        # All at once where the size is declared: concurrent bodies that each took a part
        # as they streamed in could all run out halfway, and all get 503.
        reserved = int(declared) if declared and declared.isdigit() else 0
        reserve_for(request, reserved)
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise HTTPException(413, f"body exceeds the limit of {limit} bytes")
            reserve_for(request, size - max(reserved, size - len(chunk)))
            chunks.append(chunk)
        body = b"".join(chunks)
        if encoding == "identity":
            return body
        # CPU-bound, linear in the body (limits.gunzip): off the event loop.
        plain = await run_in_threadpool(gunzip, body, limit)
        # The compressed bytes go once `plain` is made; reserve what the decoder will see.
        reserve_for(request, len(plain) - len(body))
        return plain
    except OverBudget as e:
        raise HTTPException(503, str(e), headers={"Retry-After": "1"}) from e
    except GzipError as e:
        raise HTTPException(400, str(e)) from e
    except TooLarge as e:
        raise HTTPException(413, str(e)) from e


def decode_batch(body: bytes, decode: Callable[[bytes], Any]) -> tuple[str, dict[str, Any]]:
    """(run_id, {table: pyarrow.Table}) of a body; SchemaError naming what is wrong."""
    return to_arrow(decode(body))


@router.post("/api/v1/ingest", status_code=202)
async def ingest(
    request: Request,
    settings: Annotated[Settings, Depends(get_settings)],
    store: Annotated[Store, Depends(get_store)],
    decoder: Annotated[Decoder, Depends(get_decoder)],
    authorization: Annotated[str | None, Header()] = None,
) -> dict[str, Any]:
    """Store one schema batch (JSON or msgpack, optionally gzip). 202 once it is committed."""
    decode = writable_decoder(request, settings, store, authorization)
    body = await read_body(request, settings.max_body_bytes)
    try:
        # CPU-bound: off the event loop, in a worker process if large (decoding.py).
        run_id, tables = await decoder.run(decode_batch, body, decode)
    except SchemaError as e:
        raise HTTPException(422, str(e)) from e
    except DecoderLost as e:
        raise HTTPException(503, str(e), headers={"Retry-After": "1"}) from e
    try:
        committed = store.submit(run_id, tables)
    except Unavailable as e:  # a full write queue, a full disk
        raise HTTPException(503, f"{e}; retry later", headers={"Retry-After": "1"}) from e
    except StoreError as e:
        raise HTTPException(409, str(e)) from e
    try:
        changed = await asyncio.wait_for(asyncio.wrap_future(committed), COMMIT_TIMEOUT_S) or {}
    except (StoreError, TimeoutError) as e:
        # Not acknowledged: the sender keeps the batch and resends it (keys make that safe).
        raise HTTPException(503, f"batch not stored ({e or 'timed out'}); resend it") from e
    answer: dict[str, Any] = {
        "run_id": run_id,
        "accepted_rows": {name: t.num_rows - changed.get(name, 0) for name, t in tables.items()},
    }
    if changed:
        # Same keys, other values: the store keeps what it had (counted in /metrics).
        answer["not_stored"] = {
            "rows": changed,
            "reason": "their keys are stored with other values; the first copy stays",
        }
    return answer
