"""End to end with the real servers: telemetry -> collector -> Prometheus -> Alertmanager ->
webhook, all on 127.0.0.1, with the shipped rules and routing (1 s intervals, no waits).

A clean run must page nobody; each injected fault must reach the webhook as the right
alert with the right labels. The time from posting the faulty batch to the webhook call
is shown in pytest's summary and written to alert_latency.json (see conftest.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import httpx
import pytest

from tests.conftest import wait_until

from . import runs
from .servers import (
    Server,
    WebhookReceiver,
    start_alertmanager,
    start_collector,
    start_prometheus,
)

# Starts processes (torchrun, a collector, a browser...) or runs for seconds: `make test` only.
pytestmark = pytest.mark.slow

HISTORY_STEPS = 30  # clean steps before a fault: the loss-spike detector needs 20
FAULT_STEPS = 25  # steps from the fault on, in one batch: a straggler needs 20 of 25 (straggler.py)
# A hang guard: delivery takes a few seconds on an idle machine, more at load 20.
DELIVERY_TIMEOUT_S = 120.0

# fault -> (alertname, labels the webhook must see besides run_id)
CASES = {
    "loss_spike": ("TrainvitalsLossSpike", {"severity": "warning", "kind": "loss_spike"}),
    "nonfinite": ("TrainvitalsNonFinite", {"severity": "critical", "kind": "nonfinite"}),
    "straggler": ("TrainvitalsStraggler", {"severity": "warning", "kind": "straggler"}),
    "intermittent_straggler": (
        "TrainvitalsIntermittentStraggler",
        {"severity": "warning", "kind": "intermittent_straggler"},
    ),
    "sdc": ("TrainvitalsSDCSuspect", {"severity": "critical", "kind": "sdc"}),
}
CULPRIT_RANK = {
    "straggler": runs.STRAGGLER_RANK,
    "intermittent_straggler": runs.HICCUP_RANK,
    "sdc": runs.SDC_RANK,
}


class Stack:
    def __init__(self, tmp: Path) -> None:
        self.webhook = WebhookReceiver()
        self.servers: list[Server] = []
        try:
            self.collector = self._add(start_collector(tmp))
            self.alertmanager = self._add(start_alertmanager(tmp, self.webhook.url))
            self.prometheus = self._add(start_prometheus(tmp, self.collector, self.alertmanager))
        except BaseException:
            self.close()
            raise

    def _add(self, server: Server) -> Server:
        self.servers.append(server)
        return server

    def query(self, promql: str) -> list[dict]:
        r = httpx.get(f"{self.prometheus.url}/api/v1/query", params={"query": promql}, timeout=60)
        return r.json()["data"]["result"]

    def last_rule_evaluation(self) -> float:
        """Unix time of the latest evaluation of every trainvitals rule group (the oldest)."""
        groups = httpx.get(f"{self.prometheus.url}/api/v1/rules", timeout=60).json()
        times = [_unix(g["lastEvaluation"]) for g in groups["data"]["groups"]]
        return min(times) if times else 0.0

    def close(self) -> None:
        for server in reversed(self.servers):
            server.stop()
        self.webhook.close()


def _unix(rfc3339: str) -> float:
    # Prometheus writes nanoseconds; datetime takes microseconds.
    head, dot, frac = rfc3339.partition(".")
    if dot:
        digits = "".join(c for c in frac if c.isdigit())
        rfc3339 = f"{head}.{digits[:6]}{frac[len(digits) :]}"
    return datetime.fromisoformat(rfc3339.replace("Z", "+00:00")).timestamp()


@pytest.fixture(scope="module")
def delivered() -> dict[str, dict]:
    """fault -> the alert the webhook received for it."""
    return {}


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    s = Stack(tmp_path_factory.mktemp("alerting"))
    yield s
    s.close()


def _send_history(stack: Stack, run_id: str) -> None:
    runs.post(stack.collector.url, runs.batch(run_id, range(HISTORY_STEPS)))
    wait_until(lambda: runs.stored_last_step(stack.collector.url, run_id) == HISTORY_STEPS - 1)


def test_a_clean_run_pages_nobody(stack: Stack) -> None:
    run_id = "clean"
    calls_before = len(stack.webhook.received())
    _send_history(stack, run_id)
    last = HISTORY_STEPS + FAULT_STEPS - 1
    runs.post(stack.collector.url, runs.batch(run_id, range(HISTORY_STEPS, last + 1)))
    wait_until(lambda: runs.stored_last_step(stack.collector.url, run_id) == last)
    wait_until(lambda: runs.analysis_caught_up(stack.collector.url))
    assert runs.analyzer_alerts(stack.collector.url, run_id) == []

    # Prometheus has scraped the whole run, and every rule group has been evaluated since:
    # any alert the rules would raise is now on its way.
    seen = wait_until(lambda: stack.query(f'trainvitals_step{{run_id="{run_id}"}} == {last}'))
    scraped_at = float(seen[0]["value"][0])
    wait_until(lambda: stack.last_rule_evaluation() > scraped_at + 1.0)
    time.sleep(2.0)  # the rest (Prometheus -> Alertmanager -> webhook) takes well under 1 s

    assert stack.query(f'ALERTS{{run_id="{run_id}"}}') == []
    assert stack.webhook.received()[calls_before:] == []


@pytest.mark.parametrize("fault", CASES)
def test_an_injected_fault_reaches_the_webhook(
    stack: Stack, latencies: dict, delivered: dict, record_property, fault: str
) -> None:
    alertname, labels = CASES[fault]
    run_id = f"fault-{fault}"
    _send_history(stack, run_id)

    faulty = runs.batch(
        run_id, range(HISTORY_STEPS, HISTORY_STEPS + FAULT_STEPS), fault, HISTORY_STEPS
    )
    started = time.monotonic()
    runs.post(stack.collector.url, faulty)

    # First the analyzer must flag it; otherwise fail now, naming the stage that missed it.
    last = HISTORY_STEPS + FAULT_STEPS - 1
    wait_until(lambda: runs.stored_last_step(stack.collector.url, run_id) == last)
    wait_until(lambda: runs.analysis_caught_up(stack.collector.url))
    kinds = {a["kind"] for a in runs.analyzer_alerts(stack.collector.url, run_id)}
    if labels["kind"] not in kinds:
        pytest.fail(f"the analyzer raised no {labels['kind']!r} alert (got {sorted(kinds)})")

    arrived = wait_until(lambda: stack.webhook.for_run(run_id), timeout_s=DELIVERY_TIMEOUT_S)
    latency_s = arrived[0][0] - started
    latencies[fault] = round(latency_s, 3)
    record_property("fault_to_webhook_s", latency_s)
    print(f"{fault}: fault -> webhook {latency_s:.2f} s")

    time.sleep(1.5)  # anything else this run would raise arrives within the same cycle
    received = [a for _, a in stack.webhook.for_run(run_id)]
    assert {a["labels"]["alertname"] for a in received} == {alertname}
    alert = delivered[fault] = received[0]
    assert alert["status"] == "firing"
    assert alert["labels"] | labels | {"run_id": run_id} == alert["labels"], alert["labels"]
    assert alert["annotations"]["summary"] and alert["annotations"]["runbook"]


@pytest.mark.parametrize("fault", CULPRIT_RANK)
def test_straggler_and_sdc_alerts_name_the_rank(delivered: dict, fault: str) -> None:
    if fault not in delivered:
        pytest.skip(f"no {fault} alert was delivered (see its end-to-end test)")
    assert delivered[fault]["labels"].get("rank") == str(CULPRIT_RANK[fault])
