"""A typed client for the collector's query API: what the dashboard reads, as DataFrames.

Every call is one GET. Failures surface as typed errors the dashboard can turn into an
honest message: `CollectorUnavailable` (nothing answers at the URL), `RunNotFound` (404),
`CollectorError` (any other bad answer).

    >>> client = CollectorClient("http://127.0.0.1:8000")  # doctest: +SKIP
    >>> runs = client.runs()  # doctest: +SKIP
    >>> steps = client.steps(runs[0].run_id, max_points=500)  # doctest: +SKIP
    >>> steps.frame[["step", "loss"]].tail()  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any

import httpx
import pandas as pd

from trainvitals.schema import float_from_wire

DEFAULT_URL = "http://127.0.0.1:8000"
API = "/api/v1"
EVENT_COLUMNS = ("step", "rank", "kind", "detail", "time_unix_s")
ALERT_COLUMNS = (
    "time_unix_s",
    "severity",
    "kind",
    "step",
    "rank",
    "layer",
    "message",
    "value",
    "baseline",
)


class CollectorError(RuntimeError):
    """The collector answered, but not with what the API promises."""


class CollectorUnavailable(CollectorError):
    """Nothing answered at the collector URL (refused, unresolvable or timed out)."""


class RunNotFound(CollectorError, LookupError):
    """The collector holds no run with this id (HTTP 404)."""


@dataclass(frozen=True)
class RunSummary:
    """One entry of `GET /runs`. Metadata is None when the run sent none."""

    run_id: str
    model: str | None = None
    world_size: int | None = None
    dp: int | None = None
    tp: int | None = None
    device_name: str | None = None
    device_type: str | None = None
    started_unix_s: float | None = None
    last_step: int | None = None
    last_time_unix_s: float | None = None
    layer_names: tuple[str, ...] = ()
    peak_flops_per_s: float | None = None
    flops_per_token: float | None = None
    flops_source: str | None = None  # 'configured', or how flops_per_token was estimated
    n_params: int | None = None
    # Power and token target: None from a collector that does not serve them yet.
    power_source: str | None = None
    power_unavailable: str | None = None
    token_target: int | None = None

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> RunSummary:
        """Build from the API's JSON; fields this client does not know are ignored."""
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in doc.items() if k in known}
        values["layer_names"] = tuple(doc.get("layer_names") or ())
        return cls(**values)


@dataclass(frozen=True)
class Series:
    """A downsampled query result: each row stands for `bucket_steps` consecutive steps."""

    bucket_steps: int
    frame: pd.DataFrame


