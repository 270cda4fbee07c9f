"""The analyzer: one set of detectors per run, fed logged steps in step order.

`Analyzer.observe(run_id, tables)` takes the Arrow tables of one ingested batch (the
collector's live driver) or of a stored run (the replay driver) and returns new alerts.
Steps at or below the last step seen for a run are ignored, so a resent batch raises
nothing twice. Checkpoint and restart events (the `events` table) go to the detectors
that take them whatever their step; injected faults' ground truth goes to none.

Cost: each column of a batch is converted to numpy once; a step's per-layer and per-rank
values are slices of those arrays (see views.py). No Python object per rank is made.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .alerts import Alert
from .attribution import LayerHistory
from .config import AnalyzerConfig
from .coverage import MissingRanksDetector
from .detectors import LossSpikeDetector, NonFiniteDetector
from .divergence import DivergenceDetector
from .intermittent import IntermittentStragglerDetector
from .runinfo import UNKNOWN, RunInfo
from .sdc import sdc_detectors
from .stall import StallDetector
from .straggler import StragglerDetector
from .throttle import ThrottleDetector
from .throughput import ThroughputDropDetector
from .views import (
    LAYER_COLUMNS,
    LAYER_MARKED,
    RANK_COLUMNS,
    RANK_MARKED,
    RUN_EVENT_KINDS,
    LayerView,
    RankView,
    RunEvent,
    StepView,
)

# Step fields that may be null: null becomes NaN (not reported). loss and grad_norm keep
# None for null, so that "not in this export" is not mistaken for a non-finite value.
_STEP_FLOATS = (
    "time_unix_s",
    "tokens_per_s",
    "step_time_s",
    "lr",
    "nonfinite_count",
    "nonfinite_steps",
)


def default_detectors(config: AnalyzerConfig | None = None) -> list:
    """A fresh set of detectors for one run, with the settings of `config` (or defaults)."""
    c = config or AnalyzerConfig()
    straggler = StragglerDetector(c.straggler)
    return [
        NonFiniteDetector(c.nonfinite),
        LossSpikeDetector(c.loss_spike, layers=LayerHistory(c.layer_attribution)),
        DivergenceDetector(c.divergence),
        # before the intermittent detector, which reads the ranks it named at the same step
        straggler,
        IntermittentStragglerDetector(c.intermittent, straggler=straggler),
        # canary, peer outliers, replica: one shared board of suspects
        *sdc_detectors(c.canary, c.replica, c.peer_outlier),
        StallDetector(c.stall),
        ThrottleDetector(c.throttle),
        ThroughputDropDetector(c.throughput),
        MissingRanksDetector(),  # no settings: a step has every rank's rows or it does not
    ]


@dataclass
class _Run:
    detectors: list
    last_step: int = -1
    info: RunInfo = UNKNOWN  # layout and names, from the runs row (defaults until known)
    runs_row: Any = None  # the runs row `info` was built from


class Analyzer:
    """The detectors of every run, fed in step order (a fresh set per run).

    `config`: the detector settings (analyzer/config.py), defaults when None;
    `make_detectors`: another set of detectors, for tests and `analyze` (it ignores config).
    """

    def __init__(
        self,
        make_detectors: Callable[[], list] | None = None,
        config: AnalyzerConfig | None = None,
    ) -> None:
        self.config = config or AnalyzerConfig()
        self._make = make_detectors or (lambda: default_detectors(self.config))
        self._runs: dict[str, _Run] = {}

    def observe(self, run_id: str, tables: dict[str, Any]) -> list[Alert]:
        run = self._runs.get(run_id)
        if run is None:
            run = self._runs[run_id] = _Run(self._make())
        _read_layout(run, tables.get("runs"))
        _hand_events(run, tables.get("events"))
        steps = tables.get("steps")
        if steps is None or steps.num_rows == 0:
            return []
        rows = _step_rows(steps)
        layers = _Slices(tables.get("layers"), "layer", LAYER_COLUMNS, nonfinite=LAYER_MARKED)
        ranks = _Slices(tables.get("ranks"), "rank", RANK_COLUMNS, nonfinite=RANK_MARKED)
        alerts: list[Alert] = []
        for row in rows:
            step = row["step"]
            if step <= run.last_step:
                continue
            run.last_step = step
            view = StepView(
                run_id=run_id,
                layers=layers.layer_view(step),
                ranks=ranks.rank_view(step, run.info.tp),
                run=run.info,
                **row,
            )
            for d in run.detectors:
                alerts.extend(d.observe(view))
        return alerts


def _read_layout(run: _Run, runs: Any) -> None:
    """Rebuild the run's RunInfo when its runs row arrives or changes (a resumed run may
    change its layout or hosts). The row comes with every live window: comparing it is
    cheap, parsing a hosts list of 100,000 ranks per batch would not be."""
    if runs is None or runs.num_rows == 0:
        return
    row = runs.slice(runs.num_rows - 1)
    if run.runs_row is not None and row.equals(run.runs_row):
        return
    run.runs_row = row
    run.info = RunInfo.from_runs(row) or UNKNOWN  # never None: the row is there


def _hand_events(run: _Run, events: Any) -> None:
    """Give the checkpoint and restart events of a batch, whatever their step, to the
    detectors that take them (`observe_events`), before the batch's steps. Events may
    arrive after the step they name (rank 0 sends them on its own), so detectors keep
    them and look back; ground truth (`fault:*`) is dropped here and reaches no one."""
    if events is None or events.num_rows == 0:
        return
    kept = events.filter(pc.is_in(events.column("kind"), pa.array(RUN_EVENT_KINDS)))
    if kept.num_rows == 0:
        return
    columns = ["step", "kind", "time_unix_s", "detail"]
    rows = kept.select([c for c in columns if c in kept.column_names]).to_pylist()
    rows.sort(key=lambda r: (r["step"], r["kind"]))
    batch = [RunEvent(r["step"], r["kind"], r["time_unix_s"], **_numbers(r.get("detail")))
             for r in rows]  # fmt: skip
    for d in run.detectors:
        if hasattr(d, "observe_events"):
            d.observe_events(batch)


def _numbers(detail: str | None) -> dict[str, Any]:
    """The RunEvent fields an event's detail JSON gives: a pause's `duration_s`, a
    restart's `world_size`; those it lacks, or holds as something else, are left out
    (ingest checked that the detail is a JSON object, not what it holds)."""
    try:
        doc = json.loads(detail or "{}")
    except ValueError:
        return {}
    if not isinstance(doc, dict):
        return {}
    out: dict[str, Any] = {}
    duration = doc.get("duration_s")
    if isinstance(duration, int | float) and math.isfinite(duration) and duration > 0:
        out["duration_s"] = float(duration)
    world = doc.get("world_size")
    if isinstance(world, int) and not isinstance(world, bool) and world > 0:
        out["world_size"] = world
    return out


def _step_rows(steps: pa.Table) -> list[dict]:
    """The batch's steps rows as dicts, in step order, each step once."""
    n = steps.num_rows
    cols: dict[str, list] = {}
    for name in ("step", "loss", "grad_norm", *_STEP_FLOATS):
        if name not in steps.column_names:
            if name == "step":
                raise ValueError("steps table without a step column")
            cols[name] = [None if name in ("loss", "grad_norm") else math.nan] * n
            continue
        values = steps.column(name).to_pylist()
        if name in _STEP_FLOATS:
            values = [math.nan if v is None else float(v) for v in values]
        cols[name] = values
    step = cols["step"]
    order = sorted(range(n), key=step.__getitem__)
    rows, seen = [], None
    names = list(cols)
    for i in order:
        if step[i] == seen:
            continue  # the same step twice in one batch: the first copy counts
        seen = step[i]
        rows.append({k: cols[k][i] for k in names})
    return rows


