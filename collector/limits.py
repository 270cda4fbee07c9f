"""Bounds on the work one request may cause: bytes being decoded at once, gzip members.

Decoding a body costs several times its size in memory (a JSON number of 8 characters
becomes a 32-byte Python float and its list slot before it becomes 8 bytes of Arrow):
eight concurrent 32 MB JSON bodies took the collector to 4.0 GB. The `DecodeBudget`
caps the bytes of request bodies being read or decoded at once, collector-wide; a body
that does not fit gets 503 with Retry-After, as a full write queue does, and the sender
retries. The reservation is the body's size after gzip (what the decoder sees), taken
as it streams in, and released when the request is answered.
"""

from __future__ import annotations

import threading
import zlib

from starlette.requests import Request


class OverBudget(RuntimeError):
    """The collector is decoding as many bytes as it may at once; retry later."""


class DecodeBudget:
    """Bytes of request bodies in flight (read, decompressed or decoding), at most `limit`.

    >>> budget = DecodeBudget(100)
    >>> budget.reserve(60); budget.in_use
    60
    >>> budget.reserve(50)
    Traceback (most recent call last):
    ...
    trainvitals.collector.limits.OverBudget: the collector is decoding 60 bytes of request \
bodies already (limit 100); retry later
    """

    def __init__(self, limit: int) -> None:
        if limit <= 0:
            raise ValueError(f"DecodeBudget.limit must be positive, got {limit}")
        self.limit = limit
        self.in_use = 0
        self.refused = 0  # requests answered 503 for it (trainvitals_collector_*)
        self._lock = threading.Lock()

    def reserve(self, n: int) -> None:
        with self._lock:
            if self.in_use + n > self.limit:
                self.refused += 1
                raise OverBudget(
                    f"the collector is decoding {self.in_use} bytes of request bodies "
                    f"already (limit {self.limit}); retry later"
                )
            self.in_use += n

    def release(self, n: int) -> None:
        with self._lock:
            self.in_use -= n
            assert self.in_use >= 0, "released more than reserved"


def reserve_for(request: Request, n: int) -> None:
    """Reserve `n` more bytes for this request; all of it is released by `release_for`."""
    budget: DecodeBudget | None = getattr(request.app.state, "decode_budget", None)
    if budget is None or n <= 0:
        return
    budget.reserve(n)
    request.state.decode_reserved = getattr(request.state, "decode_reserved", 0) + n


def release_for(request: Request) -> None:
    """Give back what `reserve_for` took for this request (once it is answered)."""
    budget: DecodeBudget | None = getattr(request.app.state, "decode_budget", None)
    n = getattr(request.state, "decode_reserved", 0)
    if budget is not None and n:
        budget.release(n)
        request.state.decode_reserved = 0


class GzipError(ValueError):
    """The body is not valid gzip; the message says where."""


class TooLarge(ValueError):
    """The decompressed body exceeds the limit."""


# The first slice of a member fed to the decompressor, in bytes. Slices double while the
# member goes on, so a member of n bytes takes O(log n) calls, and the input copied back as
# `unused_data` at its end is at most its last slice: about its own size. Feeding the whole
# rest of the body copied the rest once per member: quadratic, 70 s of CPU for 8 MB of
# empty members (20 bytes each).
_FIRST_SLICE = 64
# Gzip members one body may hold. Senders write one (gzip, pigz) or a few (`cat a.gz b.gz`);
# each costs a few microseconds of Python however small, so a body of 20-byte empty members
# cost 3-5x a valid batch's CPU per MB even in linear time. Past it: 400.
MAX_GZIP_MEMBERS = 4096


def gunzip(body: bytes, limit: int, max_members: int = MAX_GZIP_MEMBERS) -> bytes:
    """The body decompressed: each gzip member in turn, as RFC 1952 allows several.

    Time and memory are linear in the body and the output. TooLarge past `limit` bytes of
    output (one byte over is enough to know, so a bomb never expands in memory); GzipError
    for bytes that are not gzip, naming the offset of a bad member after the first, and
    for more than `max_members` members.
    """
    view = memoryview(body)
    parts: list[bytes] = []
    size = offset = 0
    while offset < len(body) or not parts:
        if len(parts) == max_members:
            raise GzipError(f"body holds more than {max_members} gzip members; send fewer")
        try:
            out, used = _member(view, offset, limit + 1 - size)
        except zlib.error as e:
            where = f"data after its end (byte {offset}) is not a gzip member: " if parts else ""
            raise GzipError(f"body is not valid gzip: {where}{e}") from e
        size += len(out)
        if size > limit:
            raise TooLarge(f"decompressed body exceeds the limit of {limit} bytes")
        parts.append(out)
        offset += used
    return b"".join(parts)


def _member(view: memoryview, offset: int, max_bytes: int) -> tuple[bytes, int]:
    """(the gzip member at `offset` decompressed, at most `max_bytes`; bytes of input it
    took). zlib.error if it is cut off or not gzip."""
    d = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
    out: list[bytes] = []
    produced, pos, step = 0, offset, _FIRST_SLICE
    while not d.eof and produced < max_bytes:
        if pos >= len(view) and not d.unconsumed_tail:
            raise zlib.error("truncated")
        # unconsumed_tail: input held back when max_length stopped the output.
        data = d.unconsumed_tail or view[pos : pos + step]
        if not d.unconsumed_tail:
            pos += len(data)
            step *= 2
        chunk = d.decompress(data, max_bytes - produced)
        out.append(chunk)
        produced += len(chunk)
    return b"".join(out), pos - offset - len(d.unused_data) - len(d.unconsumed_tail)
