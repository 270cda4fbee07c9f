"""Names of layers and ranks in alerts: from the runs row, with indices as the fallback."""

from __future__ import annotations

import json

import pyarrow as pa

from trainvitals.analyzer import Analyzer
from trainvitals.analyzer.runinfo import RunInfo, name_layer, name_rank, name_ranks, rank_on

NAMES = ("tok_embeddings", "layers.0", "layers.1", "norm", "output")
HOSTS = ("host-a", "host-a", "host-b", "host-b")


def _runs(**row) -> pa.Table:
    return pa.Table.from_pylist([row])


def test_a_layer_is_named_by_the_runs_name_for_its_index() -> None:
    run = RunInfo(layer_names=NAMES)
    assert name_layer(run, 2) == "layers.1"  # index 2, not the block numbered 2
    assert name_layer(run, 0) == "tok_embeddings"
    assert name_layer(run, 7) == "layer 7"  # past the names: the index
    assert name_layer(RunInfo(), 2) == "layer 2"


def test_ranks_are_named_with_their_host() -> None:
    run = RunInfo(hosts=HOSTS)
    assert name_rank(run, 3) == "rank 3 on host-b"
    assert name_rank(RunInfo(), 3) == "rank 3"
    assert rank_on(3, "host-b") == "rank 3 on host-b" and rank_on(3, "") == "rank 3"
    assert name_ranks(run, [2, 3]) == "ranks 2, 3 on host-b"
    assert name_ranks(run, [1, 2]) == "ranks 1 on host-a, 2 on host-b"
    assert name_ranks(run, [3]) == "rank 3 on host-b"
    assert name_ranks(RunInfo(), list(range(10)), limit=3) == "ranks 0, 1, 2 and 7 more"


def test_runinfo_reads_the_runs_row_and_ignores_what_is_not_a_list_of_names() -> None:
    info = RunInfo.from_runs(
        _runs(tp=2, layer_names_json=json.dumps(NAMES), hosts_json=json.dumps(HOSTS))
    )
    assert info == RunInfo(tp=2, layer_names=NAMES, hosts=HOSTS)
    odd = RunInfo.from_runs(_runs(tp=0, layer_names_json="not json", hosts_json='{"a": 1}'))
    assert odd == RunInfo()
    assert RunInfo.from_runs(_runs(model="m")) == RunInfo()  # an older store: no fields
    assert RunInfo.from_runs(None) is None


class _Seen:
    """A detector that keeps the run info of each step it sees."""

    def __init__(self) -> None:
        self.runs: list[RunInfo] = []

    def observe(self, s) -> list:
        self.runs.append(s.run)
        return []


def test_every_step_carries_the_runs_info_and_a_changed_row_replaces_it() -> None:
    seen = _Seen()
    analyzer = Analyzer(lambda: [seen])
    steps = pa.table({"step": [0, 1], "loss": [1.0, 1.0], "grad_norm": [1.0, 1.0]})
    first = _runs(tp=2, layer_names_json=json.dumps(NAMES), hosts_json=json.dumps(HOSTS))
    analyzer.observe("r", {"runs": first, "steps": steps})
    analyzer.observe("r", {"runs": first, "steps": steps.set_column(0, "step", [[2, 3]])})
    moved = _runs(tp=1, layer_names_json=json.dumps(NAMES), hosts_json='["h9"]')
    analyzer.observe("r", {"runs": moved, "steps": steps.set_column(0, "step", [[4, 5]])})
    assert [r.tp for r in seen.runs] == [2, 2, 2, 2, 1, 1]
    assert seen.runs[0] is seen.runs[3]  # one RunInfo per runs row, not one per step
    assert seen.runs[4].hosts == ("h9",) and seen.runs[4].layer_names == NAMES
