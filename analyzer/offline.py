"""`trainvitals analyze FILE`: the step-level detectors over a CSV or Parquet of scalars.

For runs that never used trainvitals: a scalar export of W&B (`_step`, `train/loss`, ...)
or TensorBoard (`Step`, `Value`, one metric per file) is mapped by column name onto the
schema's step fields, and the detectors that need only those fields run over it:
non-finite values, loss spikes and divergence, throughput drops. Alerts print as JSON lines.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from .detectors import LossSpikeDetector, NonFiniteDetector
from .engine import Analyzer
from .throughput import ThroughputDropDetector

# Schema field -> column names seen in exports, tried in order (compared case-insensitively).
ALIASES = {
    "step": ["step", "_step", "global_step", "trainer/global_step", "iteration"],
    "loss": ["loss", "train/loss", "train_loss", "loss/train", "lm_loss", "value"],
    "grad_norm": ["grad_norm", "train/grad_norm", "gradient_norm", "grad-norm"],
    "tokens_per_s": ["tokens_per_s", "throughput", "train/tokens_per_second", "tokens_per_sec"],
    "time_unix_s": ["time_unix_s", "_timestamp", "wall time", "timestamp"],
}


def read_table(path: Path) -> pa.Table:
    if path.suffix.lower() == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path)
    if path.suffix.lower() == ".csv":
        import pyarrow.csv as pcsv

        # "NaN" and "inf" are values here (a NaN loss is what the analyzer must see); only
        # empty cells are missing.
        convert = pcsv.ConvertOptions(null_values=["", "NULL", "null", "N/A"])
        return pcsv.read_csv(path, convert_options=convert)
    raise ValueError(f"{path}: expected a .csv or .parquet file")


def map_columns(table: pa.Table, overrides: dict[str, str]) -> pa.Table:
    """A steps table (step, time_unix_s, loss, grad_norm, tokens_per_s) from export columns."""
    by_lower = {c.lower(): c for c in table.column_names}
    picked: dict[str, str] = {}
    for field, aliases in ALIASES.items():
        if field in overrides:
            if overrides[field] not in table.column_names:
                raise ValueError(
                    f"column {overrides[field]!r} (for {field}) is not in the file; "
                    f"it has {table.column_names}"
                )
            picked[field] = overrides[field]
        else:
            found = next((by_lower[a] for a in aliases if a in by_lower), None)
            if found is not None:
                picked[field] = found
    for needed in ("step", "loss"):
        if needed not in picked:
            raise ValueError(
                f"no {needed} column found among {table.column_names}; name it with "
                f"--{needed.replace('_', '-')}-column"
            )
    n = table.num_rows
    out = {}
    for field in ALIASES:
        if field in picked:
            col = table.column(picked[field])
            out[field] = pc.cast(col, pa.int64() if field == "step" else pa.float64())
        else:
            out[field] = pa.nulls(n, pa.float64())  # not in the export: detectors skip it
    steps = pa.table(out)
    # Exports of sparse logs leave a metric's cell empty on steps that did not log it.
    steps = steps.filter(pc.and_(pc.is_valid(steps["step"]), pc.is_valid(steps["loss"])))
    return steps.sort_by("step")


def step_detectors() -> list:
    return [NonFiniteDetector(), LossSpikeDetector(), ThroughputDropDetector()]


def analyze_file(path: Path, overrides: dict[str, str] | None = None) -> list:
    steps = map_columns(read_table(path), overrides or {})
    alerts = Analyzer(step_detectors).observe(path.stem, {"steps": steps})
    # A message ends with the collector's query paths to its evidence; a file has none.
    return [replace(a, message=a.message.split(" Data: ")[0]) for a in alerts]
