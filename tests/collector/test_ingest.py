"""Ingest: good batches are stored once; bad ones get a 4xx naming the problem and store nothing."""

from __future__ import annotations

import gzip

import orjson
import pytest

from .conftest import counts, make_batch

URL = "/api/v1/ingest"


def test_batch_is_stored_and_resend_is_not_a_duplicate(client) -> None:
    body = make_batch().to_json()
    for _ in range(2):
        r = client.post(URL, content=body, headers={"content-type": "application/json"})
        assert r.status_code == 202, r.text
    assert r.json()["accepted_rows"] == {"steps": 3, "layers": 6, "ranks": 6}
    assert counts(client) == {"steps": 3, "layers": 6, "ranks": 6}


def test_gzip_body(client) -> None:
    r = client.post(
        URL,
        content=gzip.compress(make_batch().to_json()),
        headers={"content-type": "application/json", "content-encoding": "gzip"},
    )
    assert r.status_code == 202, r.text
    assert counts(client)["layers"] == 6


def test_gzip_body_of_several_members(client) -> None:
    """RFC 1952 allows concatenated members (`cat a.gz b.gz`, pigz, some proxies)."""
    body = make_batch().to_json()
    half = len(body) // 2
    r = client.post(
        URL,
        content=gzip.compress(body[:half]) + gzip.compress(body[half:]),
        headers={"content-type": "application/json", "content-encoding": "gzip"},
    )
    assert r.status_code == 202, r.text
    assert counts(client) == {"steps": 3, "layers": 6, "ranks": 6}


def _bad(doc_change):
    doc = make_batch().to_dict()
    doc_change(doc)
    return orjson.dumps(doc)


def _runs_row(**changes) -> dict:
    """A runs table of one row, as the hooks send it at the start of a run."""
    row = {
        "started_unix_s": 1000.0, "model": "llama-tiny", "model_config_json": "{}",
        "n_params": 10, "n_layers": 2, "layer_names_json": '["block.0", "block.1"]',
        "world_size": 2, "dp": 2, "tp": 1, "device_type": "cpu", "device_name": "cpu",
        "hosts_json": '["h0", "h1"]', "flops_per_token": 60.0, "peak_flops_per_s": 1e12,
        "peak_flops_source": "measured",
    }  # fmt: skip
    return {k: [v] for k, v in {**row, **changes}.items()}


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        (b"{not json", 422, "not valid JSON"),
        (_bad(lambda d: d.update(schema_version=2)), 422, "schema_version"),
        (_bad(lambda d: d["steps"].update(loss=["x", 1, 2])), 422, "steps.loss"),
        (_bad(lambda d: d["layers"].update(layer=[0])), 422, "different lengths"),
        (
            _bad(lambda d: d["steps"].update(step_time_s=["Infinity", 1, 1])),
            422,
            "steps.step_time_s",
        ),
        (_bad(lambda d: d["ranks"].pop("rank")), 422, "ranks.rank"),
        (_bad(lambda d: d.update(schema_version=True)), 422, "schema_version True"),
        (_bad(lambda d: d.update(run_id="a/b")), 422, "run_id 'a/b' is not valid"),
        (_bad(lambda d: d.update(run_id="a\x00b")), 422, "is not valid: use 1-128 characters"),
        (_bad(lambda d: d.update(run_id="r" * 129)), 422, "is not valid"),
        (_bad(lambda d: d["steps"].update(step=[-3, -2, -1])), 422, "steps.step: -3 is outside"),
        (
            _bad(lambda d: d["steps"].update(step=[0, 1, 2**53])),
            422,
            "steps.step: 9007199254740992",
        ),
        (_bad(lambda d: d["ranks"].update(rank=[0, -1] * 3)), 422, "ranks.rank: -1 is outside"),
        (_bad(lambda d: d["steps"].update(step=[0, 1, 1])), 422, "steps: 2 rows have the same key"),
        (_bad(lambda d: d.update(runs=_runs_row(layer_names_json="not json"))), 422, "a JSON list"),
        (_bad(lambda d: d.update(runs=_runs_row(hosts_json="{}"))), 422, "runs.hosts_json"),
        (_bad(lambda d: d.update(runs=_runs_row(model_config_json="[]"))), 422, "JSON object"),
        (_bad(lambda d: d.update(runs=_runs_row(tp=0))), 422, "runs.tp: 0 is outside 1.."),
        (b"x" * (1024 * 1024 + 1), 413, "exceeds the limit"),
        (gzip.compress(b" " * (8 << 20)), 413, "decompressed body"),
        (gzip.compress(make_batch().to_json())[:-9], 400, "truncated"),
        (gzip.compress(make_batch().to_json()) + b"junk", 400, "after its end"),
        (gzip.compress(b"{") + gzip.compress(b"}")[:-3], 400, "is not a gzip member: truncated"),
        (gzip.compress(b"{") + gzip.compress(b" " * (8 << 20)), 413, "decompressed body"),
    ],
)
def test_bad_input_is_refused_and_nothing_is_stored(client, body, status, message) -> None:
    headers = {"content-type": "application/json"}
    if body[:2] == b"\x1f\x8b":
        headers["content-encoding"] = "gzip"
    r = client.post(URL, content=body, headers=headers)
    assert r.status_code == status, r.text
    assert message in r.json()["detail"]
    # A valid batch afterwards still lands: the collector keeps working.
    assert client.post(URL, content=make_batch("r2").to_json()).status_code == 202
    assert counts(client, "r1") == {"steps": 0, "layers": 0, "ranks": 0}
    assert counts(client, "r2")["steps"] == 3


