"""The analyzer: one set of detectors per run, fed logged steps in step order.

`Analyzer.observe(run_id, tables)` takes the Arrow tables of one ingested batch (the
collector's live driver) or of a stored run (the replay driver) and returns new alerts.
Steps at or below the last step seen for a run are ignored, so a resent batch raises
nothing twice.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

from .alerts import Alert
from .detectors import LossSpikeDetector, NonFiniteDetector, RankView, StepView
from .sdc import CanaryDetector
from .straggler import StragglerDetector
from .throughput import ThroughputDropDetector

_STEP_COLUMNS = ["step", "time_unix_s", "loss", "grad_norm", "tokens_per_s", "step_time_s"]
_RANK_COLUMNS = ["compute_time_s", "wait_time_s", "loss", "canary_fingerprint"]


def default_detectors() -> list:
    """A fresh set of detectors for one run."""
    return [
        NonFiniteDetector(),
        LossSpikeDetector(),
        StragglerDetector(),
        CanaryDetector(),
        ThroughputDropDetector(),
    ]


class Analyzer:
    def __init__(self, make_detectors: Callable[[], list] = default_detectors) -> None:
        self._make = make_detectors
        self._detectors: dict[str, list] = {}
        self._last_step: dict[str, int] = defaultdict(lambda: -1)

    def observe(self, run_id: str, tables: dict[str, Any]) -> list[Alert]:
        steps = tables.get("steps")
        if steps is None or steps.num_rows == 0:
            return []
        layer_norms = _layer_grad_norms(tables.get("layers"))
        rank_views = _rank_views(tables.get("ranks"))
        detectors = self._detectors.setdefault(run_id, self._make())
        alerts: list[Alert] = []
        present = [c for c in _STEP_COLUMNS if c in steps.column_names]
        for row in sorted(steps.select(present).to_pylist(), key=_step):
            if row["step"] <= self._last_step[run_id]:
                continue
            self._last_step[run_id] = row["step"]
            row.setdefault("time_unix_s", 0.0)
            view = StepView(
                run_id=run_id,
                layer_grad_norms=layer_norms.get(row["step"], ()),
                ranks=rank_views.get(row["step"]),
                **row,
            )
            for d in detectors:
                alerts.extend(d.observe(view))
        return alerts


def _step(row: dict) -> int:
    return row["step"]


def _layer_grad_norms(layers: Any) -> dict[int, tuple[float, ...]]:
    """step -> per-layer gradient norms in layer order, from a layers table (or None)."""
    if layers is None or layers.num_rows == 0:
        return {}
    by_step: dict[int, list[tuple[int, float]]] = defaultdict(list)
    cols = layers.select(["step", "layer", "grad_norm"]).to_pydict()
    for step, layer, norm in zip(cols["step"], cols["layer"], cols["grad_norm"], strict=True):
        by_step[step].append((layer, norm))
    return {s: tuple(v for _, v in sorted(pairs)) for s, pairs in by_step.items()}


def _rank_views(ranks: Any) -> dict[int, RankView]:
    """step -> per-rank values in rank order, from a ranks table (or None)."""
    if ranks is None or ranks.num_rows == 0:
        return {}
    present = [c for c in _RANK_COLUMNS if c in ranks.column_names]
    rows: dict[int, list[dict]] = defaultdict(list)
    for row in ranks.select(["step", "rank", *present]).to_pylist():
        rows[row["step"]].append(row)
    views = {}
    for step, rs in rows.items():
        rs.sort(key=lambda r: r["rank"])
        views[step] = RankView(**{c: tuple(r.get(c) for r in rs) for c in _RANK_COLUMNS})
    return views
