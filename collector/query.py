"""Read-only query API for the dashboard and post-mortems.

Every query is parameterised (`?` placeholders); the only names spliced into SQL are
metric columns checked against the schema. Long ranges are downsampled on the server in
buckets of whole steps, so a full-range query of a long run returns at most a few thousand
points and a spike stays visible (the `_max` columns, and `agg=max` on heatmaps).
"""

from __future__ import annotations

import json
import math
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Annotated, Any, Literal

import orjson
import pyarrow as pa
import pyarrow.compute as pc
from fastapi import APIRouter, Depends, HTTPException, Query, Response

from trainvitals.analyzer.goodput import stored_goodput
from trainvitals.analyzer.live import LiveAnalysis
from trainvitals.schema import LAYERS, RANKS, STEP_BOUNDS, float_to_wire

from .deps import get_analysis, get_store
from .responses import (
    RUN_SUMMARY_FIELDS,
    STEP_MAXIMA,
    STEP_VALUES,
    AlertRow,
    AnalysisProgress,
    EventRow,
    GoodputAnswer,
    LayerGrid,
    NodeGrid,
    NodeSummary,
    RankGrid,
    RankSeries,
    RunHosts,
    RunSummary,
    StepSeries,
)
from .store import Store

router = APIRouter(prefix="/api/v1", tags=["query"])

StoreDep = Annotated[Store, Depends(get_store)]
_FIRST, _LAST = STEP_BOUNDS  # the steps ingest accepts
Start = Annotated[int, Query(ge=_FIRST, le=_LAST, description="first step (inclusive)")]
End = Annotated[
    int | None, Query(ge=_FIRST, le=_LAST, description="last step (inclusive); default: latest")
]
Agg = Literal["max", "mean", "min"]
_AGG_SQL = {"max": "max", "mean": "avg", "min": "min"}

_LAYER_METRICS = tuple(f.name for f in LAYERS.fields if f.name not in ("step", "layer"))
# Layers one request may name: a drill-down follows a few; every layer is the default.
_MAX_LAYERS_ASKED = 100
_RANK_METRICS = tuple(f.name for f in RANKS.fields if f.name not in ("step", "rank"))
# Ranks one request may name: those of a node (8 GPUs; 72 in an NVL72 rack).
_MAX_RANKS_ASKED = 1024


def _columns(table: pa.Table) -> dict[str, list]:
    """Arrow table -> JSON-ready columns. JSON has no literal for NaN or inf: they are
    served in the schema's wire form, the strings "NaN", "Infinity" and "-Infinity"
    (trainvitals/schema/codec.py), as producers send them; null is a value never stored."""
    out = {}
    for field, column in zip(table.schema, table.columns, strict=True):
        values = column.to_pylist()
        if pa.types.is_floating(field.type) and pc.any(pc.invert(pc.is_finite(column))).as_py():
            values = [float_to_wire(v) for v in values]
        out[field.name] = values
    return out


def _served(answer: dict[str, Any]) -> Response:
    """A grid's answer as built: its response_model documents it in /openapi.json but does
    not check it. Checking every value of a large grid (307,200 of a 1,024-rank /ranks
    answer) took 3-5x as long as writing them (bench/response_models.py); the bytes are
    those FastAPI writes for the answer unchecked (tests/collector/test_responses.py)."""
    return Response(orjson.dumps(answer), media_type="application/json")


class _ResponseCache:
    """Answers of the heavy grid queries, kept until the store commits again.

    A dashboard refresh asks the same questions as the one before; a view over a long,
    wide run scans millions of per-rank rows (1,000,000 steps x 1,024 ranks: seconds on
    2 loaded cores, bench/dashboard_scale.py). An answer is valid while the store has
    committed nothing since it was computed (a replayed store never commits). Bounded:
    the least recently used answer goes first; an answer is at most a few MB.
    """

    MAX_ENTRIES = 64

    def __init__(self) -> None:
        self._entries: OrderedDict[tuple, tuple[Any, Any]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, store: Store, key: tuple, compute: Callable[[], Any]) -> Any:
        version = _store_version(store)
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None and hit[0] == version:
                self._entries.move_to_end(key)
                return hit[1]
        value = compute()
        with self._lock:
            self._entries[key] = (version, value)
            self._entries.move_to_end(key)
            while len(self._entries) > self.MAX_ENTRIES:
                self._entries.popitem(last=False)
        return value


