"""POST /api/v1/heartbeats: stored with the receive time; bad batches get a 4xx naming the
field and store nothing; the watchdog names a silent rank on the clock alone."""

from __future__ import annotations

import time

import duckdb
import msgpack
import orjson
import pytest

URL = "/api/v1/heartbeats"


def beat(ranks=(0, 1), phase="forward", **changes) -> dict:
    n = len(ranks)
    cols = {
        "rank": list(ranks),
        "time_unix_s": [time.time()] * n,
        "host": ["node0"] * n,
        "step_started": [5] * n,
        "step_finished": [4] * n,
        "phase": [phase] * n,
    }
    cols.update(changes)
    return {"schema_version": 1, "run_id": "r1", "heartbeats": cols}


def stored(client) -> list[dict]:
    client.app.state.watchdog.flush()  # the heartbeats it took, to the store's writer
    store = client.app.state.store
    store.flush()
    return store.query("SELECT * FROM heartbeats ORDER BY rank").to_pylist()


def test_a_batch_of_ranks_is_stored_with_the_receive_time(client) -> None:
    before = time.time()
    r = client.post(URL, json=beat(ranks=range(8)))
    assert r.status_code == 202, r.text
    assert r.json()["accepted_rows"] == {"heartbeats": 8}
    rows = stored(client)
    assert [row["rank"] for row in rows] == list(range(8))
    assert all(before <= row["received_unix_s"] <= time.time() for row in rows)


def test_msgpack_is_accepted(client) -> None:
    body = msgpack.packb(beat(ranks=[3]))
    r = client.post(URL, content=body, headers={"content-type": "application/msgpack"})
    assert r.status_code == 202, r.text
    assert stored(client)[0]["phase"] == "forward"


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        (beat(phase="dancing"), "heartbeats.phase: 'dancing' is not one of"),
        (beat(rank=[0, -1]), "heartbeats.rank: -1 is outside"),
        (beat(step_finished=[4, None]), "heartbeats.step_finished: required field has null"),
        (beat(received_unix_s=[1.0, 1.0]), "heartbeats.received_unix_s: set by the collector"),
        (beat(host=["a"]), "heartbeats: columns have different lengths"),
        ({**beat(), "steps": {}}, "unknown keys ['steps']"),
        ({**beat(), "run_id": "no spaces"}, "run_id 'no spaces' is not valid"),
        (beat(ranks=(1, 1), time_unix_s=[7.0, 7.0]), "2 rows have the same key"),
    ],
)
def test_bad_batches_are_refused_by_field_and_store_nothing(client, doc, message) -> None:
    r = client.post(URL, json=doc)
    assert r.status_code == 422 and message in r.json()["detail"], r.text
    assert stored(client) == []
    metrics = client.get("/metrics").text
    assert "trainvitals_collector_rejected_batches_total 1.0" in metrics


def test_the_ingest_token_guards_heartbeats_too(settings) -> None:
    from fastapi.testclient import TestClient

    from trainvitals.collector.main import create_app

    settings.ingest_token = "s3cret"
    with TestClient(create_app(settings)) as client:
        assert client.post(URL, json=beat()).status_code == 401
        ok = client.post(URL, json=beat(), headers={"authorization": "Bearer s3cret"})
        assert ok.status_code == 202
        assert len(stored(client)) == 2


def test_the_watchdog_names_a_silent_rank_without_any_step(client) -> None:
    watchdog = client.app.state.watchdog
    now = [time.time()]
    watchdog.clock = lambda: now[0]  # the thread ticks on this clock too
    assert client.post(URL, json=beat(ranks=[0, 1])).status_code == 202
    sent = time.time()
    assert client.post(URL, json=beat(ranks=[0], time_unix_s=[sent])).status_code == 202
    now[0] = time.time() + 5
    assert watchdog.tick() == []  # 5 s of silence: not yet
    now[0] = time.time() + 30
    watchdog.tick()
    alerts = client.app.state.store.query("SELECT kind, rank, message FROM alerts").to_pylist()
    assert [(a["kind"], a["rank"]) for a in alerts] == [("rank_lost", 1)]
    assert "rank 1 on node0" in alerts[0]["message"]
    metrics = client.get("/metrics").text
    assert 'trainvitals_alerts_total{kind="rank_lost",rank="1",run_id="r1"} 1.0' in metrics
    for name in ("watchdog_errors", "heartbeats_dropped", "heartbeats_late"):
        assert f"trainvitals_collector_{name}_total 0.0" in metrics


