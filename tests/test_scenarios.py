"""Detectors on real 4-rank runs: injected faults are found and named; clean runs stay quiet."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from tests.conftest import run_trainer
from trainvitals.analyzer import Analyzer
from trainvitals.schema import to_arrow

# Starts processes (torchrun, a collector, a browser...) or runs for seconds: `make test` only.
pytestmark = pytest.mark.slow

COMMON = ["--dp", "2", "--tp", "2", "--steps", "60", "--canary-every", "10"]


def _replay(path: Path) -> tuple[list, list]:
    """(alerts the live collector would raise, ground-truth events) for a telemetry file."""
    analyzer, alerts, events = Analyzer(), [], []
    for line in path.read_bytes().splitlines():
        run_id, tables = to_arrow(orjson.loads(line))
        alerts += analyzer.observe(run_id, tables)
        if "events" in tables:
            events += tables["events"].to_pylist()
    return alerts, events


def test_injected_straggler_and_sdc_are_found_on_the_right_ranks(faulty_telemetry: Path) -> None:
    out = faulty_telemetry
    alerts, events = _replay(out)
    truth = {(e["kind"], e["rank"], e["step"]) for e in events if e["kind"].startswith("fault:")}
    assert truth == {("fault:straggler", 1, 15), ("fault:sdc", 2, 30)}
    by_kind = {a.kind: a for a in alerts}
    assert by_kind["straggler"].rank == 1 and 15 <= by_kind["straggler"].step < 45
    assert by_kind["sdc"].rank == 2 and by_kind["sdc"].step == 30  # the first canary after it
    # Replica groups of two (tp peers) cannot tell whose copy diverged; the canary names
    # rank 2, and rank 0 (tp index 0 of the other group) only received its gradients.
    replica = [a for a in alerts if a.kind == "sdc_replica"]
    assert all(a.rank == 2 and a.step >= 30 for a in replica)
    assert all("rank 0" in a.message and "not at fault" in a.message for a in replica)
    assert {a.kind for a in alerts} <= {"straggler", "sdc", "sdc_replica"}, [
        a.message for a in alerts
    ]


def test_injected_loss_spike_and_nan_are_found_at_their_steps(tmp_path: Path) -> None:
    out = tmp_path / "spike.jsonl"
    faults = ["--inject", "spike:step=25,kind=lr", "--inject", "nan:step=50"]
    run_trainer([*COMMON, *faults, "--telemetry-file", str(out)], nproc=4)
    alerts, _ = _replay(out)
    found = [(a.kind, a.step) for a in alerts]
    # A 30x learning rate at step 25 shows in the loss of step 26; every layer moves at
    # once and every rank's local loss with them: nobody to blame.
    assert found == [("loss_spike", 26), ("nonfinite", 50)], [a.message for a in alerts]
    assert alerts[0].rank is None and alerts[0].layer is None
    # The loss went NaN after the forward: every gradient follows from it, no layer led.
    assert alerts[1].layer is None and "it started in the loss" in alerts[1].message
    assert "every rank is hit" in alerts[1].message


def test_clean_run_raises_nothing(tmp_path: Path) -> None:
    out = tmp_path / "clean.jsonl"
    run_trainer([*COMMON, "--telemetry-file", str(out)], nproc=4)
    alerts, events = _replay(out)
    assert [(e["kind"], e["step"]) for e in events] == [("run_end", 60)]  # no fault, clean end
    assert alerts == [], [a.message for a in alerts]