def _store_version(store: Store) -> Any:
    """Changes whenever the store commits; constant for a read-only (replayed) store."""
    if getattr(store, "read_only", False):
        return ("read-only", id(store))
    writes = getattr(store, "writes", None)  # counted before the commit is acknowledged
    return (id(store), getattr(writes, "commits", None), getattr(writes, "written_batches", None))


_cache = _ResponseCache()


def _require_run(store: Store, run_id: str) -> None:
    """404 unless the run has a runs or steps row: what /runs lists (see _why_not_served)."""
    found = store.query(
        "SELECT 1 FROM steps WHERE run_id = ? "
        "UNION ALL SELECT 1 FROM runs WHERE run_id = ? LIMIT 1",
        [run_id, run_id],
    )
    if found.num_rows == 0:
        raise HTTPException(404, f"no run {run_id!r} in this store{_why_not_served(store, run_id)}")


def _why_not_served(store: Store, run_id: str) -> str:
    """Why a run with rows in other tables only is not served, or '' if it has none.

    A run is listed, and served, from its first runs or steps row, which the hooks send
    first. Listing runs found in the per-rank tables too would scan those, the largest,
    on every poll of /runs; this check costs that only for an unknown run.
    """
    held = [
        t
        for t in ("ranks", "layers", "events")
        if store.query(f"SELECT 1 FROM {t} WHERE run_id = ? LIMIT 1", [run_id]).num_rows
    ]
    if not held:
        return ""
    return (
        f": it has {' and '.join(held)} rows only; a run is served once its runs or "
        "steps rows are stored"
    )


def _step_window(
    store: Store, run_id: str, start: int, end: int | None, points: int
) -> tuple[int, int, int]:
    """(start, end, bucket_steps) for a window holding at most `points` buckets."""
    if end is None:
        latest = (
            store.query("SELECT coalesce(max(step), 0) FROM steps WHERE run_id = ?", [run_id])
            .column(0)[0]
            .as_py()
        )
        # A window after the latest step is empty, not an error: a client following a
        # live run asks for the steps after the ones it has, before they exist.
        end = max(start, latest)
    if end < start:
        raise HTTPException(422, f"end ({end}) is before start ({start})")
    return start, end, max(1, math.ceil((end - start + 1) / points))


@router.get("/runs", response_model=list[RunSummary])
def list_runs(store: StoreDep) -> list[dict[str, Any]]:
    """Every run in the store that logged a step, newest first, with its metadata and
    progress. A run that attached and closed without a step trained nothing: not listed."""
    return _cache.get(store, ("runs",), lambda: _list_runs(store))


def _list_runs(store: Store) -> list[dict[str, Any]]:
    rows = store.query(
        f"""
        WITH progress AS (
            SELECT run_id, max(step) AS last_step, max(time_unix_s) AS last_time_unix_s
            FROM steps GROUP BY run_id),
        ids AS (SELECT run_id FROM progress)
        SELECT ids.run_id, {", ".join(f"r.{name}" for name in RUN_SUMMARY_FIELDS)},
               r.layer_names_json, p.last_step, p.last_time_unix_s
        FROM ids LEFT JOIN runs r USING (run_id) LEFT JOIN progress p USING (run_id)
        ORDER BY coalesce(r.started_unix_s, p.last_time_unix_s) DESC NULLS LAST
        """
    ).to_pylist()
    for row in rows:
        row["layer_names"] = _layer_names(row.pop("layer_names_json"))
    return rows


def _layer_names(text: str | None) -> list | None:
    """A run's layer names; None if it has none, or if a store from before ingest checked
    them holds text that is not a JSON list (one bad row must not fail every run's list)."""
    try:
        names = json.loads(text) if text else None
    except json.JSONDecodeError:
        return None
    return names if isinstance(names, list) else None


