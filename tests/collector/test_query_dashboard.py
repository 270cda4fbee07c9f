"""Query API endpoints the dashboard's views read: goodput, nodes, a layer subset, the runs
listed. Over a store filled through ingest."""

from __future__ import annotations

import json

import pytest

from trainvitals.analyzer.goodput import goodput
from trainvitals.schema import BatchBuilder

from .conftest import counts, make_batch


def _post(client, batch: BatchBuilder, run_id: str = "r1") -> None:
    assert client.post("/api/v1/ingest", content=batch.to_json()).status_code == 202
    counts(client, run_id)


def _runs_row(b: BatchBuilder, hosts: list[str], tp: int = 1) -> None:
    b.append("runs", started_unix_s=999.0, model="m", model_config_json="{}", n_params=1,
             n_layers=2, layer_names_json='["a", "b"]', world_size=len(hosts),
             dp=len(hosts) // tp, tp=tp, device_type="cpu", device_name="cpu",
             hosts_json=json.dumps(hosts),
             flops_per_token=6.0, peak_flops_per_s=1e12, peak_flops_source="given")  # fmt: skip


def test_goodput_is_the_analyzers_over_the_stored_steps_and_events(client) -> None:
    # 40 steps a second apart, then a restart that cost 30 s and re-did steps 35..39.
    _post(client, make_batch(steps=range(40)))
    b = BatchBuilder("r1")
    for step in range(35, 60):
        b.append("steps", step=step, time_unix_s=1000.0 + 40 + 30 + (step - 35), loss=2.0,
                 grad_norm=1.0, tokens=512, step_time_s=1.0, tokens_per_s=512.0,
                 tflops_per_s_per_device=0.1, mfu_ratio=0.25)  # fmt: skip
    b.append("events", step=35, rank=-1, kind="restart", detail="{}", time_unix_s=1060.0)
    _post(client, b)
    served = client.get("/api/v1/runs/r1/goodput").json()
    # What the analyzer (and so `trainvitals replay`) computes from the same rows: the
    # store keeps the first copy of each step, as replay reads it.
    steps = {
        "step": [*range(40), *range(40, 60)],
        "time_unix_s": [1000.0 + s for s in range(40)] + [1075.0 + s - 40 for s in range(40, 60)],
        "step_time_s": [0.5] * 40 + [1.0] * 20,
    }
    events = {"step": [35], "kind": ["restart"], "detail": ["{}"], "time_unix_s": [1060.0]}
    expected = goodput("r1", steps, events)
    assert served["ratio"] == pytest.approx(expected.ratio)
    assert served["restarts"] == 1 and served["redone_steps"] == 5
    assert 0 < served["ratio"] < 1
    # Asked again with nothing new, the same answer (from its cache).
    assert client.get("/api/v1/runs/r1/goodput").json() == served


def test_goodput_counts_async_checkpoint_stalls_and_the_supervisors_actions(client) -> None:
    # Steps a second apart; the one after step 5 waited 0.25 s more for the stall.
    b = BatchBuilder("r1")
    for step in range(20):
        b.append("steps", step=step, time_unix_s=1000.0 + step + 0.25 * (step > 5), loss=2.0,
                 grad_norm=1.0, tokens=512, step_time_s=1.0, tokens_per_s=512.0,
                 tflops_per_s_per_device=0.1, mfu_ratio=0.25)  # fmt: skip
    b.append("events", step=5, rank=-1, kind="checkpoint_stall", detail='{"stall_s": 0.25}',
             time_unix_s=1005.5)  # fmt: skip
    b.append("events", step=12, rank=-1, kind="action:fence", detail='{"host": "node1"}',
             time_unix_s=1012.5)  # fmt: skip
    b.append("events", step=12, rank=-1, kind="action:rollback", detail='{"redone_steps": 4}',
             time_unix_s=1012.6)  # fmt: skip
    _post(client, b)
    served = client.get("/api/v1/runs/r1/goodput").json()
    assert served["fences"] == 1 and served["rollbacks"] == 1 and served["rolled_back_steps"] == 4
    assert served["checkpoint_s"] == pytest.approx(0.25)


