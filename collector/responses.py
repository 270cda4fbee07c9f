"""Typed answers of the query API (query.py), so that /openapi.json documents what comes
back; docs/api.md points there for the reference.

A model that mirrors a table is derived from the table's declaration in
trainvitals/schema/declarations.py (names, types, descriptions), as the DDL and the
validation are: a field added there appears here, in the SQL that fills it and in the
OpenAPI schema. Every value may be null: a store made before a field was declared holds
none for it. JSON has no literal for NaN or inf: a field that may hold them (one declared
`finite=False`, such as the loss) serves them in the schema's wire form, the strings
"NaN", "Infinity" and "-Infinity" (`NonFinite`, trainvitals/schema/codec.py).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, create_model
from pydantic import Field as Described

from trainvitals.analyzer.goodput import Goodput
from trainvitals.schema import (
    ALERTS,
    EVENTS,
    LAYERS,
    NONFINITE_TO_WIRE,
    RANKS,
    RUNS,
    STEPS,
    Field,
    Table,
)

_PYTHON = {"int64": int, "float64": float, "string": str}
# A NaN or inf value as the query API serves it: the schema's wire form.
NonFinite = Literal["NaN", "Infinity", "-Infinity"]
assert set(typing.get_args(NonFinite)) == set(NONFINITE_TO_WIRE.values())
_NONFINITE_DOC = '; NaN and inf as the strings "NaN", "Infinity", "-Infinity"'

# runs fields a run summary carries: all but the JSON documents (layer_names_json is
# served decoded, as `layer_names`; a model's configuration and the hosts of every rank
# are large and have endpoints or the store of their own).
RUN_SUMMARY_FIELDS = tuple(f.name for f in RUNS.fields if f.json is None)

# steps columns of a step series, all bucket means; loss and grad_norm also get a bucket
# max (`<name>_max`).
STEP_VALUES = tuple(f.name for f in STEPS.fields if f.name != "step" and f.dtype != "string")
STEP_MAXIMA = ("loss", "grad_norm")


def _value_type(f: Field) -> Any:
    """A field's values as served: its Python type, or a NonFinite string where the
    declaration allows NaN and inf."""
    return float | NonFinite if _nonfinite(f) else _PYTHON[f.dtype]


def _nonfinite(f: Field) -> bool:
    return f.dtype == "float64" and not f.finite


def _nullable(f: Field) -> Any:
    """A table field as a model field: its type or null, described as the schema does."""
    doc = f.doc + (_NONFINITE_DOC if _nonfinite(f) else "")
    return (_value_type(f) | None, Described(description=doc))


def _row_model(name: str, table: Table, doc: str) -> type[BaseModel]:
    """One row of `table` as stored: run_id, then its declared fields."""
    fields: dict[str, Any] = {"run_id": (str, Described(description="the run"))}
    fields.update({f.name: _nullable(f) for f in table.fields})
    return create_model(name, __doc__=doc, **fields)


RunSummary = create_model(
    "RunSummary",
    __doc__="One run of `GET /runs`: its metadata (null where the run sent none) and progress.",
    run_id=(str, Described(description="the run")),
    **{name: _nullable(RUNS.by_name[name]) for name in RUN_SUMMARY_FIELDS},
    layer_names=(
        list[Any] | None,  # names; a store from before ingest checked them may hold others
        Described(description="name of layer index 0, 1, ... (runs.layer_names_json)"),
    ),
    last_step=(int | None, Described(description="latest logged step")),
    last_time_unix_s=(float | None, Described(description="wall-clock time of that step")),
)


def _column(f: Field) -> Any:
    """A column of a field's values, one per bucket; null where a bucket holds none."""
    return list[_value_type(f) | None]  # type: ignore[misc]  # a type made at run time


def _step_columns() -> type[BaseModel]:
    fields: dict[str, Any] = {
        "step": (list[int], Described(description="first step of each bucket"))
    }
    for name in STEP_VALUES:
        f = STEPS.by_name[name]
        doc = f"bucket mean of: {f.doc}" + (_NONFINITE_DOC if _nonfinite(f) else "")
        fields[name] = (_column(f), Described(description=doc))
    for name in STEP_MAXIMA:
        f = STEPS.by_name[name]
        doc = f"bucket max of {name}" + (_NONFINITE_DOC if _nonfinite(f) else "")
        fields[f"{name}_max"] = (_column(f), Described(description=doc))
    doc = "One list per column, one entry per bucket of steps."
    return create_model("StepColumns", __doc__=doc, **fields)


StepColumns = _step_columns()


class StepSeries(BaseModel):
    """`GET /runs/{run_id}/steps`: the step series, downsampled in buckets of whole steps."""

    bucket_steps: int = Described(description="steps each bucket stands for")
    columns: StepColumns  # type: ignore[valid-type]


class AnalysisProgress(BaseModel):
    """`GET /runs/{run_id}/analysis`: how far the live analysis has come with a run. A
    caught-up run's alerts are all stored: what its stored steps raise is in `/alerts`."""

    run_id: str
    live: bool = Described(description="a live analysis follows the store (false in replay)")
    stored_step: int | None = Described(description="the newest step stored of the run")
    analysed_step: int | None = Described(description="the newest step analysed, alerts stored")
    pending: bool = Described(
        description="batches wait to be written, or committed steps wait for the analysis"
    )
    caught_up: bool = Described(description="live, nothing pending, and every stored step analysed")


AlertRow = _row_model("AlertRow", ALERTS, "One alert as stored: what a detector raised.")
EventRow = _row_model(
    "EventRow", EVENTS, "One event as stored: an injected fault, a restart, a checkpoint..."
)


