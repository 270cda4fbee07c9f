"""`promtool check metrics` on a real scrape: the /metrics of a collector holding a real
4-rank run passes Prometheus' own linter (names, units, types, help), with no complaint."""

from __future__ import annotations

import subprocess

import httpx
import pytest

from tests.deploy.stack import binary

# Starts processes (torchrun, a collector, a browser...) or runs for seconds: `make test` only.
pytestmark = pytest.mark.slow


def test_a_real_scrape_passes_promtool_check_metrics(collector_with_run: str) -> None:
    text = httpx.get(f"{collector_with_run}/metrics", timeout=60).text
    assert 'trainvitals_step{run_id="e2e"}' in text  # the run's series are in the scrape
    proc = subprocess.run(
        [binary("promtool"), "check", "metrics"],
        input=text,
        capture_output=True,
        text=True,
        timeout=300,
    )
    complaints = (proc.stdout + proc.stderr).strip()
    assert proc.returncode == 0 and not complaints, f"promtool:\n{complaints}"
