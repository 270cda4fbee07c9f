"""`trainvitals import`: load telemetry recorded offline into a collector.

Takes a JSON-lines file written by the hooks' JsonlExporter (`--telemetry-file`), or a
spool directory left by an HttpExporter that could not reach its collector. Each batch is
stored whole or not at all, and keys make a second import of the same file a no-op.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx


def batches(path: Path) -> Iterator[tuple[str, bytes]]:
    """(where, body) of every batch in a JSON-lines file or a spool directory, in order."""
    if path.is_dir():
        for file in sorted(path.glob("*.json")):
            yield file.name, file.read_bytes()
        return
    with path.open("rb") as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                yield f"line {number}", line


def run_import(path: Path, collector: str, token: str = "") -> int:
    if not path.exists():
        print(f"error: {path} does not exist")
        return 2
    headers = {"content-type": "application/json"}
    if token:
        headers["authorization"] = f"Bearer {token}"
    url = collector.rstrip("/") + "/api/v1/ingest"
    stored = rejected = 0
    with httpx.Client(timeout=30, headers=headers) as client:
        for where, body in batches(path):
            try:
                resp = client.post(url, content=body)
            except httpx.HTTPError as e:
                print(f"error: cannot reach {url} ({e}); {stored} batches stored so far")
                return 1
            if resp.status_code < 300:
                stored += 1
            else:
                rejected += 1
                detail = resp.json().get("detail", resp.text) if resp.content else resp.status_code
                print(f"{path}, {where}: rejected ({resp.status_code}): {detail}")
    print(f"{stored} batches stored, {rejected} rejected, from {path}")
    return 1 if rejected else 0