def test_metrics_say_which_runs_are_in_a_declared_pause(client) -> None:
    watchdog = client.app.state.watchdog
    now = [time.time() + 2]
    watchdog.clock = lambda: now[0]  # the thread ticks on this clock too
    assert client.post(URL, json=beat(ranks=[0, 1], phase="checkpoint")).status_code == 202
    watchdog.tick()
    assert 'trainvitals_run_paused{phase="checkpoint",run_id="r1"} 1.0' in (
        client.get("/metrics").text
    )
    # One rank leaves the pause, the other waits for nothing: the job is no longer paused.
    assert client.post(URL, json=beat(ranks=[1], phase="data_wait")).status_code == 202
    now[0] = time.time() + 2
    watchdog.tick()
    assert "trainvitals_run_paused{" not in client.get("/metrics").text


def test_replay_of_the_stored_heartbeats_raises_the_live_alerts(client) -> None:
    from trainvitals.analyzer.replay import comparable, replay_liveness

    watchdog = client.app.state.watchdog
    now = [time.time()]
    watchdog.clock = lambda: now[0]
    for step in range(3):  # rank 1 stops after the first heartbeat; rank 0 goes on
        ranks = [0, 1] if step == 0 else [0]
        doc = beat(ranks=ranks, step_started=[step] * len(ranks), step_finished=[step] * len(ranks))
        assert client.post(URL, json=doc).status_code == 202
    now[0] = time.time() + 30
    watchdog.tick()
    store = client.app.state.store
    store.flush()  # the heartbeats the tick handed to the writer
    live = store.query("SELECT * FROM alerts").to_pylist()
    assert [(a["kind"], a["rank"]) for a in live] == [("rank_lost", 1), ("rank_lost", 0)][:1]
    replayed = [a.to_dict() for a in replay_liveness(store.cursor())]
    assert sorted(map(comparable, replayed)) == sorted(map(comparable, live))
    assert [a["time_unix_s"] for a in replayed] == [a["time_unix_s"] for a in live]


def _beats(run_id: str, ranks: list[int], finished: int, received_s: float, phase="forward"):
    """A validated heartbeat table of `ranks`, stamped as received at `received_s`."""
    from trainvitals.schema import heartbeats_to_arrow

    doc = beat(
        ranks=ranks,
        phase=phase,
        time_unix_s=[received_s] * len(ranks),
        step_started=[finished + 1] * len(ranks),
        step_finished=[finished] * len(ranks),
    )
    return heartbeats_to_arrow({**doc, "run_id": run_id}, received_s)[1]


def _a_step_every_5_s(watchdog, now: list[float], run_ids: tuple[str, ...]) -> None:
    """Runs of 3 ranks that finish steps 0-10, one every 5 s from now[0] (the watchdog's
    clock, moved here), each heard and judged at once."""
    t0 = now[0]
    for k in range(11):
        now[0] = t0 + 5 * k
        for run_id in run_ids:
            watchdog.observe(run_id, _beats(run_id, [0, 1, 2], k, now[0]))
        watchdog.tick()


