"""`trainvitals analyze FILE`: the step-level detectors over a CSV or Parquet of scalars.

For runs that never used trainvitals: a scalar export of W&B (`_step`, `train/loss`, ...)
or TensorBoard (`Step`, `Value`, one metric per file) is mapped by column name onto the
schema's step fields, and the detectors that need only those fields run over it:
non-finite values, loss spikes and divergence, throughput drops. A gradient-norm column,
when the file has one, is the loss detectors' second signal; a learning-rate column lets
them tell a warm restart of the schedule from a fault. Alerts print as JSON lines.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from trainvitals.schema import STEP_BOUNDS

from .attribution import LayerHistory
from .config import AnalyzerConfig
from .detectors import LossSpikeDetector, NonFiniteDetector
from .divergence import DivergenceDetector
from .engine import Analyzer
from .throughput import ThroughputDropDetector

# Schema field -> column names seen in exports, tried in order (compared case-insensitively).
ALIASES = {
    "step": ["step", "_step", "global_step", "trainer/global_step", "iteration"],
    "loss": ["loss", "train/loss", "train_loss", "loss/train", "lm_loss", "value"],
    "grad_norm": ["grad_norm", "train/grad_norm", "gradient_norm", "grad-norm", "train/grad-norm"],
    "lr": ["lr", "learning_rate", "train/lr", "train/learning_rate", "lr-adam", "lr-adamw"],
    "tokens_per_s": ["tokens_per_s", "throughput", "train/tokens_per_second", "tokens_per_sec"],
    "time_unix_s": ["time_unix_s", "_timestamp", "wall time", "timestamp"],
}


def read_table(path: Path) -> pa.Table:
    """The file's table; ValueError if it is not a CSV or Parquet file that can be read."""
    suffix = path.suffix.lower()
    if suffix not in (".csv", ".parquet"):
        raise ValueError("expected a .csv or .parquet file")
    try:
        if suffix == ".parquet":
            import pyarrow.parquet as pq

            return pq.read_table(path)
        import pyarrow.csv as pcsv

        # "NaN" and "inf" are values here (a NaN loss is what the analyzer must see); only
        # empty cells are missing.
        convert = pcsv.ConvertOptions(null_values=["", "NULL", "null", "N/A"])
        return pcsv.read_csv(path, convert_options=convert)
    except (pa.ArrowException, OSError) as e:  # not CSV, damaged Parquet, missing file
        raise ValueError(f"cannot read it: {e}") from e


def map_columns(table: pa.Table, overrides: dict[str, str]) -> pa.Table:
    """A steps table (step, time_unix_s, loss, grad_norm, lr, tokens_per_s) from export columns,
    in step order. ValueError names the column if one is missing, holds values of a type
    its field cannot take, or if steps are negative or repeated."""
    picked = _pick_columns(table, overrides)
    n = table.num_rows
    out = {}
    for field in ALIASES:
        if field in picked:
            out[field] = _cast(table.column(picked[field]), field, picked[field])
        else:
            out[field] = pa.nulls(n, pa.float64())  # not in the export: detectors skip it
    steps = pa.table(out)
    # Exports of sparse logs leave a metric's cell empty on steps that did not log it.
    steps = steps.filter(pc.and_(pc.is_valid(steps["step"]), pc.is_valid(steps["loss"])))
    steps = steps.sort_by("step")
    _check_steps(steps["step"].to_numpy(), picked["step"])
    return steps


def _pick_columns(table: pa.Table, overrides: dict[str, str]) -> dict[str, str]:
    """Schema field -> the file's column for it: the override, else the first alias found
    (an exact name before one that differs in case only)."""
    names = table.column_names
    picked: dict[str, str] = {}
    for field, aliases in ALIASES.items():
        if field in overrides:
            if overrides[field] not in names:
                raise ValueError(
                    f"column {overrides[field]!r} (for {field}) is not in the file; it has {names}"
                )
            picked[field] = overrides[field]
            continue
        for alias in aliases:
            matches = [c for c in names if c == alias] or [c for c in names if c.lower() == alias]
            if len(matches) > 1:
                raise ValueError(
                    f"columns {matches} could each be the {field}; name one with "
                    f"--{field.replace('_', '-')}-column"
                )
            if matches:
                picked[field] = matches[0]
                break
    for needed in ("step", "loss"):
        if needed not in picked:
            raise ValueError(
                f"no {needed} column found among {names}; name it with "
                f"--{needed.replace('_', '-')}-column"
            )
    for field, name in picked.items():
        if names.count(name) > 1:
            raise ValueError(f"the file has {names.count(name)} columns named {name!r} ({field})")
    return picked


