"""The fence list: kept in a file; never every node, never more than the policy's share."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainvitals.supervisor.fence import FenceError, FenceList

NODES = ["node0", "node1", "node2", "node3"]


def test_a_fence_is_kept_in_the_file_and_excluded(tmp_path: Path) -> None:
    path = tmp_path / "fence.json"
    fences = FenceList(path, NODES, max_fraction=0.5)
    fences.fence("node2", "sdc at step 20 (rank 9)", now_unix_s=100.0)
    assert fences.remaining() == ["node0", "node1", "node3"]
    assert json.loads(path.read_text())["node2"]["reason"] == "sdc at step 20 (rank 9)"
    assert FenceList(path, NODES, 0.5).remaining() == ["node0", "node1", "node3"]  # reread


def test_fencing_over_the_share_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "fence.json"
    fences = FenceList(path, NODES, max_fraction=0.25)
    fences.fence("node1", "rank_lost")
    before = path.read_text()
    with pytest.raises(FenceError, match="50% of the nodes, over the policy's"):
        fences.fence("node2", "hang")
    assert path.read_text() == before
    assert fences.remaining() == ["node0", "node2", "node3"]


def test_fencing_the_last_node_is_refused() -> None:
    fences = FenceList(None, ["a", "b"], max_fraction=0.99)
    fences.fence("a", "sdc")
    with pytest.raises(FenceError, match="would exclude every node"):
        fences.fence("b", "sdc")
    assert fences.remaining() == ["b"]


def test_a_fence_file_that_excludes_every_node_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "fence.json"
    path.write_text(json.dumps({"a": {"reason": "x"}, "b": {"reason": "y"}}))
    with pytest.raises(FenceError, match="excludes every node of the job"):
        FenceList(path, ["a", "b"], 0.5)


def test_an_unknown_node_is_refused() -> None:
    with pytest.raises(FenceError, match="not a node of this job"):
        FenceList(None, NODES, 0.5).fence("node9", "sdc")
