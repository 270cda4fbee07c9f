"""Where request bodies are decoded: large ones in a worker process, small ones in a thread.

Decoding holds the GIL, and every thread of the collector, the event loop's included, waits
for it: orjson parses a 4 MB JSON body in one C call of 70-320 ms, pyarrow converts a list
of Python floats in another, and a garbage collection over a decoded document takes as
long. Under bench/adversarial.py `/healthz` took up to 2 s to answer. A worker process holds
its own GIL: the collector only waits for the validated Arrow tables to come back (pickled,
a copy of their buffers). A body under `in_process_bytes` stays in a thread, as the
hand-off would cost more than its decoding; so do all of them with `workers=0`.

The worker starts with the first large body (spawned: forking a process that runs DuckDB
and threads is unsafe), so a collector that never gets one never starts it. A worker that
dies (the OOM killer) fails the requests it held with `DecoderLost` (503, resend) and the
next large body starts a new one.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import threading
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

from starlette.concurrency import run_in_threadpool

log = logging.getLogger(__name__)
T = TypeVar("T")


class DecoderLost(RuntimeError):
    """The worker process died while decoding the body; the sender should resend it."""


class Decoder:
    """Runs a decoding function on a body: in a worker process if the body is large."""

    def __init__(self, workers: int = 1, in_process_bytes: int = 512 * 1024) -> None:
        if workers < 0:
            raise ValueError(f"Decoder.workers must be 0 or more, got {workers}")
        self.workers = workers
        self.in_process_bytes = in_process_bytes
        self._pool: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()

    async def run(self, fn: Callable[..., T], body: bytes, *args: Any) -> T:
        """`fn(body, *args)`, off the event loop. `fn` must be a module-level function
        (it is pickled by name for the worker), its arguments and result picklable."""
        if not self.workers or len(body) < self.in_process_bytes:
            return await run_in_threadpool(fn, body, *args)
        pool = self._started()
        try:
            return await asyncio.wrap_future(pool.submit(fn, body, *args))
        except BrokenProcessPool as e:
            self._forget(pool)
            raise DecoderLost("the decoding process died; resend the body") from e

    def _started(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:
                context = multiprocessing.get_context("spawn")
                self._pool = ProcessPoolExecutor(self.workers, mp_context=context)
            return self._pool

    def _forget(self, pool: ProcessPoolExecutor) -> None:
        with self._lock:
            if self._pool is pool:
                log.error("a decoding process died; the next large body starts another")
                self._pool = None
        pool.shutdown(wait=False, cancel_futures=True)

    def worker_pids(self) -> list[int]:
        """Process ids of the running workers (none before the first large body)."""
        with self._lock:
            pool = self._pool
        processes = [] if pool is None else (pool._processes or {}).values()
        return [p.pid for p in processes if p.pid is not None]

    def close(self) -> None:
        """Stop the worker (after the bodies it holds are decoded)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