def test_a_run_that_never_logged_a_step_is_not_listed(client) -> None:
    b = BatchBuilder("empty")
    _runs_row(b, ["h0"])
    assert client.post("/api/v1/ingest", content=b.to_json()).status_code == 202
    counts(client, "empty")
    _post(client, make_batch(steps=range(2)))
    assert [r["run_id"] for r in client.get("/api/v1/runs").json()] == ["r1"]


def test_nodes_group_ranks_by_host(client) -> None:
    # Four ranks on two hosts; make_batch gives rank r a step time of 0.4 + 0.1 r s and
    # 256 tokens/s.
    b = make_batch(steps=range(4), world=4)
    _runs_row(b, ["node-b", "node-a", "node-b", "node-a"])
    _post(client, b)
    summary = client.get("/api/v1/runs/r1/nodes/summary").json()
    assert summary["host"] == ["node-a", "node-b"]
    assert summary["ranks"] == [2, 2]
    # A node is as slow as its slowest rank (node-a: ranks 1 and 3) and moves the tokens
    # of all of its ranks.
    assert summary["step_time_s"] == pytest.approx([0.7, 0.6])
    assert summary["tokens_per_s"] == pytest.approx([512.0, 512.0])
    assert summary["ib_rx_bytes_per_s"] == [None, None]  # reported by no rank
    asked = client.get(
        "/api/v1/runs/r1/nodes/summary", params={"metric": ["tokens_per_s", "ib_rx_bytes_per_s"]}
    ).json()
    assert asked.keys() == {"node", "host", "ranks", "tokens_per_s", "ib_rx_bytes_per_s"}
    assert asked["tokens_per_s"] == summary["tokens_per_s"]
    assert asked["ib_rx_bytes_per_s"] == [None, None]
    r = client.get("/api/v1/runs/r1/nodes/summary", params={"metric": "loss"})
    assert r.status_code == 422 and "metric must be among" in r.json()["detail"]
    grid = client.get("/api/v1/runs/r1/nodes", params={"max_steps": 2}).json()
    assert grid["hosts"] == ["node-a", "node-b"] and grid["bucket_steps"] == 2
    assert grid["step"] == [0, 0, 2, 2] and grid["node"] == [0, 1, 0, 1]
    assert grid["value"] == pytest.approx([0.7, 0.6, 0.7, 0.6])
    assert client.get("/api/v1/runs/r1/hosts").json()["hosts"][0] == "node-b"
    r = client.get("/api/v1/runs/r1/nodes", params={"metric": "loss; drop table ranks"})
    assert r.status_code == 422 and "metric must be one of" in r.json()["detail"]


def test_a_nodes_tokens_count_a_tensor_parallel_group_once(client) -> None:
    # dp=2 x tp=2, a tensor-parallel pair per host: both ranks of a pair report the same
    # 256 tokens/s, which the node trained once.
    b = make_batch(steps=range(2), world=4)
    _runs_row(b, ["node-a", "node-a", "node-b", "node-b"], tp=2)
    _post(client, b)
    summary = client.get("/api/v1/runs/r1/nodes/summary").json()
    assert summary["tokens_per_s"] == pytest.approx([256.0, 256.0])
    grid = client.get("/api/v1/runs/r1/nodes", params={"metric": "tokens_per_s"}).json()
    assert grid["value"] == pytest.approx([256.0] * 4)


def test_nodes_of_a_run_without_hosts_are_empty_not_an_error(client) -> None:
    _post(client, make_batch(steps=range(2)))
    assert client.get("/api/v1/runs/r1/nodes/summary").json()["host"] == []
    assert client.get("/api/v1/runs/r1/nodes").json()["hosts"] is None