def test_a_restarted_collector_rebuilds_the_watchdog_from_the_stored_heartbeats(
    settings,
) -> None:
    # Three runs of 3 ranks finish a step every 5 s until t0 + 50, when the collector stops.
    # It starts again at t0 + 1000 on the same store. In run a, rank 2 crashed while it was
    # down; in run b every rank is alive but no step completes any more; run c is never
    # heard again. Without the
    # stored state the new watchdog never heard of rank 2 (it would never be named) and
    # would wait first_step_s (600 s) for a hang; rebuilt, it names rank 2 and raises the
    # hang at 10 x the 5 s learned before the restart.
    from fastapi.testclient import TestClient

    from trainvitals.collector.main import create_app

    t0 = 1_700_000_000.0
    now = [t0]
    clock = lambda: now[0]  # noqa: E731
    with TestClient(create_app(settings, watchdog_clock=clock)) as client:
        watchdog = client.app.state.watchdog
        _a_step_every_5_s(watchdog, now, ("a", "b", "c"))
        assert client.app.state.store.query("SELECT * FROM alerts").num_rows == 0
    now[0] = t0 + 1000
    with TestClient(create_app(settings, watchdog_clock=clock)) as client:
        watchdog = client.app.state.watchdog
        assert sorted(watchdog.watchdog.open_runs()) == ["a", "b", "c"]
        assert watchdog.tick() == []  # the downtime is nobody's silence
        for k in range(1, 13):  # heartbeats go on, no step completes
            now[0] = t0 + 1000 + 5 * k
            watchdog.observe("a", _beats("a", [0, 1], 10, now[0]))
            watchdog.observe("b", _beats("b", [0, 1, 2], 10, now[0]))
            watchdog.tick()
        alerts = client.app.state.store.query(
            "SELECT run_id, kind, rank, baseline, time_unix_s, message FROM alerts ORDER BY run_id"
        ).to_pylist()
    (lost, hang, unknown) = alerts
    assert (lost["run_id"], lost["kind"], lost["rank"]) == ("a", "rank_lost", 2)
    assert lost["time_unix_s"] == t0 + 1000 + 10  # silence_s after the restart
    assert "while other ranks of the run have" in lost["message"]
    assert "last heard 960 s before" in lost["message"].lower()  # at t0 + 50, not 10 s
    # Run c ended, or died, while the collector was down: nobody is heard again, and who
    # went silent first is not known (they all share the restart's deadline).
    assert (unknown["run_id"], unknown["kind"], unknown["rank"]) == ("c", "rank_lost", None)
    assert "no rank of the run has been heard since the collector restarted" in (unknown["message"])
    assert (hang["run_id"], hang["kind"]) == ("b", "hang")
    assert hang["baseline"] == 50.0  # 10 x the 5 s per step learned before the restart
    assert hang["time_unix_s"] == t0 + 1000 + 50


def _pause_events(run_id: str, pauses: list[tuple[int, str, float]]):
    """An events table of `pause:<phase>` events (step, phase, duration), as rank 0's
    monitor records them."""
    from trainvitals.schema import BatchBuilder, to_arrow

    b = BatchBuilder(run_id)
    for step, phase, duration_s in pauses:
        detail = orjson.dumps({"duration_s": duration_s}).decode()
        b.append("events", step=step, rank=-1, kind=f"pause:{phase}", detail=detail,
                 time_unix_s=1_700_000_000.0 + step)  # fmt: skip
    return to_arrow(orjson.loads(b.to_json()))[1]["events"]


def test_a_restarted_collector_keeps_the_pause_lengths_the_run_came_back_from(
    settings,
) -> None:
    # A run's checkpoint saves took 70 s and 90 s (their pause events in the store); the
    # collector restarts, and the run's next save never ends. Rebuilt, the watchdog allows
    # it 3 x 90 s, at least 300 s, as it would have without the restart: not pause_s
    # (1800 s). A 2,000 s evaluation during which a hang was raised teaches nothing, live
    # or restored: evaluations still get pause_s.
    from fastapi.testclient import TestClient

    from trainvitals.analyzer.alerts import Alert
    from trainvitals.collector.analysis import insert_alerts
    from trainvitals.collector.main import create_app

    t0 = 1_700_000_000.0
    now = [t0]
    clock = lambda: now[0]  # noqa: E731
    with TestClient(create_app(settings, watchdog_clock=clock)) as client:
        store, watchdog = client.app.state.store, client.app.state.watchdog
        _a_step_every_5_s(watchdog, now, ("p",))
        pauses = [(3, "checkpoint", 70.0), (6, "checkpoint", 90.0), (8, "eval", 2000.0)]
        store.submit("p", {"events": _pause_events("p", pauses)}).result()
        hang = Alert("p", 8, "hang", "critical", "hung", t0 + 40)
        insert_alerts(store.cursor(), [hang, hang.resolved_at(9, t0 + 45, "over")])
    now[0] = t0 + 1000
    with TestClient(create_app(settings, watchdog_clock=clock)) as client:
        watchdog = client.app.state.watchdog
        run = watchdog.watchdog._runs["p"]
        assert run.longest_pause_s == {"checkpoint": 90.0}
        limit_s, why = watchdog.watchdog.pause_threshold_s(run, ("checkpoint",))
        assert limit_s == 300.0 and "came back from (90 s)" in why
        assert watchdog.watchdog.pause_threshold_s(run, ("eval",))[0] == 1800.0
        for k in range(1, 80):  # every rank saves from the restart on, and never finishes
            now[0] = t0 + 1000 + 5 * k
            watchdog.observe("p", _beats("p", [0, 1, 2], 10, now[0], phase="checkpoint"))
            watchdog.tick()
    with duckdb.connect(settings.store_path, read_only=True) as con:
        alerts = (
            con.sql("SELECT kind, time_unix_s, message FROM alerts WHERE step > 9")
            .to_arrow_table()
            .to_pylist()
        )
    assert [a["kind"] for a in alerts] == ["hang"], alerts
    assert alerts[0]["time_unix_s"] == t0 + 1000 + 300
    assert "3x the longest this run came back from (90 s)" in alerts[0]["message"]