class _Slices:
    """One batch's layers or ranks table, sorted by (step, key), cut into per-step slices."""

    def __init__(
        self, table: Any, key: str, columns: tuple[str, ...], nonfinite: tuple[str, ...] = ()
    ) -> None:
        self.bounds: dict[int, tuple[int, int]] = {}
        if table is None or table.num_rows == 0:
            return
        step = table.column("step").to_numpy()
        keys = table.column(key).to_numpy()
        order = None
        d_step, d_key = np.diff(step), np.diff(keys)
        if not np.all((d_step > 0) | ((d_step == 0) & (d_key > 0))):
            order = np.lexsort((keys, step))
            step, keys = step[order], keys[order]
            d_step, d_key = np.diff(step), np.diff(keys)
            dup = np.r_[False, (d_step == 0) & (d_key == 0)]  # a row sent twice in one batch
            if dup.any():
                order, step, keys = order[~dup], step[~dup], keys[~dup]
        self.key = keys
        self.columns = {}
        for name in (*columns, *(f"{c}_nonfinite" for c in nonfinite)):
            source = name.removesuffix("_nonfinite")
            if source not in table.column_names:
                continue
            col = table.column(source)
            if name.endswith("_nonfinite"):
                values = col.to_numpy()
                arr = pc.is_valid(col).to_numpy(zero_copy_only=False)
                arr &= ~np.isfinite(values)
            else:
                if col.type != pa.float64():
                    col = pc.cast(col, pa.float64())
                arr = col.to_numpy()  # nulls become NaN
            self.columns[name] = arr if order is None else arr[order]
        starts = np.flatnonzero(np.r_[True, step[1:] != step[:-1]])
        ends = np.r_[starts[1:], len(step)]
        self.bounds = dict(
            zip(
                step[starts].tolist(), zip(starts.tolist(), ends.tolist(), strict=True), strict=True
            )
        )

    def _cut(self, step: int) -> dict | None:
        span = self.bounds.get(step)
        if span is None:
            return None
        a, b = span
        return {k: v[a:b] for k, v in self.columns.items()}

    def layer_view(self, step: int) -> LayerView | None:
        cols = self._cut(step)
        if cols is None:
            return None
        a, b = self.bounds[step]
        return LayerView(layer=self.key[a:b], **cols)

    def rank_view(self, step: int, tp: int) -> RankView | None:
        cols = self._cut(step)
        if cols is None:
            return None
        a, b = self.bounds[step]
        return RankView(rank=self.key[a:b], tp=tp, **cols)