def test_wrong_content_type(client) -> None:
    r = client.post(URL, content=b"a,b", headers={"content-type": "text/csv"})
    assert r.status_code == 415 and "application/json" in r.json()["detail"]


def test_a_valid_runs_row_is_accepted_and_listed(client) -> None:
    doc = make_batch().to_dict()
    doc["runs"] = _runs_row()
    assert client.post(URL, content=orjson.dumps(doc)).status_code == 202
    (run,) = client.get("/api/v1/runs").json()
    assert run["layer_names"] == ["block.0", "block.1"]


def test_content_type_is_case_insensitive_and_unknown_encodings_are_refused(client) -> None:
    body = make_batch().to_json()
    r = client.post(URL, content=body, headers={"content-type": "Application/JSON"})
    assert r.status_code == 202, r.text
    r = client.post(URL, content=body, headers={"content-encoding": "br"})
    assert r.status_code == 415 and "content-encoding 'br'" in r.json()["detail"]


def test_msgpack_keys_that_are_not_strings_are_named(client) -> None:
    import msgpack

    doc = {"schema_version": 1, "run_id": "r1", "steps": {b"zz": [1], "yy": [1.0]}}
    r = client.post(
        URL, content=msgpack.packb(doc), headers={"content-type": "application/msgpack"}
    )
    assert r.status_code == 422 and "unknown fields [\"b'zz'\", 'yy']" in r.json()["detail"]
    assert counts(client) == {"steps": 0, "layers": 0, "ranks": 0}


def test_bearer_token(settings) -> None:
    from fastapi.testclient import TestClient

    from trainvitals.collector.main import create_app

    settings.ingest_token = "s3cret"
    with TestClient(create_app(settings)) as c:
        body = make_batch().to_json()
        assert c.post(URL, content=body).status_code == 401
        assert (
            c.post(URL, content=body, headers={"authorization": "Bearer nope"}).status_code == 401
        )
        assert counts(c) == {"steps": 0, "layers": 0, "ranks": 0}
        assert (
            c.post(URL, content=body, headers={"authorization": "Bearer s3cret"}).status_code == 202
        )
        assert counts(c)["steps"] == 3
        # The scheme is case-insensitive (RFC 7235); the token is not.
        for header, status in (
            ("bearer s3cret", 202),
            ("BEARER s3cret", 202),
            ("bearer S3CRET", 401),
        ):
            assert (
                c.post(URL, content=body, headers={"authorization": header}).status_code == status
            )


def test_rejections_are_counted_in_metrics(client) -> None:
    client.post(URL, content=b"{")
    text = client.get("/metrics").text
    assert "trainvitals_collector_rejected_batches_total 1.0" in text


def test_msgpack_body_with_native_nan(client) -> None:
    import math

    import msgpack

    doc = make_batch().to_dict()
    doc["steps"]["loss"][1] = math.nan  # msgpack carries NaN as a float
    r = client.post(
        URL, content=msgpack.packb(doc), headers={"content-type": "application/msgpack"}
    )
    assert r.status_code == 202, r.text
    assert counts(client) == {"steps": 3, "layers": 6, "ranks": 6}


def test_malformed_msgpack_is_refused(client) -> None:
    r = client.post(URL, content=b"\xc1\xc1", headers={"content-type": "application/msgpack"})
    assert r.status_code == 422 and "not valid msgpack: " in r.json()["detail"]
    assert r.json()["detail"] != "body is not valid msgpack: "  # the reason is given
    assert counts(client) == {"steps": 0, "layers": 0, "ranks": 0}


def test_a_string_past_its_limit_gets_422_naming_the_field(client) -> None:
    """A 10 MB runs.model was stored: every /api/v1/runs answer was 10.5 MB after it."""
    doc = {"schema_version": 1, "run_id": "r1", "runs": _runs_row(model="m" * 5000)}
    r = client.post("/api/v1/ingest", content=orjson.dumps(doc))
    assert r.status_code == 422
    assert r.json()["detail"] == "runs.model: a value of 5000 bytes exceeds the limit of 4096 bytes"
    assert client.get("/api/v1/runs").json() == []