class CollectorClient:
    """Synchronous client over httpx; one connection pool, safe to share between threads."""

    def __init__(
        self, base_url: str = DEFAULT_URL, timeout_s: float = 5.0, token: str | None = None
    ) -> None:
        """`token`: the collector's read token; None reads TRAINVITALS_READ_TOKEN, else
        TRAINVITALS_INGEST_TOKEN (a collector with one token for both), the variables the
        collector itself reads."""
        self.base_url = base_url.rstrip("/")
        if token is None:
            token = os.environ.get("TRAINVITALS_READ_TOKEN") or os.environ.get(
                "TRAINVITALS_INGEST_TOKEN", ""
            )
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout_s, headers=headers)

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    def __enter__(self) -> CollectorClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def healthz(self) -> dict[str, Any]:
        """The collector's health document, e.g. {"status": "ok", ...}."""
        return self._get("/healthz")

    def runs(self) -> list[RunSummary]:
        """All runs the collector holds, newest first."""
        return [RunSummary.from_json(doc) for doc in self._get(f"{API}/runs")]

    def steps(
        self,
        run_id: str,
        start: int | None = None,
        end: int | None = None,
        max_points: int = 2000,
    ) -> Series:
        """Per-step global metrics; one row per bucket (mean, plus max of loss and grad norm).

        NaN and inf arrive in the schema's wire form and become NaN and inf; a value never
        stored (null) becomes NaN too.
        """
        params = _window(start, end) | {"max_points": max_points}
        doc = self._get(f"{API}/runs/{run_id}/steps", params)
        frame = pd.DataFrame({name: _floats(values) for name, values in doc["columns"].items()})
        frame["step"] = frame["step"].astype("int64")
        return Series(bucket_steps=doc["bucket_steps"], frame=frame)

    def layers(
        self,
        run_id: str,
        metric: str = "grad_norm",
        start: int | None = None,
        end: int | None = None,
        max_steps: int = 300,
        agg: str = "max",
        only: list[int] | None = None,
    ) -> Series:
        """Per-layer `metric` in long format: columns step, layer (index), layer_name, value,
        nonfinite; `only`: these layer indices, not all.

        `value` is NaN both where the run measured NaN and where it measured nothing (null
        in the store); `nonfinite` tells them apart: True where the collector served NaN
        or inf (in the schema's wire form), a cell the heatmaps draw in red.
        """
        params = _window(start, end) | {"metric": metric, "max_steps": max_steps, "agg": agg}
        if only:
            params["layer"] = list(only)
        doc = self._get(f"{API}/runs/{run_id}/layers", params)
        frame = _long_frame(doc, "layer").assign(nonfinite=_served_nonfinite(doc["value"]))
        names = doc.get("layer_names") or []
        # Name an index the run's metadata does not cover by its number, not by a crash.
        frame["layer_name"] = [names[i] if i < len(names) else f"layer {i}" for i in frame.layer]
        return Series(bucket_steps=doc["bucket_steps"], frame=frame)

    def ranks(
        self,
        run_id: str,
        metric: str = "step_time_s",
        start: int | None = None,
        end: int | None = None,
        max_steps: int = 300,
        agg: str = "max",
    ) -> Series:
        """Per-rank `metric` in long format: columns step, rank, value."""
        params = _window(start, end) | {"metric": metric, "max_steps": max_steps, "agg": agg}
        doc = self._get(f"{API}/runs/{run_id}/ranks", params)
        return Series(bucket_steps=doc["bucket_steps"], frame=_long_frame(doc, "rank"))

    def rank_grid(
        self,
        run_id: str,
        pairs: list[tuple[str, str]],
        start: int | None = None,
        end: int | None = None,
        max_steps: int = 300,
        ranks: list[int] | None = None,
    ) -> dict[tuple[str, str], Series]:
        """Several per-rank (metric, agg) pairs in one request (one scan of the rank rows
        on the collector): per pair what `ranks` answers for it alone; only `ranks`, if
        given."""
        params = _window(start, end) | {
            "metric": [m for m, _ in pairs],
            "agg": [a for _, a in pairs],
            "max_steps": max_steps,
        }
        if ranks:
            params["rank"] = list(ranks)
        doc = self._get(f"{API}/runs/{run_id}/ranks/grid", params)
        return {
            (m, a): Series(
                doc["bucket_steps"], _long_frame({**doc, "value": doc[f"{a}_{m}"]}, "rank")
            )
            for m, a in pairs
        }

    def nodes(
        self,
        run_id: str,
        metric: str = "step_time_s",
        start: int | None = None,
        end: int | None = None,
        max_steps: int = 300,
        agg: str = "max",
    ) -> tuple[Series, list[str], list[int]]:
        """Per-node `metric` (ranks grouped by host) in long format: columns step, node,
        host, value; with the host names and each node's rank count (empty if the run did
        not send its hosts)."""
        params = _window(start, end) | {"metric": metric, "max_steps": max_steps, "agg": agg}
        doc = self._get(f"{API}/runs/{run_id}/nodes", params)
        frame = _long_frame(doc, "node")
        hosts = doc.get("hosts") or []
        frame["host"] = [hosts[i] for i in frame["node"]]
        return Series(doc["bucket_steps"], frame), hosts, doc.get("ranks_per_node") or []

    def node_summary(
        self,
        run_id: str,
        start: int | None = None,
        end: int | None = None,
        metrics: list[str] | None = None,
    ) -> pd.DataFrame:
        """One row per node (ranks grouped by host) over the window: node, host, ranks and
        the node's mean throughput, step, compute and wait time, power and network rates
        (collector/query.py: _NODE_AGG), or only `metrics`. Empty if the run did not send
        its hosts."""
        params = _window(start, end) | ({"metric": metrics} if metrics else {})
        doc = self._get(f"{API}/runs/{run_id}/nodes/summary", params)
        keys = ("node", "host", "ranks")
        return pd.DataFrame({c: v if c in keys else _floats(v) for c, v in doc.items()})

    def hosts(self, run_id: str) -> list[str] | None:
        """Host name of each rank (index: rank); None if the run did not send them."""
        return self._get(f"{API}/runs/{run_id}/hosts")["hosts"]

    def goodput(self, run_id: str) -> dict[str, Any]:
        """The run's goodput as the analyzer (and `trainvitals replay`) computes it: ratio,
        wall_s, productive_s and the time lost to restarts, checkpoints and stalls; NaN
        where unknown."""
        doc = self._get(f"{API}/runs/{run_id}/goodput")
        return {k: math.nan if v is None else float_from_wire(v) for k, v in doc.items()}

    def alerts(self, run_id: str) -> pd.DataFrame:
        """The run's alerts, one row each, with the columns of `ALERT_COLUMNS`."""
        rows = self._get(f"{API}/runs/{run_id}/alerts")
        frame = pd.DataFrame(rows, columns=list(ALERT_COLUMNS))
        frame["value"] = _floats(frame["value"].tolist())  # NaN and inf as served
        frame["baseline"] = _floats(frame["baseline"].tolist())
        # Nullable integers: an alert about no rank or layer keeps its null, not a float.
        return frame.astype({"step": "Int64", "rank": "Int64", "layer": "Int64"})

    def events(self, run_id: str) -> pd.DataFrame:
        """The run's events (injected faults, restarts, checkpoints), columns `EVENT_COLUMNS`."""
        rows = self._get(f"{API}/runs/{run_id}/events")
        frame = pd.DataFrame(rows, columns=list(EVENT_COLUMNS))
        return frame.astype({"step": "int64", "rank": "int64"})

    def is_replay(self) -> bool:
        """True when the collector serves a stored run read-only: its data cannot change."""
        return bool(self.healthz().get("replay"))

    def _get(self, path: str, params: dict[str, Any] | None = None) -> Any:
        try:
            response = self._http.get(path, params=params)
        except httpx.TransportError as e:
            # Connect errors, timeouts and dropped connections all mean the same to a
            # reader: nothing usable answers at this URL.
            raise CollectorUnavailable(f"no collector answers at {self.base_url}: {e}") from e
        if response.status_code == httpx.codes.NOT_FOUND:
            raise RunNotFound(_detail(response))
        if response.is_error:
            raise CollectorError(f"GET {path} -> HTTP {response.status_code}: {_detail(response)}")
        try:
            return response.json()
        except ValueError as e:
            raise CollectorError(f"GET {path}: the answer is not JSON") from e


