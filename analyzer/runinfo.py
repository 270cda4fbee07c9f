"""What detectors know about a run, from its `runs` row, and the names alerts give things.

Layers and ranks travel as indices (layers.layer, ranks.rank); people know them by name:
layer index 2 of the reference trainer is `layers.1` (index 0 is `tok_embeddings`), and a
rank is a process on a host. Every alert message names a layer with `name_layer` and a
rank with `name_rank` / `name_ranks`; the index stays in the alert's `layer` / `rank`.

The engine builds one RunInfo per run from its runs row (again only when the row
changes), not per step; each StepView carries it as `step.run`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

_LIST_LIMIT = 8  # ranks spelled out in one message; the rest are counted


@dataclass(frozen=True)
class RunInfo:
    """A run's layout and names. Empty names: the run did not report them (or not yet)."""

    tp: int = 1  # tensor-parallel degree: data-parallel peers share a tp index
    layer_names: tuple[str, ...] = ()  # name of layer index 0, 1, ...
    hosts: tuple[str, ...] = ()  # host of rank 0, 1, ...
    world_size: int = 0  # ranks in the run (0: not reported)
    device_type: str = ""  # "cuda", "cpu", ... ("": not reported)
    # A dynamic loss scaler (fp16's GradScaler) overflows the gradients now and then by design
    dynamic_loss_scaling: bool = False

    @classmethod
    def from_runs(cls, runs: Any) -> RunInfo | None:
        """From the last row of an Arrow `runs` table; None when there is no row.

        A field that is missing, null or not a list of strings (a store older than the
        field) leaves those names empty: alerts then fall back to indices.
        """
        if runs is None or runs.num_rows == 0:
            return None
        row = runs.slice(runs.num_rows - 1).to_pylist()[0]
        tp = row.get("tp")
        return cls(
            tp=tp if isinstance(tp, int) and tp >= 1 else 1,
            layer_names=_names(row.get("layer_names_json")),
            hosts=_names(row.get("hosts_json")),
            world_size=world if isinstance(world := row.get("world_size"), int) else 0,
            device_type=kind if isinstance(kind := row.get("device_type"), str) else "",
            dynamic_loss_scaling=row.get("loss_scaling") == "dynamic",
        )


UNKNOWN = RunInfo()  # a run whose runs row has not arrived: indices, no hosts, tp = 1


def host_is_device(device_type: str | None) -> bool:
    """Whether a run's ranks compute on their host (CPU, or not reported): there a rank's
    host times are its work's. An accelerator's host runs ahead of it and waits for it
    where the loop syncs (a rank-0-only `loss.item()` after the step lands in rank 0's
    data time), so its host times are no straggler's evidence."""
    return device_type in ("", "cpu", None)


def _names(text: Any) -> tuple[str, ...]:
    if not isinstance(text, str):
        return ()
    try:
        names = json.loads(text)
    except ValueError:
        return ()
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        return ()
    return tuple(names)


def name_layer(run: RunInfo, index: int) -> str:
    """'layers.1' (the run's name for layer index 2), or 'layer 2' when it has none."""
    index = int(index)
    if 0 <= index < len(run.layer_names) and run.layer_names[index]:
        return run.layer_names[index]
    return f"layer {index}"


def name_rank(run: RunInfo, rank: int) -> str:
    """'rank 3 on host-b', or 'rank 3' when the run did not say where rank 3 runs."""
    return rank_on(rank, _host(run, rank))


def rank_on(rank: int, host: str) -> str:
    """'rank 3 on host-b' from a host known otherwise (a heartbeat carries its own)."""
    return f"rank {int(rank)}{_on(host)}"


def name_ranks(run: RunInfo, ranks: Sequence[int], limit: int = _LIST_LIMIT) -> str:
    """'rank 3 on host-b'; 'ranks 1, 3 on host-a'; 'ranks 1 on host-a, 6 on host-b';
    'ranks 1, 2, ... and 40 more': at most `limit` ranks spelled out."""
    ranks = [int(r) for r in ranks]
    if len(ranks) == 1:
        return name_rank(run, ranks[0])
    shown = ranks[:limit]
    more = f" and {len(ranks) - limit} more" if len(ranks) > limit else ""
    hosts = [_host(run, r) for r in shown]
    if len(set(hosts)) == 1:  # one host (or none known): say it once
        return f"ranks {', '.join(map(str, shown))}{_on(hosts[0])}{more}"
    listed = ", ".join(f"{r}{_on(h)}" for r, h in zip(shown, hosts, strict=True))
    return f"ranks {listed}{more}"


def _host(run: RunInfo, rank: int) -> str:
    return run.hosts[rank] if 0 <= rank < len(run.hosts) else ""


def _on(host: str) -> str:
    return f" on {host}" if host else ""
