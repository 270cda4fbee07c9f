"""/metrics says what the store holds: merged per-node batches, resends, restarts."""

from __future__ import annotations

from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from trainvitals.analyzer import Alert, Analyzer
from trainvitals.collector.analysis import follow, insert_alerts
from trainvitals.collector.main import create_app
from trainvitals.collector.metrics import TrainvitalsCollector
from trainvitals.collector.state import LiveState
from trainvitals.collector.store import Store
from trainvitals.schema import BatchBuilder, to_arrow

from .conftest import counts

URL = "/api/v1/ingest"


def _steps(run_id: str, steps: range, loss: float = 2.0) -> BatchBuilder:
    b = BatchBuilder(run_id)
    for step in steps:
        b.append("steps", step=step, time_unix_s=1.7e9 + step, loss=loss, grad_norm=1.0,
                 tokens=1000, step_time_s=0.5, tokens_per_s=2000.0,
                 tflops_per_s_per_device=1.0, mfu_ratio=0.3)  # fmt: skip
    return b


def _ranks(run_id: str, step: int, times_s: dict[int, float]) -> BatchBuilder:
    """One node's ranks rows of one step: rank -> step time in seconds."""
    b = BatchBuilder(run_id)
    for rank, seconds in times_s.items():
        b.append("ranks", step=step, rank=rank, step_time_s=seconds, tokens_per_s=100.0, loss=2.0)
    return b


def _post(client: TestClient, batch: BatchBuilder) -> None:
    assert client.post(URL, content=batch.to_json()).status_code == 202


def _samples(client: TestClient, name: str) -> dict[tuple, float]:
    """Samples of one metric family: label values -> value."""
    for family in text_string_to_metric_families(client.get("/metrics").text):
        if family.name == name:
            return {tuple(s.labels.values()): s.value for s in family.samples}
    return {}


def test_rank_summary_merges_a_steps_batches_and_ignores_older_steps(settings) -> None:
    with TestClient(create_app(settings)) as client:
        _post(client, _steps("m2", range(10, 11)))
        _post(client, _ranks("m2", 10, {0: 1.0, 1: 1.0}))  # one batch per node
        _post(client, _ranks("m2", 10, {2: 1.0, 3: 9.0}))
        _post(client, _ranks("m2", 10, {4: 1.0, 5: 1.0}))
        _post(client, _ranks("m2", 3, {0: 50.0, 1: 50.0}))  # late, of an older step
        live = _samples(client, "trainvitals_rank_step_time_seconds")
    assert live == {("m2", "median"): 1.0, ("m2", "p99"): 9.0, ("m2", "max"): 9.0}
    with TestClient(create_app(settings)) as restarted:  # rebuilt from the store
        assert _samples(restarted, "trainvitals_rank_step_time_seconds") == live


def test_a_resent_step_keeps_the_stored_values_in_metrics(client) -> None:
    _post(client, _steps("r1", range(10, 11), loss=2.0))
    _post(client, _steps("r1", range(10, 11), loss=99.0))  # the store keeps the first copy
    counts(client)
    stored = client.get("/api/v1/runs/r1/steps").json()["columns"]["loss"]
    assert stored == [2.0]
    assert _samples(client, "trainvitals_loss") == {("r1",): 2.0}


def test_ingested_rows_count_only_rows_written(client) -> None:
    for _ in range(2):
        _post(client, _steps("r1", range(3)))
    counts(client)
    rows = _samples(client, "trainvitals_collector_ingested_rows")
    assert rows == {("steps",): 3.0}


def test_a_group_with_a_resend_passes_on_each_batchs_new_rows(tmp_path) -> None:
    """Batches queued together are one commit; the overlap goes to the first one only."""
    store = Store(str(tmp_path / "s.duckdb"))
    live = LiveState()
    store.listen(live)
    follow(store, Analyzer(), live, delay_s=0)
    try:
        for batch in (_steps("r1", range(3), loss=2.0), _steps("r1", range(2, 5), loss=7.0)):
            store.submit(*to_arrow(batch.to_dict()))
        store.start()  # the writer finds both waiting: one group
        store.flush()
        assert store.writes.commits == 1
        assert live.stats.ingested_rows == {"steps": 5}
        stored = store.query("SELECT step, loss FROM steps ORDER BY step").to_pylist()
        assert [r["loss"] for r in stored] == [2.0, 2.0, 2.0, 7.0, 7.0]
        assert live.runs["r1"].latest["loss"] == 7.0
    finally:
        store.close()


