"""A real 4-rank torchrun run -> a real collector on 127.0.0.1 -> DuckDB, /metrics and the API."""

from __future__ import annotations

import duckdb
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

# Starts processes (torchrun, a collector, a browser...) or runs for seconds: `make test` only.
pytestmark = pytest.mark.slow


def test_every_step_layer_and_rank_is_stored_once(trained_run: dict) -> None:
    steps, layers, world = trained_run["steps"], trained_run["n_layers"], trained_run["world_size"]
    # Stop the collector (it owns the file), then read its store as a user would.
    trained_run["collector"].stop()
    con = duckdb.connect(str(trained_run["collector"].store), read_only=True)
    try:
        q = "SELECT count(*), count(DISTINCT ({k})) FROM {t} WHERE run_id = 'e2e'"
        assert con.execute(q.format(k="step", t="steps")).fetchone() == (steps, steps)
        assert (
            con.execute(q.format(k="step, layer", t="layers")).fetchone() == (steps * layers,) * 2
        )
        assert con.execute(q.format(k="step, rank", t="ranks")).fetchone() == (steps * world,) * 2
        (dp, tp, n_layers) = con.execute(
            "SELECT dp, tp, n_layers FROM runs WHERE run_id = 'e2e'"
        ).fetchone()
        assert (dp, tp, n_layers) == (2, 2, layers)
        first, last = con.execute(
            "SELECT arg_min(loss, step), arg_max(loss, step) FROM steps WHERE run_id = 'e2e'"
        ).fetchone()
        assert last < first  # it really trained
    finally:
        con.close()
    # Restart on the same file: the collector reopens it and serves the stored run.
    from tests.conftest import CollectorProcess

    c = CollectorProcess(trained_run["collector"].store)
    trained_run["collector"] = c
    trained_run["url"] = c.url
    runs = httpx.get(f"{c.url}/api/v1/runs").json()
    assert runs[0]["run_id"] == "e2e" and runs[0]["last_step"] == steps - 1


def test_metrics_parse_and_hold_loss_and_mfu(collector_with_run: str) -> None:
    text = httpx.get(f"{collector_with_run}/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("trainvitals_loss", "trainvitals_mfu_ratio", "trainvitals_tokens_per_second"):
        (sample,) = families[name].samples
        assert sample.labels == {"run_id": "e2e"}
        assert sample.value > 0
    assert families["trainvitals_mfu_ratio"].samples[0].value < 1
