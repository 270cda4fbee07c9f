"""The shared schema: what producers build is what consumers accept, and nothing else."""

from __future__ import annotations

import math

import orjson
import pytest

from trainvitals.schema import (
    SCHEMA_VERSION,
    STORE_TABLES,
    TABLES,
    BatchBuilder,
    SchemaError,
    ddl,
    decode_json,
    to_arrow,
)
from trainvitals.sender import merge
from trainvitals.simulate import FleetSpec, simulate


def _batch() -> BatchBuilder:
    b = BatchBuilder("r1")
    b.append("ranks", step=0, rank=0, step_time_s=0.5, tokens_per_s=100.0, loss=math.nan)
    b.append("ranks", step=0, rank=1, step_time_s=0.6, tokens_per_s=90.0, loss=2.0)
    return b


def test_round_trip_keeps_values_and_nonfinite() -> None:
    run_id, tables = to_arrow(decode_json(_batch().to_json()))
    assert run_id == "r1"
    ranks = tables["ranks"].to_pydict()
    assert ranks["run_id"] == ["r1", "r1"]
    assert ranks["step_time_s"] == [0.5, 0.6]
    assert math.isnan(ranks["loss"][0]) and ranks["loss"][1] == 2.0


def test_builder_refuses_unknown_field() -> None:
    with pytest.raises(SchemaError, match="unknown fields"):
        BatchBuilder("r").append("steps", step=1, loss_typo=2.0)


def _doc(**changes):
    doc = orjson.loads(_batch().to_json())
    doc.update(changes)
    return doc


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        (_doc(schema_version=99), "schema_version 99"),
        (_doc(run_id=""), "run_id"),
        (_doc(bogus={}), "unknown tables"),
        (_doc(ranks={"step": [0], "rank": [0]}), "ranks.step_time_s: required field is missing"),
        (_doc(ranks={**_doc()["ranks"], "rank": ["a", "b"]}), "ranks.rank: expected int64"),
        (_doc(ranks={**_doc()["ranks"], "rank": [1]}), "different lengths"),
        (_doc(ranks={**_doc()["ranks"], "step_time_s": ["NaN", 1.0]}), "ranks.step_time_s"),
        (_doc(ranks={**_doc()["ranks"], "step": [True, False]}), "boolean"),
        (_doc(ranks={**_doc()["ranks"], "rank": [0, 1.5]}), r"ranks.rank: .*whole numbers.*1\.5"),
        (_doc(ranks={**_doc()["ranks"], "rank": [0, None]}), "null"),
        (_doc(ranks={**_doc()["ranks"], "extra": [1, 2]}), "unknown fields"),
        (
            _doc(ranks={**_doc()["ranks"], "step_time_s": [0.5, -5.0]}),
            r"ranks.step_time_s: -5.0 is below 0; it cannot be negative",
        ),
        (_doc(ranks={**_doc()["ranks"], "wait_time_s": [-0.1, 0.0]}), "ranks.wait_time_s: -0.1"),
        (_doc(ranks=[1, 2]), "must be an object"),
        ([1, 2], "JSON object"),
        ({"schema_version": SCHEMA_VERSION, "run_id": "r"}, "holds no table"),
    ],
)
def test_bad_batches_are_refused_with_the_field_named(doc, message) -> None:
    with pytest.raises(SchemaError, match=message):
        to_arrow(doc)


def test_a_bounded_optional_field_takes_null() -> None:
    """Null (not measured) is not out of bounds."""
    _, tables = to_arrow(_doc(ranks={**_doc()["ranks"], "data_time_s": [None, 0.0]}))
    assert tables["ranks"].column("data_time_s").to_pylist() == [None, 0.0]


def test_whole_floats_in_an_integer_field_are_stored_as_integers() -> None:
    _, tables = to_arrow(_doc(ranks={**_doc()["ranks"], "rank": [0.0, 1.0]}))
    assert tables["ranks"].column("rank").to_pylist() == [0, 1]


def test_malformed_json() -> None:
    with pytest.raises(SchemaError, match="not valid JSON"):
        decode_json(b"{nope")


def test_ddl_declares_every_field_and_key() -> None:
    for table in STORE_TABLES.values():
        sql = ddl(table)
        assert all(f.name in sql for f in table.fields)
        assert f"PRIMARY KEY ({', '.join(table.key)})" in sql
    assert set(TABLES) == {"runs", "steps", "layers", "ranks", "events"}


