"""Fault-to-webhook latencies: collected by the end-to-end test, written to
alert_latency.json in pytest's base temporary directory and shown in the summary."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

LATENCY_S = pytest.StashKey[dict]()


@pytest.fixture(scope="module")
def latencies(tmp_path_factory, request) -> Iterator[dict]:
    measured: dict[str, float] = {}
    yield measured
    if measured:
        path = tmp_path_factory.getbasetemp() / "alert_latency.json"
        path.write_text(json.dumps({"fault_to_webhook_s": measured}, indent=2) + "\n")
        request.config.stash[LATENCY_S] = {"path": str(path), **measured}


def pytest_terminal_summary(terminalreporter, config) -> None:
    measured = dict(config.stash.get(LATENCY_S, {}))
    if measured:
        path = measured.pop("path")
        line = ", ".join(f"{fault} {s:.2f} s" for fault, s in measured.items())
        terminalreporter.write_line(f"fault -> webhook latency: {line} ({path})")
