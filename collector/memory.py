"""The memory limit of the store's DuckDB: how it is written, and its default."""

from __future__ import annotations

import re

# DuckDB caches the store's blocks in its buffer pool, by default up to 80% of the machine's
# memory, so an unlimited collector grows with the rows it stores, whatever runs beside it.
# Past the limit DuckDB evicts cached blocks and spills large queries to disk. In
# bench/ingest.py (bench/results/ingest_memory_limit.txt) the collector peaked at 2.4 GB
# under 2GB and at 1.0 GB under 512MB, where it took 3.5 M points/s instead of 4.8 M.
DEFAULT_MEMORY_LIMIT = "2GB"
# At 128 MiB a resent batch of 400k rank rows (INSERT OR IGNORE) ran out of memory; at
# 256 MiB a resend of 1 M rows fits (tests/collector/test_memory_limit.py).
MIN_MEMORY_LIMIT_BYTES = 256 * 2**20
_UNITS = {"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b)\s*", re.IGNORECASE)


def memory_limit_bytes(text: str) -> int:
    """'2GB', '512MiB', ... -> bytes; ValueError with the accepted forms otherwise."""
    m = _SIZE.fullmatch(text)
    if m is None:
        raise ValueError(f"memory limit {text!r} is not a size such as 2GB, 1.5GB or 512MiB")
    n_bytes = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n_bytes < MIN_MEMORY_LIMIT_BYTES:
        raise ValueError(f"memory limit {text!r} is under the minimum of 256MiB")
    return n_bytes