@router.get("/runs/{run_id}/steps", response_model=StepSeries)
def step_series(
    run_id: str,
    store: StoreDep,
    start: Start = 0,
    end: End = None,
    max_points: Annotated[int, Query(ge=1, le=100_000)] = 2000,
) -> dict[str, Any]:
    """Step series in at most `max_points` buckets: means, plus maxima of loss and grad norm."""
    _require_run(store, run_id)
    start, end, bucket = _step_window(store, run_id, start, end, max_points)
    return _cache.get(
        store,
        ("steps", run_id, start, end, bucket),
        lambda: _step_buckets(store, run_id, start, end, bucket),
    )


def _step_buckets(store: Store, run_id: str, start: int, end: int, bucket: int) -> dict[str, Any]:
    values = [f"avg({c}) AS {c}" for c in STEP_VALUES] + [
        f"max({c}) AS {c}_max" for c in STEP_MAXIMA
    ]
    table = store.query(
        f"""
        SELECT min(step) AS step, {", ".join(values)}
        FROM steps WHERE run_id = ? AND step BETWEEN ? AND ?
        GROUP BY (step - ?) // ? ORDER BY 1
        """,
        [run_id, start, end, start, bucket],
    )
    return {"bucket_steps": bucket, "columns": _columns(table)}


def _grid(
    store: Store,
    table: str,
    key: str,
    values: dict[str, tuple[str, Agg]],
    run_id: str,
    start: int,
    end: int | None,
    max_steps: int,
    keys: list[int] | None = None,
) -> dict[str, Any]:
    """Step x `key` grid of `values` (answer column -> (metric, agg)), from one scan: a
    scan of a wide run's rank rows costs about the same for one aggregate as for ten
    (10^7 rows: 0.16 s for one, 0.17 s for three, bench/dashboard_scale.py's store)."""
    start, end, bucket = _step_window(store, run_id, start, end, max_steps)
    asked = tuple(values.items())
    cache_key = (table, key, asked, run_id, start, end, bucket, tuple(keys or ()))
    return _cache.get(
        store,
        cache_key,
        lambda: _grid_query(store, table, key, values, run_id, start, end, bucket, keys),
    )


def _grid_query(
    store: Store,
    table: str,
    key: str,
    values: dict[str, tuple[str, Agg]],
    run_id: str,
    start: int,
    end: int,
    bucket: int,
    keys: list[int] | None,
) -> dict[str, Any]:
    only = f"AND list_contains(?, {key})" if keys else ""
    aggregates = ", ".join(f'{_AGG_SQL[a]}({m}) AS "{name}"' for name, (m, a) in values.items())
    result = store.query(
        f"""
        SELECT ? + (step - ?) // ? * ? AS step, {key}, {aggregates}
        FROM {table} WHERE run_id = ? AND step BETWEEN ? AND ? {only}
        GROUP BY 1, 2 ORDER BY 1, 2
        """,
        [start, start, bucket, bucket, run_id, start, end, *([keys] if keys else [])],
    )
    return {"bucket_steps": bucket, **_columns(result)}


@router.get("/runs/{run_id}/layers", response_model=LayerGrid)
def layer_series(
    run_id: str,
    store: StoreDep,
    metric: Annotated[str, Query(description=f"one of {_LAYER_METRICS}")] = "grad_norm",
    start: Start = 0,
    end: End = None,
    max_steps: Annotated[int, Query(ge=1, le=10_000)] = 300,
    agg: Agg = "max",
    layer: Annotated[list[int] | None, Query(description="only these layer indices")] = None,
) -> Response:
    """Step x layer grid of one per-layer metric, long format (step, layer, value);
    `layer` (repeatable) keeps to those layers, as a drill-down into a few needs."""
    if metric not in _LAYER_METRICS:
        raise HTTPException(422, f"metric must be one of {list(_LAYER_METRICS)}, got {metric!r}")
    if layer and (len(layer) > _MAX_LAYERS_ASKED or min(layer) < 0):
        raise HTTPException(
            422, f"layer: at most {_MAX_LAYERS_ASKED} indices, none negative, got {layer[:5]}"
        )
    _require_run(store, run_id)
    names = store.query("SELECT layer_names_json FROM runs WHERE run_id = ?", [run_id]).to_pylist()
    values = {"value": (metric, agg)}
    grid = _grid(store, "layers", "layer", values, run_id, start, end, max_steps, layer)
    names_doc = _layer_names(names[0]["layer_names_json"]) if names else None
    return _served({"layer_names": names_doc, **grid})


