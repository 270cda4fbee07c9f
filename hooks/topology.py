"""Which ranks share a node, and the node's own process group.

Per-rank rows travel within a node (DESIGN.md, invariant 2): each node's leader, its lowest
rank, gathers its ranks' slots over a group of the node's ranks and exports them, so that
no rank handles more rows than its node has ranks.

A node is a torchrun agent: the host name and the agent's GROUP_RANK. Two agents on one
machine (a two-node test on 127.0.0.1) are two nodes; a process started without torchrun
counts its host as the node.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

# Node groups made so far, by their ranks: a monitor attached again (after close) reuses
# its node's group, whose name (a hash of the ranks) can be registered only once.
_GROUPS: dict[tuple[int, ...], Any] = {}


def node_key() -> str:
    """This process's node: 'host/GROUP_RANK' ('host/' without torchrun)."""
    return f"{socket.gethostname()}/{os.environ.get('GROUP_RANK', '')}"


@dataclass(frozen=True)
class Node:
    """This rank's node: its ranks (ascending, global), the node's index among the nodes
    (by lowest rank), and the group to gather over (None when the node is this rank alone)."""

    ranks: tuple[int, ...]
    index: int
    group: Any = None

    @property
    def leader(self) -> int:
        return self.ranks[0]

    def local_index(self, rank: int) -> int:
        return self.ranks.index(rank)


def find_node(keys: list[str], rank: int, world_group: Any = None) -> Node:
    """The node of `rank`, given every rank's node_key() (gathered once, at attach).

    The group is `world_group` when the node holds every rank; otherwise a new group of the
    node's ranks, made by them alone (use_local_synchronization: the other nodes' ranks take
    no part, so attach costs each rank O(its node), not O(nodes))."""
    mine = keys[rank]
    ranks = tuple(r for r, k in enumerate(keys) if k == mine)
    index = list(dict.fromkeys(keys)).index(mine)  # nodes in order of their lowest rank
    if len(ranks) == len(keys):
        return Node(ranks, index, world_group)
    if len(ranks) == 1:
        return Node(ranks, index, None)
    group = _GROUPS.get(ranks)
    if group is None:
        group = _GROUPS[ranks] = dist.new_group(list(ranks), use_local_synchronization=True)
    return Node(ranks, index, group)
