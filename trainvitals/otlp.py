"""The schema's tables as OpenTelemetry metrics: the one mapping that the hooks' OtlpExporter
and the collector's OTLP receiver both use (docs/otlp.md has the full description).

A record of table T becomes one number data point (gauge or sum) per numeric field F that
is not part of T's key and has a value, on the metric `trainvitals.T.F`:

    steps (run_id="r1", step=10, loss=2.31, grad_norm=0.9, ...)
      -> trainvitals.steps.loss       2.31   {run_id="r1", step=10}
         trainvitals.steps.grad_norm  0.9    {run_id="r1", step=10}

The attributes carry `run_id`, the other key fields of T (`step`, `layer`, `rank`, `kind`)
and T's string fields (`detail` of an event, `model` of a run, ...). Integer key fields are
integer attributes; string fields are string attributes. Units are in the names, as in the
schema (`step_time_s`, `power_w`).
"""

from __future__ import annotations

from trainvitals.schema import TABLES, Field, Table

PREFIX = "trainvitals."


def metric_name(table: Table, field: Field) -> str:
    """`trainvitals.<table>.<field>`."""
    return f"{PREFIX}{table.name}.{field.name}"


def value_fields(table: Table) -> tuple[Field, ...]:
    """Fields that travel as data point values: numeric and not part of the key."""
    return tuple(f for f in table.fields if f.name not in table.key and f.dtype != "string")


def attribute_fields(table: Table) -> tuple[Field, ...]:
    """Fields that travel as attributes: the key (less run_id) and every string field."""
    return tuple(f for f in table.fields if f.name in table.key or f.dtype == "string")


def is_ours(name: str) -> bool:
    """True for names in the `trainvitals.` namespace (valid or not)."""
    return name.startswith(PREFIX)


def parse_metric_name(name: str) -> tuple[Table, Field]:
    """The (table, field) a `trainvitals.<table>.<field>` name stands for.

    Raises ValueError naming what is wrong: unknown table, unknown field, or a field that
    is an attribute (key or string) rather than a value.
    """
    table_name, _, field_name = name.removeprefix(PREFIX).partition(".")
    table = TABLES.get(table_name)
    if table is None:
        raise ValueError(f"metric {name!r}: unknown table {table_name!r}; known: {sorted(TABLES)}")
    field = table.by_name.get(field_name)
    values = [f.name for f in value_fields(table)]
    if field is None:
        raise ValueError(f"metric {name!r}: table {table.name} has no field {field_name!r}")
    if field.name not in values:
        raise ValueError(
            f"metric {name!r}: {table.name}.{field.name} travels as an attribute, not as a "
            f"metric; value fields of {table.name}: {values}"
        )
    return table, field


# Every table has a required value field, so every record yields at least one data point.
assert all(any(f.required for f in value_fields(t)) for t in TABLES.values())