def _window(start: int | None, end: int | None) -> dict[str, int]:
    """Query parameters of a step window; an open end is left out."""
    bounds = {"start": start, "end": end}
    return {k: v for k, v in bounds.items() if v is not None}


def _long_frame(doc: dict[str, Any], key: str) -> pd.DataFrame:
    """Long-format columns (step, key, value) as typed columns; `value` as `_floats`."""
    return pd.DataFrame(
        {
            "step": pd.Series(doc["step"], dtype="int64"),
            key: pd.Series(doc[key], dtype="int64"),
            "value": _floats(doc["value"]),
        }
    )


def _floats(values: list) -> pd.Series:
    """A served float column: NaN and inf, which JSON has no literal for, arrive in the
    schema's wire form ("NaN", "Infinity", "-Infinity") and become floats again; a null
    (nothing stored) becomes NaN."""
    if str in set(map(type, values)):  # one pass in C; decoded only where one is served
        values = [float_from_wire(v) for v in values]
    return pd.Series(values, dtype="float64")


def _served_nonfinite(values: list) -> pd.Series:
    """Which served values are NaN or inf (a wire string), not null (nothing stored)."""
    return pd.Series([isinstance(v, str) for v in values], dtype=bool)


def _detail(response: httpx.Response) -> str:
    """The error message of a FastAPI answer ({"detail": ...}), or the raw body."""
    try:
        return str(response.json()["detail"])
    except (ValueError, KeyError, TypeError):
        return response.text[:200]