class _Recorder(Analyzer):
    """An analyzer that notes the tensor-parallel degree of each runs table it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.tp_seen: list[int] = []

    def observe(self, run_id, tables):
        if "runs" in tables:
            self.tp_seen.append(tables["runs"].column("tp")[0].as_py())
        return super().observe(run_id, tables)


def _runs_row(tp: int) -> dict[str, list]:
    row = {
        "started_unix_s": 1.7e9, "model": "m", "model_config_json": "{}", "n_params": 10,
        "n_layers": 0, "layer_names_json": "[]", "world_size": 2, "dp": 2 // tp, "tp": tp,
        "device_type": "cpu", "device_name": "cpu", "hosts_json": '["h0"]',
        "flops_per_token": 6.0, "peak_flops_per_s": 1e12, "peak_flops_source": "given",
    }  # fmt: skip
    return {k: [v] for k, v in row.items()}


def test_analyzer_keeps_the_stored_runs_row_when_it_is_resent_changed(tmp_path) -> None:
    recorder = _Recorder()
    store = Store(str(tmp_path / "s.duckdb"))
    follow(store, recorder, delay_s=0)
    store.start()
    try:
        for tp, steps in ((1, range(3)), (2, range(3, 6))):
            doc = _steps("r1", steps).to_dict()
            doc["runs"] = _runs_row(tp)
            store.submit(*to_arrow(doc)).result(timeout=60)
            store.flush()
        assert store.query("SELECT tp FROM runs").column(0).to_pylist() == [1]
        assert recorder.tp_seen == [1, 1]
    finally:
        store.close()


def _straggler(step: int, rank: int = 3) -> Alert:
    return Alert("r1", step, "straggler", "warning", "slow", 1.7e9 + step, rank=rank, start_step=2)


def test_an_episode_is_active_from_its_alert_to_its_resolve_and_after_a_restart(tmp_path) -> None:
    raised = _straggler(9)
    spike = Alert("r1", 9, "loss_spike", "warning", "spike", 1.7e9 + 9)
    live = LiveState()
    live.count_alerts("r1", [raised, spike])
    assert live.runs["r1"].active == {("straggler", 3): 2}  # a spike is no episode
    store = Store(str(tmp_path / "s.duckdb"))
    store.start()
    try:
        cur = store.cursor()
        insert_alerts(cur, [raised, spike])
        restarted = LiveState()
        restarted.load(store.query)
        assert restarted.runs["r1"].active == {("straggler", 3): 2}
        resolve = raised.resolved_at(20, 1.7e9 + 20, "back to normal")
        live.count_alerts("r1", [resolve])
        insert_alerts(cur, [resolve])
        restarted = LiveState()
        restarted.load(store.query)
    finally:
        store.close()
    assert live.runs["r1"].active == {} == restarted.runs["r1"].active
    # A resolve is not an alert raised.
    assert live.runs["r1"].alerts_by_kind[("straggler", 3)] == 1
    assert restarted.runs["r1"].alerts_by_kind[("straggler", 3)] == 1


def test_metrics_show_an_active_episode_until_the_run_ends() -> None:
    live = LiveState()
    live.count_alerts("r1", [_straggler(9)])
    assert [(s.labels, s.value) for s in _active(live)] == [
        ({"run_id": "r1", "kind": "straggler", "rank": "3", "start_step": "2"}, 1)
    ]
    live.runs["r1"].ended_unix_s = 1.7e9 + 30
    assert _active(live) == []


def _active(live: LiveState) -> list:
    """Samples of trainvitals_alert_active (the families before it need no store)."""
    families = TrainvitalsCollector(live, store=None).collect()
    return next(f for f in families if f.name == "trainvitals_alert_active").samples


def test_a_resend_with_other_values_is_reported_not_acknowledged_as_stored(client) -> None:
    """A token holder could write another run's steps first: the real sender then got 202
    while the squatter's values stayed stored, and nothing said so."""
    from .conftest import make_batch

    first = make_batch(losses=[9.0, 9.0, 9.0])
    assert client.post("/api/v1/ingest", content=first.to_json()).status_code == 202
    same = client.post("/api/v1/ingest", content=first.to_json())
    assert same.status_code == 202 and "not_stored" not in same.json()  # a plain resend
    other = client.post("/api/v1/ingest", content=make_batch().to_json())
    assert other.status_code == 202
    answer = other.json()
    assert answer["not_stored"]["rows"] == {"steps": 3, "ranks": 6}
    assert answer["accepted_rows"] == {"steps": 0, "layers": 6, "ranks": 0}
    text = client.get("/metrics").text
    assert 'trainvitals_collector_changed_rows_total{table="steps"} 3.0' in text
    assert 'trainvitals_collector_changed_rows_total{table="ranks"} 6.0' in text
    stored = client.app.state.store.query("SELECT loss FROM steps ORDER BY step").column(0)
    assert stored.to_pylist() == [9.0, 9.0, 9.0]  # the first copy stays


def test_metrics_stay_bounded_with_many_stored_runs(tmp_path) -> None:
    """3,000 stored runs made /metrics 27,000 lines: the cap keeps the latest runs."""
    from trainvitals.collector.settings import Settings

    from .conftest import make_batch

    settings = Settings(store_path=str(tmp_path / "s.duckdb"), max_metrics_runs=5)
    with TestClient(create_app(settings)) as c:
        for i in range(8):  # run-i's latest step is at 1000 + i s
            body = make_batch(f"run-{i}", range(i, i + 1)).to_json()
            assert c.post("/api/v1/ingest", content=body).status_code == 202
        c.app.state.store.flush()
        families = {f.name: f for f in text_string_to_metric_families(c.get("/metrics").text)}
    exported = {s.labels["run_id"] for s in families["trainvitals_step"].samples}
    assert exported == {f"run-{i}" for i in range(3, 8)}
    assert families["trainvitals_collector_runs_not_exported"].samples[0].value == 3