@router.get("/runs/{run_id}/ranks", response_model=RankSeries)
def rank_series(
    run_id: str,
    store: StoreDep,
    metric: Annotated[str, Query(description=f"one of {_RANK_METRICS}")] = "step_time_s",
    start: Start = 0,
    end: End = None,
    max_steps: Annotated[int, Query(ge=1, le=10_000)] = 300,
    agg: Agg = "max",
) -> Response:
    """Step x rank grid of one per-rank metric, long format (step, rank, value)."""
    if metric not in _RANK_METRICS:
        raise HTTPException(422, f"metric must be one of {list(_RANK_METRICS)}, got {metric!r}")
    _require_run(store, run_id)
    values = {"value": (metric, agg)}
    return _served(_grid(store, "ranks", "rank", values, run_id, start, end, max_steps))


@router.get("/runs/{run_id}/ranks/grid", response_model=RankGrid)
def rank_grid(
    run_id: str,
    store: StoreDep,
    metric: Annotated[list[str], Query(description=f"repeatable; each one of {_RANK_METRICS}")],
    agg: Annotated[
        list[Agg] | None, Query(description="one per metric, or one for all (default max)")
    ] = None,
    start: Start = 0,
    end: End = None,
    max_steps: Annotated[int, Query(ge=1, le=10_000)] = 300,
    rank: Annotated[list[int] | None, Query(description="only these ranks")] = None,
) -> Response:
    """Several per-rank metrics on one step x rank grid, from one scan of the rank rows:
    columns step, rank and one `<agg>_<metric>` per pair (at most one pair each). Each
    pair's values are those `/ranks` answers for it alone; a view that shows several
    asks once instead of scanning the rows once per metric. `rank` (repeatable) keeps to
    those ranks, as the ranks of one node need."""
    aggs = agg or ["max"]
    if len(aggs) not in (1, len(metric)):
        raise HTTPException(422, f"agg: one per metric ({len(metric)}) or one, got {len(aggs)}")
    unknown = [m for m in metric if m not in _RANK_METRICS]
    if unknown:
        raise HTTPException(422, f"metric must be among {list(_RANK_METRICS)}, got {unknown}")
    pairs = list(zip(metric, aggs * len(metric) if len(aggs) == 1 else aggs, strict=True))
    values = {f"{a}_{m}": (m, a) for m, a in pairs}
    if len(values) < len(pairs):
        raise HTTPException(422, "each (metric, agg) pair at most once")
    if rank and (len(rank) > _MAX_RANKS_ASKED or min(rank) < 0):
        raise HTTPException(
            422, f"rank: at most {_MAX_RANKS_ASKED} indices, none negative, got {rank[:5]}"
        )
    _require_run(store, run_id)
    return _served(_grid(store, "ranks", "rank", values, run_id, start, end, max_steps, rank))


# Per node, how its ranks' values make the node's: a node moves as many tokens and draws as
# much power as its ranks together, is as slow as its slowest rank, and each rank reports
# its node's network and interconnect rates (the same value on every rank of the node).
_NODE_AGG = {
    "tokens_per_s": "sum",
    "power_w": "sum",
    "energy_j": "sum",
    "step_time_s": "max",
    "compute_time_s": "max",
    "data_time_s": "max",
    "stopped_time_s": "max",
    "wait_time_s": "avg",
    "temperature_c": "max",
    "memory_used_bytes": "max",
    **{
        f"{net}_{way}_bytes_per_s": "avg" for net in ("net", "ib", "nvlink") for way in ("rx", "tx")
    },
}
_NODE_METRICS = tuple(_NODE_AGG)