def _goodput_model() -> type[BaseModel]:
    """The analyzer's Goodput (analyzer/goodput.py) with its ratio; a time or the ratio
    may be "NaN" (unknown: a run without the steps to tell)."""
    hints = typing.get_type_hints(Goodput)
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(Goodput):
        kind = hints[f.name]
        fields[f.name] = (kind | NonFinite if kind is float else kind, ...)
    fields["ratio"] = (
        float | NonFinite,
        Described(description='productive_s / wall_s; "NaN" without wall time'),
    )
    doc = "`GET /runs/{run_id}/goodput`: wall time, productive time, ratio, what was lost."
    return create_model("GoodputAnswer", __doc__=doc, **fields)


GoodputAnswer = _goodput_model()


# Grids (`/layers`, `/ranks`, `/ranks/grid`, `/nodes`): long format, one entry per
# (bucket of steps, layer / rank / node) in each list, in step then key order.
_GRID_KEYS = ("step", "layer", "rank")
_LAYER_METRICS = tuple(f for f in LAYERS.fields if f.name not in _GRID_KEYS)
_RANK_METRICS = tuple(f for f in RANKS.fields if f.name not in _GRID_KEYS)
assert {f.dtype for f in (*_LAYER_METRICS, *_RANK_METRICS)} <= {"int64", "float64"}
# A metric aggregated over a bucket of steps: a mean is a float, a max or min keeps the
# field's type (an int64 count stays an int); NaN and inf as NonFinite strings where the
# metric is declared finite=False; null where no row in the bucket reported it.
GridValue = int | float | NonFinite | None


def _grid_value_doc(metrics: tuple[Field, ...], what: str) -> str:
    nonfinite = ", ".join(f.name for f in metrics if _nonfinite(f))
    return (
        f"{what}, one per row; null where no row of the bucket reported it; NaN and inf "
        f'of {nonfinite} as the strings "NaN", "Infinity", "-Infinity"'
    )


def _bucket_steps() -> Any:
    return Described(description="steps each bucket stands for")


def _steps_column() -> Any:
    return Described(description="first step of each row's bucket")


class LayerGrid(BaseModel):
    """`GET /runs/{run_id}/layers`: a step x layer grid of one per-layer metric."""

    layer_names: list[Any] | None = Described(
        description="name of layer index 0, 1, ... (runs.layer_names_json); null if not sent"
    )
    bucket_steps: int = _bucket_steps()
    step: list[int] = _steps_column()
    layer: list[int] = Described(description="layer index of each row")
    value: list[GridValue] = Described(
        description=_grid_value_doc(_LAYER_METRICS, "the metric's `agg` over the bucket")
    )


class RankSeries(BaseModel):
    """`GET /runs/{run_id}/ranks`: a step x rank grid of one per-rank metric."""

    bucket_steps: int = _bucket_steps()
    step: list[int] = _steps_column()
    rank: list[int] = Described(description="global rank of each row")
    value: list[GridValue] = Described(
        description=_grid_value_doc(_RANK_METRICS, "the metric's `agg` over the bucket")
    )


class RankGrid(BaseModel):
    """`GET /runs/{run_id}/ranks/grid`: several per-rank metrics on one step x rank grid.
    Besides step and rank, one column `<agg>_<metric>` (e.g. `max_step_time_s`) per
    (metric, agg) pair asked, in the order asked, each as `/ranks` answers `value`."""

    model_config = ConfigDict(extra="allow")
    # The `<agg>_<metric>` columns (additionalProperties in the OpenAPI schema).
    __pydantic_extra__: dict[str, list[GridValue]] = Described(init=False)

    bucket_steps: int = _bucket_steps()
    step: list[int] = _steps_column()
    rank: list[int] = Described(description="global rank of each row")


# A node's value combines its ranks' (a sum of throughput and power, a max of times, an
# average of the node's network rates; collector/query.py's _NODE_AGG) over float64 rank
# fields declared finite: a float, null where none of its ranks reported the metric, and a
# NonFinite string only where a sum overflows.
NodeValue = float | NonFinite | None


class NodeGrid(BaseModel):
    """`GET /runs/{run_id}/nodes`: a step x node grid of one per-rank metric, each node's
    ranks combined at each step, then the steps of a bucket by `agg`. A run that did not
    send its hosts has `hosts` and `ranks_per_node` null and no rows."""

    bucket_steps: int = _bucket_steps()
    hosts: list[str] | None = Described(description="host name of node index 0, 1, ...")
    ranks_per_node: list[int] | None = Described(description="ranks of node index 0, 1, ...")
    step: list[int] = _steps_column()
    node: list[int] = Described(description="node index of each row (into `hosts`)")
    value: list[NodeValue] = Described(
        description="the node's value, `agg` over the bucket; null where no rank reported it"
    )


class NodeSummary(BaseModel):
    """`GET /runs/{run_id}/nodes/summary`: one row per node over the window. Besides node,
    host and ranks, one column per metric asked (all of them by default), in the order
    asked: the node's value at each logged step, averaged over the steps; null where no
    rank reported it. No rows if the run did not send its hosts."""

    model_config = ConfigDict(extra="allow")
    # The metric columns (additionalProperties in the OpenAPI schema).
    __pydantic_extra__: dict[str, list[NodeValue]] = Described(init=False)

    node: list[int] = Described(description="node index")
    host: list[str] = Described(description="the node's host name")
    ranks: list[int] = Described(description="the node's rank count")


class RunHosts(BaseModel):
    """`GET /runs/{run_id}/hosts`: where each rank ran."""

    hosts: list[str] | None = Described(
        description="host name of rank 0, 1, ... (runs.hosts_json); null if the run sent none"
    )