def test_a_key_twice_in_one_batch_is_refused_in_any_order() -> None:
    ranks = {"step_time_s": [0.5] * 3, "tokens_per_s": [1.0] * 3, "loss": [2.0] * 3}
    doc = {"schema_version": SCHEMA_VERSION, "run_id": "r"}
    _, tables = to_arrow({**doc, "ranks": {**ranks, "step": [2, 1, 0], "rank": [0, 0, 0]}})
    assert tables["ranks"].column("step").to_pylist() == [2, 1, 0]  # unsorted, each key once
    with pytest.raises(SchemaError, match=r"ranks: 2 rows have the same key \(step=1, rank=0\)"):
        to_arrow({**doc, "ranks": {**ranks, "step": [1, 0, 1], "rank": [0, 0, 0]}})


def test_two_runs_rows_in_one_batch_are_refused() -> None:
    """The runs table's key is the run id alone: a batch carries one row of it. Two rows
    once crashed the key check (500), and the exporter then spooled every later batch of
    the run behind that one."""
    row = {
        "started_unix_s": 1000.0, "model": "m", "model_config_json": "{}", "n_params": 10,
        "n_layers": 2, "layer_names_json": "[]", "world_size": 2, "dp": 2, "tp": 1,
        "device_type": "cpu", "device_name": "cpu", "hosts_json": "[]",
        "flops_per_token": 60.0, "peak_flops_per_s": 1e12, "peak_flops_source": "measured",
    }  # fmt: skip
    doc = {"schema_version": SCHEMA_VERSION, "run_id": "r"}
    _, tables = to_arrow({**doc, "runs": {k: [v] for k, v in row.items()}})
    assert tables["runs"].num_rows == 1
    with pytest.raises(SchemaError, match=r"runs: 2 rows for one run; send one"):
        to_arrow({**doc, "runs": {k: [v, v] for k, v in row.items()}})


def test_strings_past_their_limit_are_named() -> None:
    """A 10 MB runs.model was stored, and every run list answered 10.5 MB after it."""
    from trainvitals.schema import MAX_STRING_BYTES, TABLES

    b = BatchBuilder("r1")
    b.append("events", step=1, rank=0, kind="k" * (MAX_STRING_BYTES + 1), detail="{}",
             time_unix_s=1.0)  # fmt: skip
    with pytest.raises(SchemaError, match=r"events\.kind: a value of 4097 bytes exceeds the limit"):
        to_arrow(b.to_dict())
    assert TABLES["runs"].by_name["hosts_json"].max_bytes >= 2**20  # a list per rank


def test_many_unknown_fields_are_named_by_a_few() -> None:
    doc = {"schema_version": 1, "run_id": "r1", "steps": {f"f{i:06d}": [1] for i in range(10_000)}}
    with pytest.raises(SchemaError, match=r"f000019', '\.\.\. 9980 more'\]") as e:
        to_arrow(doc)
    assert len(str(e.value)) < 1000


def _steps_columns(steps: list[int]) -> dict[str, list]:
    n = len(steps)
    floats = ("time_unix_s", "loss", "grad_norm", "step_time_s", "tokens_per_s",
              "tflops_per_s_per_device", "mfu_ratio")  # fmt: skip
    return {"step": steps, "tokens": [512] * n, **{f: [1.0] * n for f in floats}}


def test_rows_of_several_runs_validate_at_once_with_keys_unique_per_run() -> None:
    from trainvitals.schema import runs_to_arrow

    table = runs_to_arrow("steps", ["a", "a", "b"], _steps_columns([0, 1, 0]))
    assert table.column("run_id").to_pylist() == ["a", "a", "b"]
    assert table.column("step").to_pylist() == [0, 1, 0]
    with pytest.raises(SchemaError, match=r"2 rows have the same key \(run_id='b', step=1\)"):
        runs_to_arrow("steps", ["a", "b", "b"], _steps_columns([0, 1, 1]))
    with pytest.raises(SchemaError, match="run_id 'x/y' is not valid"):
        runs_to_arrow("steps", ["a", "x/y"], _steps_columns([0, 1]))
    with pytest.raises(SchemaError, match="steps: 1 run ids for 2 rows"):
        runs_to_arrow("steps", ["a"], _steps_columns([0, 1]))


def test_an_optional_field_with_choices_takes_null_and_refuses_others() -> None:
    doc = merge(list(simulate(FleetSpec(ranks=2, layers=1, step_time_s=1.0, steps=1))))
    assert "loss_scaling" not in doc["runs"]  # a producer older than the field
    _, tables = to_arrow(doc)
    assert tables["runs"].column("loss_scaling").to_pylist() == [None]
    doc["runs"]["loss_scaling"] = ["dynamic"]
    assert to_arrow(doc)[1]["runs"].column("loss_scaling").to_pylist() == ["dynamic"]
    doc["runs"]["loss_scaling"] = ["fp16"]
    with pytest.raises(SchemaError, match=r"runs.loss_scaling: 'fp16' is not one of"):
        to_arrow(doc)