def test_a_stop_judges_the_heartbeats_of_its_last_second(settings) -> None:
    """The watchdog judges `lag_s` behind its clock; a collector stopped within that lag of
    a run's last heartbeats ("ended") still judges them, as a replay of the store does.
    Seen in CI beside two busy loops: the live store lacked the rank_lost's resolve."""
    from fastapi.testclient import TestClient

    from trainvitals.analyzer.replay import comparable, replay_liveness
    from trainvitals.collector.main import create_app

    t0 = 1_700_000_000.0
    now = [t0]
    with TestClient(create_app(settings, watchdog_clock=lambda: now[0])) as client:
        watchdog = client.app.state.watchdog
        for k in range(13):  # rank 1 is heard at t0 only; rank 0 every second to t0 + 12
            now[0] = t0 + k
            watchdog.observe("a", _beats("a", [0, 1] if k == 0 else [0], 3, now[0]))
            watchdog.tick()
        watchdog.observe("a", _beats("a", [0], 3, t0 + 12.5, phase="ended"))
        now[0] = t0 + 12.6  # the stop comes before a tick judged t0 + 12.5 (lag_s: 1 s)
        watchdog.tick()
    with duckdb.connect(settings.store_path, read_only=True) as con:
        live = con.sql("SELECT * FROM alerts ORDER BY time_unix_s").to_arrow_table().to_pylist()
        replayed = [a.to_dict() for a in replay_liveness(con)]
    assert [(a["kind"], a["severity"], a["rank"]) for a in live] == [
        ("rank_lost", "critical", 1),
        ("rank_lost", "resolved", 1),
    ]
    assert live[1]["time_unix_s"] == t0 + 12.5 and "the run ended" in live[1]["message"]
    assert sorted(map(comparable, replayed)) == sorted(map(comparable, live))


@pytest.mark.parametrize("stop", [True, False])
def test_a_supervisor_stop_ends_the_run_live_and_in_replay(settings, stop) -> None:
    """The supervisor's `action:stop` event, posted to ingest before it stops the ranks:
    node1's ranks 2 and 3, fenced and never heard again, are not lost when the job is
    relaunched on node0 (without the event they are), and replay agrees."""
    from fastapi.testclient import TestClient

    from trainvitals.analyzer.replay import comparable, replay_liveness
    from trainvitals.collector.main import create_app
    from trainvitals.schema import BatchBuilder

    t0 = 1_700_000_000.0
    now = [t0]
    with TestClient(create_app(settings, watchdog_clock=lambda: now[0])) as client:
        watchdog = client.app.state.watchdog
        for k in range(11):  # 4 ranks finish a step a second until the stop at t0 + 10.5
            now[0] = t0 + k
            watchdog.observe("a", _beats("a", [0, 1, 2, 3], 100 + k, now[0]))
            watchdog.tick()
        if stop:
            b = BatchBuilder("a")
            event = {"kind": "action:stop", "detail": "{}", "time_unix_s": t0 + 10.5}
            b.append("events", step=110, rank=-1, **event)
            headers = {"Content-Type": "application/json"}
            r = client.post("/api/v1/ingest", content=b.to_json(), headers=headers)
            assert r.is_success, r.text
            client.app.state.store.flush()
        watchdog.observe("a", _beats("a", [0, 1, 2, 3], 110, t0 + 10.8, phase="exited"))
        for k in range(14, 40):  # relaunched on node0 from the checkpoint of step 104
            now[0] = t0 + k
            watchdog.observe("a", _beats("a", [0, 1], 104 + k - 14, now[0]))
            watchdog.tick()
    with duckdb.connect(settings.store_path, read_only=True) as con:
        live = con.sql("SELECT * FROM alerts ORDER BY time_unix_s").to_arrow_table().to_pylist()
        replayed = [a.to_dict() for a in replay_liveness(con)]
    expected = [] if stop else [("rank_lost", "critical", 2), ("rank_lost", "resolved", 2)]
    assert [(a["kind"], a["severity"], a["rank"]) for a in live] == expected
    assert sorted(map(comparable, replayed)) == sorted(map(comparable, live))
