"""Typed answers of the query API (query.py), so that /openapi.json documents what comes
back; docs/api.md points there for the reference.

A model that mirrors a table is derived from the table's declaration in
trainvitals/schema/declarations.py (names, types, descriptions), as the DDL and the
validation are: a field added there appears here, in the SQL that fills it and in the
OpenAPI schema. Every value may be null: a store made before a field was declared holds
none for it, and a non-finite number is served as null (JSON has no literal for NaN or
inf).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from pydantic import BaseModel, create_model
from pydantic import Field as Described

from trainvitals.analyzer.goodput import Goodput
from trainvitals.schema import ALERTS, EVENTS, RUNS, STEPS, Field, Table

_PYTHON = {"int64": int, "float64": float, "string": str}

# runs fields a run summary carries: all but the JSON documents (layer_names_json is
# served decoded, as `layer_names`; a model's configuration and the hosts of every rank
# are large and have endpoints or the store of their own).
RUN_SUMMARY_FIELDS = tuple(f.name for f in RUNS.fields if f.json is None)

# steps columns of a step series, all bucket means; loss and grad_norm also get a bucket
# max (`<name>_max`).
STEP_VALUES = tuple(f.name for f in STEPS.fields if f.name != "step" and f.dtype != "string")
STEP_MAXIMA = ("loss", "grad_norm")


def _nullable(f: Field) -> Any:
    """A table field as a model field: its type or null, described as the schema does."""
    return (_PYTHON[f.dtype] | None, Described(description=f.doc))


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


def _step_columns() -> type[BaseModel]:
    fields: dict[str, Any] = {
        "step": (list[int], Described(description="first step of each bucket"))
    }
    for name in STEP_VALUES:
        doc = f"bucket mean of: {STEPS.by_name[name].doc}"
        fields[name] = (list[float | None], Described(description=doc))
    for name in STEP_MAXIMA:
        fields[f"{name}_max"] = (list[float | None], Described(description=f"bucket max of {name}"))
    doc = "One list per column, one entry per bucket of steps."
    return create_model("StepColumns", __doc__=doc, **fields)


StepColumns = _step_columns()


class StepSeries(BaseModel):
    """`GET /runs/{run_id}/steps`: the step series, downsampled in buckets of whole steps."""

    bucket_steps: int = Described(description="steps each bucket stands for")
    columns: StepColumns  # type: ignore[valid-type]


AlertRow = _row_model("AlertRow", ALERTS, "One alert as stored: what a detector raised.")
EventRow = _row_model(
    "EventRow", EVENTS, "One event as stored: an injected fault, a restart, a checkpoint..."
)


def _goodput_model() -> type[BaseModel]:
    """The analyzer's Goodput (analyzer/goodput.py) with its ratio; times may be null."""
    hints = typing.get_type_hints(Goodput)
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(Goodput):
        kind = hints[f.name]
        fields[f.name] = (kind | None if kind is float else kind, ...)
    fields["ratio"] = (
        float | None,
        Described(description="productive_s / wall_s; null without wall time"),
    )
    doc = "`GET /runs/{run_id}/goodput`: wall time, productive time, ratio, what was lost."
    return create_model("GoodputAnswer", __doc__=doc, **fields)


GoodputAnswer = _goodput_model()