def _node_expr(metric: str, tp: int) -> str:
    """SQL of one step's value of a node from its ranks' rows. The ranks of a
    tensor-parallel group train on the same tokens and each reports them: a node's tokens
    are its ranks' sum / tp (the group lies within the node)."""
    expr = f"{_NODE_AGG[metric]}({metric})"
    return f"{expr} / {tp}" if metric == "tokens_per_s" and tp > 1 else expr


def _tp(store: Store, run_id: str) -> int:
    rows = store.query("SELECT tp FROM runs WHERE run_id = ?", [run_id]).to_pylist()
    return int(rows[0]["tp"] or 1) if rows else 1


def _hosts(store: Store, run_id: str) -> list[str] | None:
    """Host name of each rank (index: rank), from the run's metadata; None if not sent."""
    rows = store.query("SELECT hosts_json FROM runs WHERE run_id = ?", [run_id]).to_pylist()
    text = rows[0]["hosts_json"] if rows else None
    names = _layer_names(text)  # the same JSON-list check
    return [str(h) for h in names] if names else None


@router.get("/runs/{run_id}/nodes", response_model=NodeGrid)
def node_series(
    run_id: str,
    store: StoreDep,
    metric: Annotated[str, Query(description=f"one of {_NODE_METRICS}")] = "step_time_s",
    start: Start = 0,
    end: End = None,
    max_steps: Annotated[int, Query(ge=1, le=10_000)] = 300,
    agg: Agg = "max",
) -> Response:
    """Step x node grid of one per-rank metric, its ranks grouped by host (long format:
    step, node, value; `hosts` names node i, `ranks_per_node` counts its ranks).

    Within a step a node's value combines its ranks' (_NODE_AGG: a sum of throughput and
    power, the max of times); over a bucket of steps `agg` combines the steps'. A run
    that did not send its hosts has `hosts` null and no rows.
    """
    if metric not in _NODE_METRICS:
        raise HTTPException(422, f"metric must be one of {list(_NODE_METRICS)}, got {metric!r}")
    _require_run(store, run_id)
    hosts = _hosts(store, run_id)
    start, end, bucket = _step_window(store, run_id, start, end, max_steps)
    if not hosts:
        return _served({"bucket_steps": bucket, "hosts": None, "ranks_per_node": None,
                        "step": [], "node": [], "value": []})  # fmt: skip
    names, node_of, counts = _nodes_of(hosts)
    if _NODE_AGG[metric] == "max" and agg == "max":
        # The max over a bucket's steps of each step's max over the node's ranks is the
        # max over the bucket's rank rows: no per-step grouping (1.3 10^6 groups for
        # 10^7 rank rows), a grid like the ranks' (about half the time).
        sql = f"""
            SELECT ? + (step - ?) // ? * ? AS step, (?::BIGINT[])[rank + 1] AS node,
                   max({metric}) AS value
            FROM ranks WHERE run_id = ? AND step BETWEEN ? AND ? AND rank BETWEEN 0 AND ?
            GROUP BY 1, 2 ORDER BY 1, 2
            """
        params = [start, start, bucket, bucket, node_of, run_id, start, end, len(node_of) - 1]
    else:
        sql = f"""
            WITH {_PER_NODE_STEP.format(values=f"{_node_expr(metric, _tp(store, run_id))} AS v")}
            SELECT ? + (step - ?) // ? * ? AS step, node, {_AGG_SQL[agg]}(v) AS value
            FROM per_step GROUP BY 1, 2 ORDER BY 1, 2
            """
        node_params = _per_node_step_params(node_of, run_id, start, end)
        params = [*node_params, start, start, bucket, bucket]
    key = ("nodes", metric, run_id, start, end, bucket, agg)
    result = _cache.get(store, key, lambda: store.query(sql, params))
    return _served({"bucket_steps": bucket, "hosts": names, "ranks_per_node": counts,
                    **_columns(result)})  # fmt: skip