def test_a_rank_grid_answers_each_metric_as_it_is_answered_alone(client) -> None:
    b = make_batch(steps=range(6), world=3)
    for step in range(6):  # a rank whose power changes from step to step
        b.append("ranks", step=step, rank=3, step_time_s=1.0 + step, tokens_per_s=256.0,
                 loss=2.0, power_w=100.0 * step)  # fmt: skip
    _post(client, b)
    pairs = [("step_time_s", "max"), ("step_time_s", "mean"), ("power_w", "min")]
    window = {"start": 1, "max_steps": 2}
    grid = client.get(
        "/api/v1/runs/r1/ranks/grid",
        params={"metric": [m for m, _ in pairs], "agg": [a for _, a in pairs], **window},
    ).json()
    for metric, agg in pairs:
        alone = client.get(
            "/api/v1/runs/r1/ranks", params={"metric": metric, "agg": agg, **window}
        ).json()
        assert (grid["bucket_steps"], grid["step"], grid["rank"]) == (
            alone["bucket_steps"], alone["step"], alone["rank"]
        )  # fmt: skip
        assert grid[f"{agg}_{metric}"] == alone["value"]
    assert grid["max_step_time_s"] != grid["mean_step_time_s"]  # rank 3 over 3 steps
    one_agg = client.get(
        "/api/v1/runs/r1/ranks/grid", params={"metric": ["power_w", "step_time_s"], "agg": "mean"}
    ).json()
    assert {"mean_power_w", "mean_step_time_s"} <= one_agg.keys()
    two = client.get(
        "/api/v1/runs/r1/ranks/grid", params={"metric": "power_w", "rank": [1, 3], "max_steps": 1}
    ).json()
    assert two["rank"] == [1, 3] and two["max_power_w"] == [None, 500.0]
    for params, message in [
        ({"metric": ["power_w", "loss; drop table ranks"]}, "metric must be among"),
        ({"metric": ["power_w", "step_time_s"], "agg": ["max"] * 3}, "one per metric"),
        ({"metric": ["power_w", "power_w"]}, "at most once"),
        ({"metric": "power_w", "rank": [-1]}, "none negative"),
    ]:
        r = client.get("/api/v1/runs/r1/ranks/grid", params=params)
        assert r.status_code == 422 and message in r.json()["detail"], params


def test_layers_can_be_asked_for_a_few_layers(client) -> None:
    _post(client, make_batch(steps=range(3), n_layers=4))
    grid = client.get("/api/v1/runs/r1/layers", params={"layer": [1, 3]}).json()
    assert set(grid["layer"]) == {1, 3} and len(grid["step"]) == 6


def test_metrics_hold_job_power_energy_and_a_bounded_rank_power_summary(client) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    b = BatchBuilder("r1")
    for step in range(3):
        b.append("steps", step=step, time_unix_s=1000.0 + step, loss=2.0, grad_norm=1.0,
                 tokens=512, step_time_s=1.0, tokens_per_s=512.0, tflops_per_s_per_device=0.1,
                 mfu_ratio=0.25, power_w=1000.0 + step, energy_j=1000.0 * (step + 1))  # fmt: skip
        for rank in range(101):
            b.append("ranks", step=step, rank=rank, step_time_s=1.0, tokens_per_s=5.0,
                     loss=2.0, power_w=100.0 + rank)  # fmt: skip
    _post(client, b)
    _post(client, make_batch(run_id="dark", steps=range(2)), "dark")  # no power source
    text = client.get("/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    [power] = families["trainvitals_power_watts"].samples
    assert power.labels == {"run_id": "r1"} and power.value == 1002.0
    [energy] = families["trainvitals_energy_joules"].samples
    assert energy.name == "trainvitals_energy_joules_total" and energy.value == 3000.0
    stats = {s.labels["stat"]: s.value for s in families["trainvitals_rank_power_watts"].samples}
    # One series per statistic, whatever the number of ranks.
    assert stats == {"median": 150.0, "p99": pytest.approx(199.0), "max": 200.0}


def test_a_cached_answer_is_not_served_once_the_store_has_more(client) -> None:
    _post(client, make_batch(steps=range(3)))
    window = {"start": 0, "end": 9, "max_steps": 10}
    first = client.get("/api/v1/runs/r1/ranks", params=window).json()
    assert client.get("/api/v1/runs/r1/ranks", params=window).json() == first
    wall_s = client.get("/api/v1/runs/r1/goodput").json()["wall_s"]
    _post(client, make_batch(steps=range(3, 6)))
    assert client.get("/api/v1/runs/r1/ranks", params=window).json()["step"] == [
        s for s in range(6) for _ in range(2)
    ]
    assert client.get("/api/v1/runs/r1/goodput").json()["wall_s"] == wall_s + 3  # 1 s a step
