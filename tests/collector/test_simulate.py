"""Simulated fleets into a real collector: every row stored once, live alerts = replayed alerts."""

from __future__ import annotations

import random
import time

import duckdb
import pyarrow as pa
import pytest
from fastapi.testclient import TestClient

from tests.conftest import CollectorProcess
from trainvitals.analyzer import Analyzer
from trainvitals.analyzer.replay import comparable, replay_store, stored_alerts
from trainvitals.collector.analysis import follow
from trainvitals.collector.main import create_app
from trainvitals.collector.store import Store, StoreError
from trainvitals.schema import encode_msgpack, to_arrow
from trainvitals.sender import merge, send
from trainvitals.simulate import FleetSpec, simulate

from .conftest import counts

URL = "/api/v1/ingest"
MSGPACK = {"content-type": "application/msgpack"}
FAULTS = (
    "straggler:rank=17,step=5,slowdown=0.3",
    "sdc:rank=100,step=12",
    "spike:step=30,factor=4",
)


def _stored(store: str, run_id: str) -> dict[str, int]:
    with duckdb.connect(store, read_only=True) as con:
        return {
            t: con.execute(f"SELECT count(*) FROM {t} WHERE run_id = ?", [run_id]).fetchone()[0]
            for t in ("runs", "steps", "layers", "ranks", "events")
        }


def _live_and_replayed(store: str) -> tuple[list, list]:
    with duckdb.connect(store, read_only=True) as con:
        live = sorted(map(comparable, stored_alerts(con)))
        replayed = sorted(comparable(a.to_dict()) for a in replay_store(con))
    return live, replayed


@pytest.mark.slow
@pytest.mark.parametrize("per_node", [False, True], ids=["per-step", "per-node"])
def test_simulated_run_is_stored_whole_over_concurrent_connections(tmp_path, per_node) -> None:
    store = tmp_path / "store.duckdb"
    collector = CollectorProcess(store)
    spec = FleetSpec(ranks=256, layers=8, step_time_s=1.0, steps=40, canary_every=10,
                     faults=FAULTS, ranks_per_node=64)  # fmt: skip
    try:
        # Small batches on 4 connections: they commit in any order, and in per-node mode a
        # step's ranks rows arrive in 4 requests besides the one holding its steps row.
        report = send(
            simulate(spec, per_node=per_node), collector.url, connections=4, batch_points=1
        )
    finally:
        collector.stop()  # a clean stop: the writer and the live analyzer finish first
    assert report.rejected == []
    assert report.batches == (1 + 40 * 4 if per_node else 41)
    stored = _stored(str(store), spec.run_id)
    assert stored == {t: report.rows_sent[t] for t in stored}
    assert stored["ranks"] == 256 * 40 and stored["events"] == len(FAULTS) + 1  # + run_end
    live, replayed = _live_and_replayed(str(store))
    assert live == replayed
    assert {"sdc", "straggler"} <= {kind for _, _, kind, *_ in live}


def test_batches_committed_out_of_order_are_analysed_in_step_order(settings) -> None:
    spec = FleetSpec(ranks=32, layers=4, step_time_s=1.0, steps=60, faults=("spike:step=45",))
    docs = list(simulate(spec))
    batches = [merge(docs[i : i + 5]) for i in range(1, len(docs), 5)]
    random.Random(3).shuffle(batches)  # what concurrent connections may do to them
    # The analysis clock stands still: every batch lands within the live analysis's delay,
    # however slowly the machine posts them (the flush then analyses what is committed).
    with TestClient(create_app(settings, analysis_clock=lambda: 0.0)) as client:
        for doc in [docs[0], *batches]:
            r = client.post(URL, content=encode_msgpack(doc), headers=MSGPACK)
            assert r.status_code == 202
        client.app.state.store.flush()
        alerts = client.get(f"/api/v1/runs/{spec.run_id}/alerts").json()
    assert [(a["kind"], a["step"]) for a in alerts] == [("loss_spike", 45)]


def test_binary_batch_is_stored_and_a_bad_one_is_refused_whole(client) -> None:
    spec = FleetSpec(ranks=8, layers=2, step_time_s=1.0, steps=3)
    doc = merge(list(simulate(spec)))
    r = client.post(URL, content=encode_msgpack(doc), headers=MSGPACK)
    assert r.status_code == 202, r.text
    assert r.json()["accepted_rows"] == {"runs": 1, "steps": 3, "layers": 6, "ranks": 24,
                                         "events": 1}  # fmt: skip
    bad = merge(list(simulate(FleetSpec(ranks=8, layers=2, step_time_s=1.0, steps=3, seed=1))))
    bad["ranks"]["step_time_s"][5] = float("inf")
    r = client.post(URL, content=encode_msgpack(bad), headers=MSGPACK)
    assert r.status_code == 422 and "ranks.step_time_s" in r.json()["detail"]
    assert counts(client, "sim-1") == {"steps": 0, "layers": 0, "ranks": 0}
    assert counts(client, "sim-0") == {"steps": 3, "layers": 6, "ranks": 24}


