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

from pydantic import BaseModel, create_model
from pydantic import Field as Described

from trainvitals.analyzer.goodput import Goodput
from trainvitals.schema import ALERTS, EVENTS, NONFINITE_TO_WIRE, RUNS, STEPS, Field, Table

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
