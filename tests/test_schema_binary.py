"""The binary columnar msgpack form: the tables JSON gives, bad columns refused by name."""

from __future__ import annotations

import math

import msgpack
import numpy as np
import pyarrow as pa
import pytest

from trainvitals.schema import (
    SchemaError,
    decode_json,
    decode_msgpack,
    encode_json,
    encode_msgpack,
    to_arrow,
)


def _doc() -> dict:
    """Three ranks rows: numpy columns, a NaN loss, an optional column with a null."""
    return {
        "schema_version": 1,
        "run_id": "r1",
        "ranks": {
            "step": np.array([7, 7, 7]),
            "rank": np.arange(3),
            "step_time_s": np.array([0.5, 0.6, 0.7]),
            "tokens_per_s": np.array([100, 90, 80]),  # ints for a float field: converted
            "loss": np.array([2.0, math.nan, 2.1]),
            "canary_fingerprint": pa.array([2**52 - 1, None, 5], pa.int64()),
        },
        "events": {
            "step": [7],
            "rank": [-1],
            "kind": ["checkpoint"],
            "detail": ["{}"],
            "time_unix_s": [1.0],
        },
    }


def test_binary_and_json_forms_give_the_same_tables() -> None:
    doc = _doc()
    body = encode_msgpack(doc)
    wire = msgpack.unpackb(body)
    assert isinstance(wire["ranks"]["loss"], bytes) and len(wire["ranks"]["loss"]) == 24
    assert set(wire["ranks"]["canary_fingerprint"]) == {"data", "valid"}
    assert isinstance(wire["events"]["kind"], list)  # strings stay lists
    _, binary = to_arrow(decode_msgpack(body))
    _, json = to_arrow(decode_json(encode_json(doc)))
    _, direct = to_arrow(doc)
    for tables in (json, direct):
        assert set(tables) == set(binary) == {"ranks", "events"}
        for name in binary:
            assert binary[name].schema == tables[name].schema
            # NaN != NaN: compare through the wire strings
            assert encode_json(_cols(binary[name])) == encode_json(_cols(tables[name]))
    ranks = binary["ranks"].to_pydict()
    assert ranks["canary_fingerprint"] == [2**52 - 1, None, 5]
    assert math.isnan(ranks["loss"][1]) and ranks["tokens_per_s"] == [100.0, 90.0, 80.0]
    assert ranks["run_id"] == ["r1"] * 3


def _cols(table: pa.Table) -> dict:
    return {"ranks": {k: v for k, v in table.to_pydict().items() if k != "run_id"}}


def _wire(**ranks) -> dict:
    """A decoded msgpack batch whose ranks columns are `ranks` on top of valid ones."""
    doc = msgpack.unpackb(encode_msgpack(_doc()))
    doc["ranks"].update(ranks)
    return doc


def _f64(*values: float) -> bytes:
    return np.array(values, dtype="<f8").tobytes()


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        (_wire(loss=b"\x00" * 12), "ranks.loss: 12 bytes is not a whole number of 8-byte"),
        (_wire(loss=_f64(1.0, 2.0)), "columns have different lengths"),
        (_wire(loss=[1.0, 2.0, 3.0], rank=_f64(0, 1)), "different lengths"),
        (_wire(step_time_s={"data": _f64(1, 1, 1), "valid": b"\x05"}), "required field has null"),
        (_wire(power_w={"data": _f64(1, 1, 1), "valid": b"\x07\x00"}), "valid bitmap of 2 bytes"),
        (_wire(power_w={"data": _f64(1, 1, 1), "valid": [1, 1, 1]}), "valid bitmap must be bytes"),
        (_wire(power_w={"data": _f64(1, 1, 1)}), "is {data, valid}"),
        (_wire(power_w={"data": "abc", "valid": b"\x07"}), "data must be bytes"),
        (_wire(step_time_s=_f64(0.5, math.inf, 0.7)), "ranks.step_time_s: values must be finite"),
        (_wire(rank=7), "ranks.rank: must be a list"),
    ],
)
def test_bad_binary_columns_are_refused_with_the_field_named(doc: dict, message: str) -> None:
    with pytest.raises(SchemaError, match=message):
        to_arrow(doc)


def test_a_string_field_cannot_be_binary() -> None:
    doc = msgpack.unpackb(encode_msgpack(_doc()))
    doc["events"]["kind"] = b"checkpoi"
    with pytest.raises(SchemaError, match=r"events\.kind: a string column must be a list"):
        to_arrow(doc)


@pytest.mark.parametrize(
    ("column", "message"),
    [
        (np.array([True, False, True]), "ranks.rank: expected int64, got a boolean"),
        (np.array([0.5, 1.0, 2.0]), "ranks.rank: expected int64 values, got numpy float64"),
        (np.zeros((3, 1), dtype=np.int64), "one-dimensional"),
        (pa.array([0.0, 1.0, 2.0]), "ranks.rank: expected int64 values, got double"),
    ],
)
def test_in_process_arrays_are_checked_too(column, message: str) -> None:
    doc = _doc()
    doc["ranks"]["rank"] = column
    with pytest.raises(SchemaError, match=message):
        to_arrow(doc)


def test_the_encoder_refuses_what_the_schema_lacks() -> None:
    doc = _doc()
    doc["ranks"]["rank_typo"] = np.arange(3)
    with pytest.raises(SchemaError, match="unknown field 'rank_typo'"):
        encode_msgpack(doc)
    doc = _doc()
    doc["ranks"]["rank"] = np.array([True, False, True])
    with pytest.raises(SchemaError, match="got a boolean"):
        encode_msgpack(doc)


def test_json_encoding_writes_nonfinite_values_as_the_wire_strings() -> None:
    body = encode_json(_doc())
    assert b'"loss":[2.0,"NaN",2.1]' in body
    assert b'"canary_fingerprint":[4503599627370495,null,5]' in body
