"""The fence list: nodes the next launch excludes, and why; kept in a JSON file.

    {"node1": {"reason": "sdc at step 20 (rank 2)", "time_unix_s": 1795000000.0}}

The file outlives the supervisor (a restart of the supervisor keeps the fences); a person
removes a node once it is repaired. A fence that would leave no node, or more than the
policy's share of the nodes fenced, is refused and the list is left as it was.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path


class FenceError(ValueError):
    """A fence that is refused; nothing was changed."""


class FenceList:
    def __init__(self, path: Path | None, nodes: list[str], max_fraction: float) -> None:
        """path None: kept in memory only. nodes: every node of the job, in rank order."""
        self.path, self.nodes, self.max_fraction = path, list(nodes), max_fraction
        self.fenced: dict[str, dict] = {}
        if path is not None and path.exists():
            try:
                fenced = json.loads(path.read_text())
            except ValueError as e:
                raise FenceError(f"fence list {path}: not valid JSON: {e}") from e
            if not isinstance(fenced, dict):
                raise FenceError(f"fence list {path}: expected an object of node: reason")
            self.fenced = fenced
        if not self.remaining():
            raise FenceError(
                f"fence list {path}: it excludes every node of the job ({', '.join(nodes)}); "
                "remove a repaired node from it before starting"
            )

    def remaining(self) -> list[str]:
        """The nodes a launch may use, in rank order."""
        return [n for n in self.nodes if n not in self.fenced]

    def check(self, node: str) -> None:
        """FenceError unless fencing `node` is allowed."""
        if node not in self.nodes:
            raise FenceError(f"cannot fence {node!r}: not a node of this job ({self.nodes})")
        if node in self.fenced:
            return
        left = [n for n in self.remaining() if n != node]
        if not left:
            raise FenceError(f"fencing {node} would exclude every node of the job")
        share = (len(self.fenced) + 1) / len(self.nodes)
        if share > self.max_fraction:
            raise FenceError(
                f"fencing {node} would fence {share:.0%} of the nodes, over the policy's "
                f"limits.max_fenced_fraction {self.max_fraction:.0%}"
            )

    def fence(self, node: str, reason: str, now_unix_s: float | None = None) -> None:
        self.check(node)
        self.fenced[node] = {"reason": reason, "time_unix_s": now_unix_s or time.time()}
        if self.path is not None:
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text(json.dumps(self.fenced, indent=1))
            os.replace(tmp, self.path)  # atomic: a reader sees the old or the new list
