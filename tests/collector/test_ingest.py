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


def _bad(doc_change):
    doc = make_batch().to_dict()
    doc_change(doc)
    return orjson.dumps(doc)


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
        (b"x" * (1024 * 1024 + 1), 413, "exceeds the limit"),
        (gzip.compress(b" " * (8 << 20)), 413, "decompressed body"),
        (gzip.compress(make_batch().to_json())[:-9], 400, "truncated"),
        (gzip.compress(make_batch().to_json()) + b"junk", 400, "after its end"),
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
    assert r.status_code == 422 and "not valid msgpack" in r.json()["detail"]
    assert counts(client) == {"steps": 0, "layers": 0, "ranks": 0}
