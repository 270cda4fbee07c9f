"""`trainvitals import`: load recorded telemetry into a collector, through its ingest API.

Takes a JSON-lines file written by the hooks' JsonlExporter (`--telemetry-file`), a spool
directory left by an HttpExporter that could not reach its collector (one rank's, or the
folder of rank<k>/ spools above them), or a Parquet export written by `trainvitals export`
(collector/export.py). An export is cut into batches of whole steps, at most `batch_rows`
rows each, sent as msgpack (which keeps NaN and inf).
Each batch is stored whole or not at all, and keys make a second import a no-op. The
receiving collector writes its own store (invariant 4) and raises the alerts again.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson

from trainvitals import checks
from trainvitals.sender import post_batch

JSON = "application/json"
MSGPACK = "application/msgpack"
_RANK_DIR = re.compile(r"rank\d+")  # hooks/spool.py: default_spool_dir(rank)


class NothingToImport(Exception):
    """The path is a spool that holds no batches (every one was delivered, say)."""


def spool_files(path: Path) -> list[Path]:
    """The spooled batches under `path`, in the order to send them; ValueError if no spool.

    `path` is one rank's spool (numbered .json files, hooks/spool.py) or the folder above
    them, $TRAINVITALS_SPOOL_DIR, which holds rank0/, rank1/, ...: rank by rank in rank
    order, each rank's batches oldest first. A .tmp file is a batch not yet written whole.
    """
    entries = list(path.iterdir())
    if entries and all(p.is_dir() and _RANK_DIR.fullmatch(p.name) for p in entries):
        ranks = sorted(entries, key=lambda p: int(p.name.removeprefix("rank")))
        return [file for rank in ranks for file in _rank_files(rank)]
    return _rank_files(path)


def _rank_files(path: Path) -> list[Path]:
    if any(not p.is_file() or p.suffix not in (".json", ".tmp") for p in path.iterdir()):
        raise ValueError(
            f"{path} is neither a Parquet export (folders runs/, steps/, ... written by "
            "`trainvitals export`) nor a spool directory (numbered .json batches, or "
            "rank<k>/ folders of them)"
        )
    return sorted(path.glob("*.json"))  # zero-padded sequence numbers: oldest first


def batches(path: Path) -> Iterator[tuple[str, bytes]]:
    """(where, body) of every batch in a JSON-lines file or a spool directory, in order."""
    if path.is_dir():
        yield from _spooled(path, spool_files(path))
        return
    with path.open("rb") as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                yield f"line {number}", line


def _spooled(root: Path, files: list[Path]) -> Iterator[tuple[str, bytes]]:
    for file in files:
        yield str(file.relative_to(root)), file.read_bytes()


def export_batches(path: Path, batch_rows: int) -> Iterator[tuple[str, bytes]]:
    """(where, msgpack body) of every batch of a Parquet export, run by run, in step order."""
    import msgpack

    from trainvitals.collector.export import read_export

    for where, doc in read_export(path, batch_rows):
        yield where, msgpack.packb(doc)


def _source(path: Path, batch_rows: int) -> tuple[Iterator[tuple[str, bytes]], str]:
    """The batches at `path` and their content type.

    ValueError if it holds none we know; NothingToImport if it holds no batches.
    """
    from trainvitals.collector.store import is_export

    if is_export(path):
        return export_batches(path, batch_rows), MSGPACK
    if path.is_dir():
        files = spool_files(path)  # ValueError if it is no spool either
        if not files:
            raise NothingToImport(f"nothing to import: {path} holds no spooled batches")
        return _spooled(path, files), JSON
    check_json_lines(path)
    return batches(path), JSON


# Magic bytes of the files people mistake for telemetry files, and what to do instead.
_NOT_JSON_LINES = (
    (8, b"DUCK", "a DuckDB file; to load a collector's store, export it first "
     "(`trainvitals export STORE OUT`) and import the folder OUT"),
    (0, b"PAR1", "a Parquet file; import takes the folder `trainvitals export` writes"),
    (0, b"\x1f\x8b", "gzip-compressed; decompress it first"),
)  # fmt: skip


def check_json_lines(path: Path) -> None:
    """ValueError unless the file's first batch is a telemetry document as the hooks write
    them (one JSON object per line, with schema_version and run_id); NothingToImport if it
    holds none. Checked before anything is sent: a file of another kind would otherwise
    go out line by line, every line rejected (each an alert at the collector)."""
    with path.open("rb") as f:
        head = f.read(16)
        for offset, magic, what in _NOT_JSON_LINES:
            if head[offset : offset + len(magic)] == magic:
                raise ValueError(f"{path} is {what}")
        f.seek(0)
        first = next((line for line in f if line.strip()), None)
    if first is None:
        raise NothingToImport(f"nothing to import: {path} is empty")
    expected = (
        "expected a JSON-lines telemetry file (`--telemetry-file`: one JSON object per line, "
        "with schema_version and run_id), a spool directory or an export folder"
    )
    if not first.lstrip().startswith(b"{"):
        raise ValueError(f"{path} is not JSON lines: {expected}")
    try:
        doc = orjson.loads(first)
    except orjson.JSONDecodeError as e:
        raise ValueError(f"{path}, line 1 is not JSON ({e}): {expected}") from None
    if not isinstance(doc, dict) or not {"schema_version", "run_id"} <= doc.keys():
        raise ValueError(f"{path}, line 1 is not a telemetry batch: {expected}")


def run_import(path: Path, collector: str, token: str = "", batch_rows: int = 5000) -> int:
    """Send every batch at `path` to `collector`; return the exit status of `trainvitals import`.

    0: all stored, or nothing to do (a spool left empty once its batches were delivered);
    1: some batches rejected or not stored, or the collector unreachable; 2: `path`
    missing, unreadable or of a kind import does not take (nothing is sent then).
    A batch the collector cannot take now (a network error, 5xx, 408, 429) is resent with
    the sender's back-off (sender.post_batch); one it refuses (4xx) is not.
    """
    checks.http_url("--collector", collector)  # ValueError, before anything is read
    if not path.exists():
        print(f"error: {path} does not exist")
        return 2
    try:
        source, ctype = _source(path, batch_rows)
    except NothingToImport as e:
        print(e)
        return 0
    except ValueError as e:
        print(f"error: {e}")
        return 2
    headers = {"content-type": ctype}
    if token:
        headers["authorization"] = f"Bearer {token}"
    url = collector.rstrip("/") + "/api/v1/ingest"
    stored = rejected = failed = 0
    with httpx.Client(timeout=30, headers=headers) as client:
        try:
            for where, body in source:
                posted = post_batch(client, url, body)
                if posted.outcome == "ok":
                    stored += 1
                elif posted.status is None:  # no answer, even after retrying: stop here
                    print(
                        f"error: cannot reach {url} ({posted.reason}; {posted.retries + 1} "
                        f"attempts); {stored} batches stored so far, {rejected + failed} not; "
                        "importing again sends the rest (stored batches stay stored once)"
                    )
                    return 1
                elif posted.outcome == "rejected":
                    rejected += 1
                    print(f"{path}, {where}: rejected ({posted.status}): {posted.reason}")
                else:  # the collector kept failing on this batch: report it, go on
                    failed += 1
                    print(
                        f"{path}, {where}: not stored after {posted.retries + 1} attempts "
                        f"({posted.status}): {posted.reason}"
                    )
        except ValueError as e:  # an export that cannot be read (damaged Parquet, ...)
            print(f"error: {e}; {stored} batches stored so far")
            return 2
    not_stored = f", {failed} not stored (the collector kept failing)" if failed else ""
    print(f"{stored} batches stored, {rejected} rejected{not_stored}, from {path}")
    return 1 if rejected or failed else 0