_PER_SECOND = {"s": 1, "ms": 10**3, "us": 10**6, "ns": 10**9}  # timestamp units


def _cast(column: pa.ChunkedArray, field: str, name: str) -> pa.ChunkedArray:
    """`column` as the field's type: int64 for the step, float64 (seconds, for time) else."""
    if field == "time_unix_s" and (
        pa.types.is_timestamp(column.type) or pa.types.is_date(column.type)
    ):
        # Dates and times (a CSV's 2024-01-01T00:00:00) become seconds since the epoch; a
        # time without a zone is taken as UTC.
        if pa.types.is_date(column.type):
            column = column.cast(pa.timestamp("s"))
        ticks = pc.cast(column.cast(pa.int64()), pa.float64())
        return pc.divide(ticks, float(_PER_SECOND[column.type.unit]))
    whole = field == "step"
    reason = f"it holds {column.type}"  # a type that is no number: a list, a date
    if not pa.types.is_temporal(column.type):  # arrow casts dates to int64 without a word
        try:
            return pc.cast(column, pa.int64() if whole else pa.float64())
        except pa.ArrowInvalid as e:  # a value that is no number: 'abc', 1.5 for a step
            reason = str(e)
        except (pa.ArrowNotImplementedError, pa.ArrowTypeError):
            pass
    expected = "whole numbers (int64)" if whole else "numbers (float64)"
    if field == "time_unix_s":
        expected = "seconds since the epoch (float64) or dates and times"
    raise ValueError(f"column {name!r} (for {field}) must hold {expected}: {reason}")


def _check_steps(steps: np.ndarray, name: str) -> None:
    """Steps, sorted, must be distinct and in the schema's bounds: the detectors judge
    each step once, in step order, as the collector does (its key is (run, step))."""
    if not len(steps):
        return
    low, high = STEP_BOUNDS
    if steps[0] < low or steps[-1] > high:
        bad = steps[0] if steps[0] < low else steps[-1]
        raise ValueError(f"column {name!r} (for step) holds {bad}; steps must be in [0, 2**53)")
    repeated = steps[1:][steps[1:] == steps[:-1]]
    if len(repeated):
        raise ValueError(
            f"column {name!r} (for step) repeats step {repeated[0]}; keep one row per step "
            "(a resumed run logs some steps twice: keep the rows of the run that went on)"
        )


def step_detectors(config: AnalyzerConfig | None = None) -> list:
    """The detectors that need only the steps table, with the settings of `config`."""
    c = config or AnalyzerConfig()
    return [
        NonFiniteDetector(c.nonfinite),
        LossSpikeDetector(c.loss_spike, layers=LayerHistory(c.layer_attribution)),
        DivergenceDetector(c.divergence),
        ThroughputDropDetector(c.throughput),
    ]


def analyze_file(
    path: Path,
    overrides: dict[str, str] | None = None,
    config: AnalyzerConfig | None = None,
    loss_scaling: str = "none",
) -> list:
    """The step detectors' alerts over a CSV or Parquet file; ValueError names the file and
    what in it cannot be analysed. loss_scaling: as the runs field (schema.LOSS_SCALING)."""
    try:
        steps = map_columns(read_table(path), overrides or {})
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e
    tables = {"steps": steps, "runs": pa.table({"loss_scaling": [loss_scaling]})}
    alerts = Analyzer(lambda: step_detectors(config)).observe(path.stem, tables)
    # A message ends with the collector's query paths to its evidence; a file has none.
    return [replace(a, message=a.message.split(" Data: ")[0]) for a in alerts]