@router.get("/runs/{run_id}/nodes/summary", response_model=NodeSummary)
def node_summary(
    run_id: str,
    store: StoreDep,
    start: Start = 0,
    end: End = None,
    metric: Annotated[
        list[str] | None, Query(description=f"only these (repeatable) of {_NODE_METRICS}")
    ] = None,
) -> dict[str, Any]:
    """Per node (ranks grouped by host) over the window: each _NODE_AGG metric (or each
    one asked) combined over the node's ranks at each step (a sum of throughput and power,
    the max of times), then averaged over the logged steps. Columns: node, host, ranks,
    then the metrics; no rows if the run did not send its hosts. Each metric costs about
    as much as the rest together: a view asks for those it shows."""
    metrics = tuple(metric or _NODE_METRICS)
    unknown = [m for m in metrics if m not in _NODE_METRICS]
    if unknown:
        raise HTTPException(422, f"metric must be among {list(_NODE_METRICS)}, got {unknown}")
    _require_run(store, run_id)
    hosts = _hosts(store, run_id)
    start, end, _ = _step_window(store, run_id, start, end, 1)
    if not hosts:
        return {"node": [], "host": [], "ranks": [], **{m: [] for m in metrics}}
    names, node_of, counts = _nodes_of(hosts)
    columns = _cache.get(
        store,
        ("node_summary", run_id, start, end, metrics),
        lambda: _node_means(store, run_id, node_of, start, end, metrics),
    )
    return {
        "node": columns["node"],
        "host": [names[n] for n in columns["node"]],
        "ranks": [counts[n] for n in columns["node"]],
        **{m: columns[m] for m in metrics},
    }


def _node_means(
    store: Store, run_id: str, node_of: list[int], start: int, end: int, metrics: tuple[str, ...]
) -> dict[str, list]:
    """Columns node, then each of `metrics`' mean over the window's steps of its per-step
    node value. A metric no rank reported in the window is null for every node without
    being aggregated: over 10^7 rank rows each aggregate costs about 0.1 s (2 cores)."""
    params = _per_node_step_params(node_of, run_id, start, end)
    counted = ", ".join(f"count({m}) AS {m}" for m in metrics)
    counts = store.query(
        f"SELECT {counted} FROM ranks WHERE run_id = ? AND step BETWEEN ? AND ?",
        [run_id, start, end],
    ).to_pylist()[0]
    reported = [m for m in metrics if counts[m]]
    if not reported:
        nodes = store.query(
            f"WITH {_PER_NODE_STEP.format(values='1 AS v')} "
            "SELECT DISTINCT node FROM per_step ORDER BY node",
            params,
        ).column("node")
        return {"node": nodes.to_pylist(), **{m: [None] * len(nodes) for m in metrics}}
    tp = _tp(store, run_id)
    per_step = ", ".join(f"{_node_expr(m, tp)} AS {m}" for m in reported)
    means = ", ".join(f"avg({m}) AS {m}" for m in reported)
    sql = f"""
        WITH {_PER_NODE_STEP.format(values=per_step)}
        SELECT node, {means} FROM per_step GROUP BY node ORDER BY node
        """
    columns = _columns(store.query(sql, params))
    rows = len(columns["node"])
    return {m: columns.get(m, [None] * rows) for m in ("node", *metrics)}


# Each logged step's value of each node, from its ranks' rows (`values`: SQL over them).
# A rank's node is looked up by index in a list parameter, not joined with a (rank, node)
# table (the join took 1.2 to 2 times as long over 10^7 rank rows, 2 loaded cores).
_PER_NODE_STEP = """per_step AS (
    SELECT step, (?::BIGINT[])[rank + 1] AS node, {values}
    FROM ranks WHERE run_id = ? AND step BETWEEN ? AND ? AND rank BETWEEN 0 AND ?
    GROUP BY step, node)"""


def _per_node_step_params(node_of: list[int], run_id: str, start: int, end: int) -> list[Any]:
    return [node_of, run_id, start, end, len(node_of) - 1]


