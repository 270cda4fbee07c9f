"""What detectors read: one logged step, with its per-layer and per-rank values as arrays.

The engine cuts each ingested batch into one `StepView` per logged step. Per-layer and
per-rank values are numpy arrays (slices of the batch's columns, not copies), so a
detector's work on a step of 16,384 ranks is a few vectorised passes, not 16,384 Python
objects. Float arrays hold NaN where a value was not reported (a null in the store, a
column an older producer or store lacks); integer fields (fingerprints, bitmasks) travel
as float64 too, which holds them exactly (they are below 2**53).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from .rolling import median as fast_median
from .runinfo import UNKNOWN, RunInfo

# Columns of the layers and ranks tables that detectors read.
LAYER_COLUMNS = (
    "grad_norm",
    "act_rms",
    "act_max_abs",
    "param_norm",
    "update_rms",
    "nonfinite_count",
    "act_nonfinite_count",
    "act_nonfinite_steps",
)
# Optional float columns in which NaN is a value the hooks measured (a NaN activation makes
# the max NaN) while a null means "not reported": the engine marks the reported non-finite
# values in `<column>_nonfinite`, since both become NaN in the float arrays.
LAYER_MARKED = ("act_max_abs", "param_norm")
RANK_MARKED = ("grad_norm_local",)
# Host- or event-timed collectives of the model (hooks/comms.py), waiting for the slowest
# peer included: with the step's end (wait_time_s), where a rank waits for the others.
COLLECTIVE_TIMES = ("all_gather_time_s", "reduce_scatter_time_s", "all_reduce_time_s")
RANK_COLUMNS = (
    "step_time_s",
    "compute_time_s",
    "data_time_s",
    "stopped_time_s",
    "wait_time_s",
    *COLLECTIVE_TIMES,
    "loss",
    "grad_norm_local",
    "canary_fingerprint",
    "replica_fingerprint",
    "replica_group",
    "throttle_reasons",
    "sm_clock_mhz",
)
# Default of a column not given: filled with NaN (not reported) on construction.
_NOTHING: Any = None


@dataclass(frozen=True, eq=False)
class LayerView:
    """Per-layer values of one step, ordered by layer index (forward order)."""

    layer: np.ndarray  # int64 layer indices, ascending
    grad_norm: np.ndarray = _NOTHING
    act_rms: np.ndarray = _NOTHING
    act_max_abs: np.ndarray = _NOTHING  # over every step since the previous logged one
    param_norm: np.ndarray = _NOTHING
    update_rms: np.ndarray = _NOTHING
    nonfinite_count: np.ndarray = _NOTHING  # gradient tensors holding a NaN/inf
    act_nonfinite_count: np.ndarray = _NOTHING  # non-finite activation values
    # Steps since the previous logged one (this one included) whose output held a NaN/inf.
    act_nonfinite_steps: np.ndarray = _NOTHING
    # Reported and not finite (see LAYER_MARKED): False where not reported.
    act_max_abs_nonfinite: np.ndarray = _NOTHING
    param_norm_nonfinite: np.ndarray = _NOTHING

    def __post_init__(self) -> None:
        _fill_missing(self, len(self.layer))

    @classmethod
    def of(cls, **columns) -> LayerView:
        """A view from plain sequences (tests, simulators); `layer` defaults to 0..L-1.

        None stands for "not reported"; in the LAYER_MARKED columns a NaN or inf is a
        reported non-finite value and is marked as such.
        """
        marks = {
            f"{k}_nonfinite": np.array([x is not None and not math.isfinite(x) for x in v])
            for k, v in columns.items()
            if k in LAYER_MARKED
        }
        marks |= {k: np.asarray(v, bool) for k, v in columns.items() if k.endswith("_nonfinite")}
        arrays = {
            k: np.array([math.nan if x is None else x for x in v], dtype=np.float64)
            for k, v in columns.items()
            if k != "layer" and k not in marks
        }
        n = len(next(iter(arrays.values()))) if arrays else 0
        layer = np.asarray(columns.get("layer", np.arange(n)), dtype=np.int64)
        return cls(layer=layer, **arrays, **marks)


@dataclass(frozen=True, eq=False)
class RankView:
    """Per-rank values of one step, ordered by global rank.

    `tp` is the run's tensor-parallel degree (1 when unknown): global rank = dp_index * tp
    + tp_index (trainer/parallel.py), and the data-parallel peers of a rank, which hold the
    same shard of the model and see different data, are the ranks with its tp index.
    """

    rank: np.ndarray  # int64 global ranks, ascending
    tp: int = 1
    step_time_s: np.ndarray = _NOTHING
    compute_time_s: np.ndarray = _NOTHING
    data_time_s: np.ndarray = _NOTHING
    stopped_time_s: np.ndarray = _NOTHING
    wait_time_s: np.ndarray = _NOTHING
    all_gather_time_s: np.ndarray = _NOTHING
    reduce_scatter_time_s: np.ndarray = _NOTHING
    all_reduce_time_s: np.ndarray = _NOTHING
    loss: np.ndarray = _NOTHING
    grad_norm_local: np.ndarray = _NOTHING
    canary_fingerprint: np.ndarray = _NOTHING
    replica_fingerprint: np.ndarray = _NOTHING
    replica_group: np.ndarray = _NOTHING
    throttle_reasons: np.ndarray = _NOTHING
    sm_clock_mhz: np.ndarray = _NOTHING
    # Reported and not finite (NaN means "not reported" in grad_norm_local, so the
    # engine marks real non-finite values here, from the column's nulls).
    grad_norm_local_nonfinite: np.ndarray = _NOTHING
    _memo: dict = field(default_factory=dict, repr=False)  # results shared by detectors

    def __post_init__(self) -> None:
        _fill_missing(self, len(self.rank))

    def __len__(self) -> int:
        return len(self.rank)

    @classmethod
    def of(cls, tp: int = 1, **columns) -> RankView:
        """A view from plain sequences (tests, simulators); `rank` defaults to 0..N-1.

        None stands for "not reported" and becomes NaN.
        """
        arrays = {
            k: np.array([math.nan if x is None else x for x in v], dtype=np.float64)
            for k, v in columns.items()
            if k != "rank"
        }
        n = len(next(iter(arrays.values()))) if arrays else 0
        rank = np.asarray(columns.get("rank", np.arange(n)), dtype=np.int64)
        return cls(rank=rank, tp=tp, **arrays)

    def peer_medians(self, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(median of each rank's data-parallel peer group, size of that group), per rank.

        Only finite values count; a rank's own value is part of its group's median. The
        common layout (ranks 0..N-1, N a multiple of tp) is a reshape to (dp, tp) and one
        median per column; anything else goes through a sort by group.
        """
        n = len(values)
        ok = np.isfinite(values)
        tp = self.tp
        if tp == 1:  # one group: every rank is every other's peer
            count = int(ok.sum())
            med = fast_median(values[ok]) if count else math.nan
            return np.full(n, med), np.full(n, count)
        if n and n % tp == 0 and self.rank[0] == 0 and self.rank[-1] == n - 1:
            grid = values.reshape(n // tp, tp)
            if ok.all():
                med = fast_median(grid, axis=0)
                counts = np.full(tp, n // tp)
            else:
                counts = ok.reshape(n // tp, tp).sum(axis=0)
                med = np.full(tp, math.nan)
                some = counts > 0
                if some.any():
                    med[some] = np.nanmedian(grid[:, some], axis=0)
            return np.tile(med, n // tp), np.tile(counts, n // tp)
        return group_medians(values, self.rank % tp)

    def peer_deviation(self, column: str) -> tuple[np.ndarray, np.ndarray]:
        """(log of each rank's value over its data-parallel peers' median, peer group size).

        NaN where the value is missing, non-finite or not positive. In a group of two the
        median is the pair's mean, which would halve a rank's deviation: there the
        deviation is taken against the other rank (twice the one from the median).
        Computed once per step and column, whichever detectors ask.
        """
        if column not in self._memo:
            x = getattr(self, column)
            with np.errstate(divide="ignore", invalid="ignore"):
                logs = np.where(x > 0, np.log(x), math.nan)
            logs[~np.isfinite(logs)] = math.nan
            med, counts = self.peer_medians(logs)
            d = logs - med
            d[counts == 2] *= 2
            self._memo[column] = (d, counts)
        return self._memo[column]


def group_medians(values: np.ndarray, groups: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per element: the median of the finite values of its group, and their count."""
    med = np.full(len(values), math.nan)
    counts = np.zeros(len(values), dtype=np.int64)
    ok = np.flatnonzero(np.isfinite(values))
    if not len(ok):
        return med, counts
    v, g = values[ok], groups[ok]
    order = np.lexsort((v, g))
    gs, vs = g[order], v[order]
    starts = np.flatnonzero(np.r_[True, gs[1:] != gs[:-1]])
    sizes = np.diff(np.r_[starts, len(gs)])
    group_med = 0.5 * (vs[starts + (sizes - 1) // 2] + vs[starts + sizes // 2])
    where = np.searchsorted(gs[starts], groups)
    where = np.minimum(where, len(starts) - 1)
    member = gs[starts][where] == groups
    med[member] = group_med[where[member]]
    counts[member] = sizes[where[member]]
    return med, counts


@dataclass(frozen=True)
class RunEvent:
    """A checkpoint or restart of the run (events table), which the engine hands to
    detectors that define `observe_events`. Injected faults' ground truth (`fault:*`
    events) never reaches a detector."""

    step: int
    kind: str  # one of RUN_EVENT_KINDS
    time_unix_s: float
    duration_s: float = 0.0  # a declared pause's length (it ended at time_unix_s)
    world_size: int = 0  # a restart's ranks, when it says (0: not said)


# A pause the training loop declared (`monitor.pause`): its event comes at its end, kind
# "pause:<phase>", with its duration.
PAUSE_EVENT_KINDS = ("pause:checkpoint", "pause:eval")
RUN_EVENT_KINDS = ("checkpoint", "restart", *PAUSE_EVENT_KINDS)


@dataclass(frozen=True, eq=False)
class StepView:
    """The slice of one logged step that detectors read."""

    run_id: str
    step: int
    time_unix_s: float
    loss: float
    grad_norm: float
    tokens_per_s: float = math.nan
    step_time_s: float = math.nan
    lr: float = math.nan
    # The hooks' counts (steps table): non-finite values at this step, and steps since the
    # previous logged one (this one included) whose loss or block outputs held a NaN/inf.
    nonfinite_count: float = math.nan
    nonfinite_steps: float = math.nan
    layers: LayerView | None = None
    ranks: RankView | None = None
    run: RunInfo = UNKNOWN  # layout and names, from the runs row (runinfo.py)


def _fill_missing(view, n: int) -> None:
    """Columns not given become NaN (not reported), and their non-finite marks False."""
    for f in fields(view):
        if getattr(view, f.name) is _NOTHING:
            missing = np.zeros(n, bool) if f.name.endswith("_nonfinite") else np.full(n, math.nan)
            object.__setattr__(view, f.name, missing)
