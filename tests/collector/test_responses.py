"""The query API's typed answers (collector/responses.py): /openapi.json names a model for
every answer, and the grids, served as built rather than checked on the way out, hold to
their models, NaN and inf included, byte for byte as a checked answer would be written."""

from __future__ import annotations

import json
import math

import pytest
from pydantic import BaseModel

from trainvitals.collector.responses import (
    LayerGrid,
    NodeGrid,
    NodeSummary,
    RankGrid,
    RankSeries,
    RunHosts,
)
from trainvitals.schema import BatchBuilder

from .conftest import counts

HOSTS = ["node-b", "node-a", "node-b", "node-a"]


def _schema_ref(get: dict) -> str:
    """The model a GET's 200 answer refers to (itself or its items), or '' if none."""
    schema = get["responses"]["200"]["content"]["application/json"]["schema"]
    return schema.get("$ref") or schema.get("items", {}).get("$ref", "")


def test_every_query_answer_is_a_documented_model(client) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    query = {path: ops for path, ops in paths.items() if path.startswith("/api/v1/")}
    gets = {path: ops["get"] for path, ops in query.items() if "get" in ops}
    assert "/api/v1/runs/{run_id}/layers" in gets
    untyped = [path for path, get in gets.items() if not _schema_ref(get)]
    assert not untyped, f"answers without a response model: {untyped}"
    named = {path: _schema_ref(get).rsplit("/", 1)[1] for path, get in gets.items()}
    assert named["/api/v1/runs/{run_id}/layers"] == "LayerGrid"
    assert named["/api/v1/runs/{run_id}/ranks"] == "RankSeries"
    assert named["/api/v1/runs/{run_id}/ranks/grid"] == "RankGrid"
    assert named["/api/v1/runs/{run_id}/nodes"] == "NodeGrid"
    assert named["/api/v1/runs/{run_id}/nodes/summary"] == "NodeSummary"
    assert named["/api/v1/runs/{run_id}/hosts"] == "RunHosts"
    # The `<agg>_<metric>` columns of a rank grid are typed too, NaN and inf included.
    grid = client.get("/openapi.json").json()["components"]["schemas"]["RankGrid"]
    extra = grid["additionalProperties"]["items"]["anyOf"]
    assert {"type": "string", "enum": ["NaN", "Infinity", "-Infinity"]} in extra


def _store_a_run_with_nonfinite_values(client) -> None:
    """4 ranks on 2 hosts, 3 steps; a NaN rank loss, an inf layer gradient norm, a -inf
    activation RMS, and an int64 count (nonfinite_count) among the layer metrics."""
    b = BatchBuilder("r1")
    b.append("runs", started_unix_s=999.0, model="m", model_config_json="{}", n_params=1,
             n_layers=2, layer_names_json='["embed", "blöck"]', world_size=len(HOSTS), dp=4,
             tp=1, device_type="cpu", device_name="cpu", hosts_json=json.dumps(HOSTS),
             flops_per_token=6.0, peak_flops_per_s=1e12, peak_flops_source="given")  # fmt: skip
    for step in range(3):
        b.append("steps", step=step, time_unix_s=1000.0 + step, loss=2.0, grad_norm=1.0,
                 tokens=512, step_time_s=0.5, tokens_per_s=1024.0,
                 tflops_per_s_per_device=0.1, mfu_ratio=0.25)  # fmt: skip
        for layer in range(2):
            b.append("layers", step=step, layer=layer, nonfinite_count=step,
                     grad_norm=math.inf if (step, layer) == (1, 0) else 1e-05 * (layer + 1),
                     act_rms=-math.inf if step == 2 else 1.0)  # fmt: skip
        for rank in range(len(HOSTS)):
            b.append("ranks", step=step, rank=rank, step_time_s=0.4 + 0.1 * rank,
                     tokens_per_s=256.0, power_w=300.0 + rank, data_time_s=3e-07,
                     loss=math.nan if (step, rank) == (1, 2) else 2.0)  # fmt: skip
    assert client.post("/api/v1/ingest", content=b.to_json()).status_code == 202
    counts(client)


ANSWERS: list[tuple[str, dict, type[BaseModel]]] = [
    ("layers", {}, LayerGrid),
    ("layers", {"metric": "act_rms", "agg": "min", "layer": [1]}, LayerGrid),
    ("layers", {"metric": "nonfinite_count", "max_steps": 2}, LayerGrid),
    ("ranks", {"metric": "loss"}, RankSeries),
    ("ranks", {"metric": "data_time_s", "agg": "mean", "max_steps": 1}, RankSeries),
    ("ranks/grid", {"metric": ["loss", "power_w"], "agg": ["max", "mean"]}, RankGrid),
    ("ranks/grid", {"metric": "step_time_s", "rank": [1, 3]}, RankGrid),
    ("nodes", {"metric": "power_w", "agg": "mean"}, NodeGrid),
    ("nodes", {}, NodeGrid),
    ("nodes/summary", {"metric": ["tokens_per_s", "step_time_s"]}, NodeSummary),
    ("nodes/summary", {}, NodeSummary),
    ("hosts", {}, RunHosts),
]


@pytest.mark.parametrize(("path", "params", "model"), ANSWERS)
def test_answers_hold_to_their_models_byte_for_byte(client, path, params, model) -> None:
    _store_a_run_with_nonfinite_values(client)
    served = client.get(f"/api/v1/runs/r1/{path}", params=params)
    assert served.status_code == 200, served.text
    # Strict: a NaN is the string "NaN", never a number, a null or "nan".
    checked = model.model_validate_json(served.content, strict=True)
    assert checked.model_dump_json().encode() == served.content


def test_the_grids_carry_what_the_models_promise(client) -> None:
    _store_a_run_with_nonfinite_values(client)
    ranks = client.get("/api/v1/runs/r1/ranks", params={"metric": "loss"}).json()
    assert ranks["value"][4:8] == [2.0, 2.0, "NaN", 2.0]  # step 1, ranks 0-3
    counts_ = client.get("/api/v1/runs/r1/layers", params={"metric": "nonfinite_count"}).json()
    assert counts_["value"] == [0, 0, 1, 1, 2, 2] and counts_["layer_names"][1] == "blöck"
    grid = client.get("/api/v1/runs/r1/ranks/grid", params={"metric": ["power_w", "loss"]})
    assert list(grid.json()) == ["bucket_steps", "step", "rank", "max_power_w", "max_loss"]
    summary = client.get("/api/v1/runs/r1/nodes/summary", params={"metric": "power_w"}).json()
    assert summary == {"node": [0, 1], "host": ["node-a", "node-b"], "ranks": [2, 2],
                       "power_w": [604.0, 602.0]}  # fmt: skip
