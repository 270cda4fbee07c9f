"""Every metric the rules and the Grafana dashboard query is one the collector exports.

A misspelt metric name is not an error in PromQL: the query returns nothing and the
alert never fires. So the names are checked against a real collector's /metrics.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from trainvitals.collector.main import create_app
from trainvitals.collector.settings import Settings
from trainvitals.schema import BatchBuilder

from . import runs
from .stack import ALERT_RULES, DEPLOY, load_yaml

DASHBOARDS = sorted((DEPLOY / "grafana" / "dashboards").glob("*.json"))

# Metric names of the project, and recording-rule names (level:metric:operations).
_NAME = re.compile(r"\btrainvitals_[a-z0-9_]+|\b[a-z_]+:[a-z0-9_]+:?[a-z0-9_]*")


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> set[str]:
    """Sample names of /metrics after a run with an alert and a clean end, while another
    is in a declared pause, and after a rank was lost (every family)."""
    store = tmp_path_factory.mktemp("names") / "store.duckdb"
    with TestClient(create_app(Settings(store_path=str(store)))) as client:
        for b in (
            runs.batch("r", range(30)),
            runs.batch("r", range(30, 35), "loss_spike", 30),
            _run_end("r", 35),
        ):
            response = client.post("/api/v1/ingest", content=b.to_json())
            assert response.status_code == 202, response.text
        _beat(client, "p", "checkpoint")  # trainvitals_run_paused, while it lasts
        texts = [client.get("/metrics").text]
        _beat(client, "p", "ended")  # the run ends: its rank is never lost
        _lost_rank(client, "h")  # an active episode (trainvitals_alert_active)
        client.app.state.store.flush()
        texts.append(client.get("/metrics").text)
    return {
        s.name
        for t in texts
        for family in text_string_to_metric_families(t)
        for s in family.samples
    }


def _beat(client: TestClient, run_id: str, phase: str) -> None:
    """A heartbeat of rank 0 in `phase`, judged at once."""
    now = time.time()
    cols = {"rank": [0], "time_unix_s": [now], "host": ["h"], "step_started": [3],
            "step_finished": [3], "phase": [phase]}  # fmt: skip
    doc = {"schema_version": 1, "run_id": run_id, "heartbeats": cols}
    assert client.post("/api/v1/heartbeats", json=doc).status_code == 202
    watchdog = client.app.state.watchdog
    watchdog.clock = lambda: now + 2
    assert watchdog.tick() == []


def _lost_rank(client: TestClient, run_id: str) -> None:
    """A heartbeat, then silence until the watchdog's clock says the rank is lost."""
    now = time.time()
    cols = {"rank": [0], "time_unix_s": [now], "host": ["h"], "step_started": [3],
            "step_finished": [2], "phase": ["forward"]}  # fmt: skip
    doc = {"schema_version": 1, "run_id": run_id, "heartbeats": cols}
    assert client.post("/api/v1/heartbeats", json=doc).status_code == 202
    watchdog = client.app.state.watchdog
    watchdog.clock = lambda: now + 60
    assert [a.kind for a in watchdog.tick()] == ["rank_lost"]


def _run_end(run_id: str, step: int) -> BatchBuilder:
    """The event the hooks send from Monitor.close()."""
    b = BatchBuilder(run_id)
    b.append("events", step=step, rank=-1, kind="run_end", detail="{}", time_unix_s=2e9)
    return b


def _recorded() -> set[str]:
    return {
        r["record"] for g in load_yaml(ALERT_RULES)["groups"] for r in g["rules"] if "record" in r
    }


def _referenced_by_rules() -> set[str]:
    names = set()
    for group in load_yaml(ALERT_RULES)["groups"]:
        for rule in group["rules"]:
            # Annotations query metrics too (`query` in templates).
            texts = [rule["expr"], *rule.get("annotations", {}).values()]
            names |= {n for t in texts for n in _NAME.findall(t)}
    return names


def _referenced_by(dashboard: Path) -> set[str]:
    return set(_NAME.findall(dashboard.read_text()))


def test_the_rules_query_only_exported_or_recorded_metrics(exported: set[str]) -> None:
    assert _referenced_by_rules() - exported - _recorded() == set()


@pytest.mark.parametrize("dashboard", DASHBOARDS, ids=lambda p: p.name)
def test_the_dashboard_queries_only_exported_or_recorded_metrics(
    exported: set[str], dashboard: Path
) -> None:
    assert _referenced_by(dashboard) - exported - _recorded() == set()