def _nodes_of(hosts: list[str]) -> tuple[list[str], list[int], list[int]]:
    """(node names sorted, node index of each rank, ranks of each node)."""
    names = sorted(set(hosts))
    position = {h: i for i, h in enumerate(names)}
    node_of = [position[h] for h in hosts]
    counts = [0] * len(names)
    for n in node_of:
        counts[n] += 1
    return names, node_of, counts


@router.get("/runs/{run_id}/hosts", response_model=RunHosts)
def run_hosts(run_id: str, store: StoreDep) -> dict[str, Any]:
    """Host name of each rank (`hosts[rank]`), null if the run did not send them."""
    _require_run(store, run_id)
    return {"hosts": _hosts(store, run_id)}


@router.get("/runs/{run_id}/goodput", response_model=GoodputAnswer)
def run_goodput(run_id: str, store: StoreDep) -> dict[str, Any]:
    """The run's goodput as the analyzer defines it (analyzer/goodput.py), the figure
    `trainvitals replay` prints: wall time, productive time, ratio and what was lost."""
    _require_run(store, run_id)
    return _cache.get(store, ("goodput", run_id), lambda: _goodput(store, run_id))


def _goodput(store: Store, run_id: str) -> dict[str, Any]:
    doc = stored_goodput(run_id, store.query).to_dict()
    return {k: float_to_wire(v) for k, v in doc.items()}


@router.get("/runs/{run_id}/alerts", response_model=list[AlertRow])  # type: ignore[valid-type]
def run_alerts(run_id: str, store: StoreDep) -> list[dict[str, Any]]:
    """The run's alerts in step order."""
    _require_run(store, run_id)
    return _alert_rows(store, "WHERE run_id = ? ORDER BY step", [run_id])


@router.get("/runs/{run_id}/analysis", response_model=AnalysisProgress)
def run_analysis(
    run_id: str, store: StoreDep, analysis: Annotated[LiveAnalysis | None, Depends(get_analysis)]
) -> dict[str, Any]:
    """How far the live analysis has come with the run: once it has caught up, the run's
    alerts are all stored. The supervisor reads it when a job ends, before its last look
    at the alerts."""
    _require_run(store, run_id)
    row = store.query("SELECT max(step) AS s FROM steps WHERE run_id = ?", [run_id])
    stored = row.column("s")[0].as_py()
    if analysis is None:
        analysed, pending = None, False
    else:
        analysed, waiting = analysis.progress(run_id)
        # unfinished_tasks, not the queue's size: a batch taken off the queue is not
        # committed (nor handed to the analysis) until the writer marks it done.
        pending = waiting or store.unwritten_batches > 0
    caught_up = analysis is not None and not pending and (stored is None or analysed == stored)
    return {"run_id": run_id, "live": analysis is not None, "stored_step": stored,
            "analysed_step": analysed, "pending": pending, "caught_up": caught_up}  # fmt: skip


@router.get("/runs/{run_id}/events", response_model=list[EventRow])  # type: ignore[valid-type]
def run_events(run_id: str, store: StoreDep) -> list[dict[str, Any]]:
    """The run's events in step order: injected faults (ground truth), restarts, checkpoints."""
    _require_run(store, run_id)
    table = store.query("SELECT * FROM events WHERE run_id = ? ORDER BY step, rank", [run_id])
    return _rows(_columns(table))


@router.get("/alerts", response_model=list[AlertRow])  # type: ignore[valid-type]
def all_alerts(
    store: StoreDep, limit: Annotated[int, Query(ge=1, le=10_000)] = 1000
) -> list[dict[str, Any]]:
    """The most recent alerts of every run."""
    return _alert_rows(store, "ORDER BY time_unix_s DESC, step DESC", [], limit)


def _alert_rows(
    store: Store, where_order: str, params: list, limit: int = 100_000
) -> list[dict[str, Any]]:
    table = store.query(f"SELECT * FROM alerts {where_order} LIMIT ?", [*params, limit])
    return _rows(_columns(table))


def _rows(cols: dict[str, list]) -> list[dict[str, Any]]:
    """Columns -> one dict per row."""
    return [dict(zip(cols, row, strict=True)) for row in zip(*cols.values(), strict=True)]
