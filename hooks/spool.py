"""A directory of batches that could not be delivered yet, resent in order.

Each batch is one file, named by a sequence number, written to a temporary name and renamed
so that a crash never leaves half a batch behind. Resending is safe at any time: every
record has an idempotent key (run, step[, layer or rank]), so a batch the collector already
stored is ignored there.

A batch set aside (the collector keeps failing on it) stays in the folder as
`<number>.failed.json`: no longer resent by the hooks, still sent, in its place, by
`trainvitals import` of the folder.
"""

from __future__ import annotations

import os
from pathlib import Path


class Spool:
    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        # Every numbered file counts, set-aside batches (`N.failed.json`) included: a number
        # is never given twice, so nothing spooled is ever replaced.
        numbers = [_number(p) for p in self.dir.iterdir()]
        self._next = max((n for n in numbers if n is not None), default=-1) + 1

    def put(self, body: bytes) -> None:
        """Keep one batch (raises OSError if the disk refuses)."""
        tmp = self.dir / f"{self._next:012d}.tmp"
        tmp.write_bytes(body)
        try:
            while True:
                number, self._next = self._next, self._next + 1
                final = self.dir / f"{number:012d}.json"
                if final.with_suffix(".failed.json").exists():
                    continue
                try:
                    # A hard link fails where `final` exists (another process spooling into
                    # this folder took the number): a batch is never replaced.
                    os.link(tmp, final)
                    return
                except FileExistsError:
                    continue
        finally:
            tmp.unlink()

    def pending(self) -> list[Path]:
        """Spooled batches, oldest first (not those set aside)."""
        return sorted(p for p in self.dir.glob("*.json") if p.stem.isdigit())

    def set_aside(self, path: Path) -> Path:
        """Keep `path` out of `pending()`, in the folder; returns its new name."""
        aside = path.with_suffix(".failed.json")
        os.replace(path, aside)
        return aside

    def __len__(self) -> int:
        return len(self.pending())


def _number(path: Path) -> int | None:
    """The sequence number of a spool file (`N.json`, `N.failed.json`, `N.tmp`), else None."""
    head = path.name.split(".", 1)[0]
    return int(head) if head.isdigit() else None


def default_spool_dir(rank: int) -> Path:
    """$TRAINVITALS_SPOOL_DIR/rank<k>, else ~/.cache/trainvitals/spool/rank<k>."""
    root = (
        os.environ.get("TRAINVITALS_SPOOL_DIR") or Path.home() / ".cache" / "trainvitals" / "spool"
    )
    return Path(root) / f"rank{rank}"