def test_one_failing_batch_of_a_group_commit_fails_alone(tmp_path) -> None:
    store = Store(str(tmp_path / "s.duckdb"))
    good = [to_arrow(merge(list(simulate(FleetSpec(4, 2, 1.0, 3, run_id=f"ok{i}")))))
            for i in range(2)]  # fmt: skip
    run_id, tables = to_arrow(merge(list(simulate(FleetSpec(4, 2, 1.0, 3, run_id="bad")))))
    # Past validation, but not storable: the writer's INSERT fails on it.
    ranks = tables["ranks"]
    tables["ranks"] = ranks.set_column(2, "rank", pa.array(["x"] * ranks.num_rows))
    futures = [store.submit(*good[0]), store.submit(run_id, tables), store.submit(*good[1])]
    store.start()  # the writer takes all three as one group
    try:
        store.flush()
        assert futures[0].result() is None and futures[2].result() is None
        with pytest.raises(StoreError, match="batch not stored"):
            futures[1].result()
        stored = store.query("SELECT run_id, count(*) AS n FROM ranks GROUP BY 1 ORDER BY 1")
        assert stored.to_pylist() == [{"run_id": "ok0", "n": 12}, {"run_id": "ok1", "n": 12}]
        assert (
            store.query("SELECT count(*) FROM steps WHERE run_id = 'bad'").column(0)[0].as_py() == 0
        )
        assert store.writes.write_errors == 1
    finally:
        store.close()


def test_a_resent_step_is_analysed_as_stored_first_copy_wins(tmp_path) -> None:
    spec = FleetSpec(ranks=16, layers=2, step_time_s=1.0, steps=60, faults=("spike:step=45",))
    docs = list(simulate(spec))
    calm = list(simulate(FleetSpec(ranks=16, layers=2, step_time_s=1.0, steps=60)))[46]
    path = str(tmp_path / "s.duckdb")
    store = Store(path)
    # Nothing is analysed before the flush (the clock stands still), but the buffer is
    # tiny: the writer waits for room.
    follow(store, Analyzer(), clock=lambda: 0.0, max_rows=100)
    store.start()
    try:
        # Every step twice, and step 45 a third time without its spike: the store keeps the
        # first copy of each key, and so must the analyzer.
        futures = [store.submit(*to_arrow(d)) for d in (*docs, *docs[1:], calm)]
        store.flush(60)
        assert all(f.exception() is None for f in futures)
    finally:
        store.close()
    live, replayed = _live_and_replayed(path)
    assert live == replayed
    assert [(kind, step) for _, step, kind, *_ in live] == [("loss_spike", 45)]


def test_the_analysis_progress_says_when_every_stored_step_is_analysed(settings) -> None:
    spec = FleetSpec(ranks=8, layers=2, step_time_s=1.0, steps=20, faults=("spike:step=19",))
    now = [0.0]  # the live analysis's clock: a step is due 1 s after its commit
    with TestClient(create_app(settings, analysis_clock=lambda: now[0])) as client:
        store = client.app.state.store
        r = client.post(URL, content=encode_msgpack(merge(list(simulate(spec)))), headers=MSGPACK)
        assert r.status_code == 202
        while store.unwritten_batches:  # written, and handed to the analysis: not yet due
            time.sleep(0.01)
        path = f"/api/v1/runs/{spec.run_id}/analysis"
        before = client.get(path).json()
        now[0] = 5.0  # past the delay: the analysis thread takes the steps
        store.flush()  # and stores their alerts
        after = client.get(path).json()
        alerts = client.get(f"/api/v1/runs/{spec.run_id}/alerts").json()
        unknown = client.get("/api/v1/runs/nobody/analysis")
    assert before == {"run_id": spec.run_id, "live": True, "stored_step": 19,
                      "analysed_step": None, "pending": True, "caught_up": False}  # fmt: skip
    assert after == {**before, "analysed_step": 19, "pending": False, "caught_up": True}
    assert [(a["kind"], a["step"]) for a in alerts] == [("loss_spike", 19)]
    assert unknown.status_code == 404 and "nobody" in unknown.json()["detail"]
