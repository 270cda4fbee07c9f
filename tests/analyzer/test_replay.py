"""The second driver: replaying a stored run gives the live alerts; scalar exports analysed."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import orjson

from tests.conftest import CollectorProcess


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainvitals", *args], capture_output=True,
                          text=True, timeout=300)  # fmt: skip


def test_replay_of_a_store_reproduces_the_live_alerts(faulty_telemetry: Path, tmp_path) -> None:
    store = tmp_path / "store.duckdb"
    collector = CollectorProcess(store)
    try:
        assert _cli("import", str(faulty_telemetry), "--collector", collector.url).returncode == 0
    finally:
        collector.stop()
    r = _cli("replay", str(store), "--check")
    assert r.returncode == 0, r.stderr
    alerts = [orjson.loads(line) for line in r.stdout.splitlines()]
    assert {(a["kind"], a["rank"]) for a in alerts} == {("straggler", 1), ("sdc", 2)}
    assert f"{len(alerts)} alerts replayed, identical to the {len(alerts)}" in r.stderr


def test_replay_of_a_missing_store() -> None:
    r = _cli("replay", "/nonexistent/store.duckdb")
    assert r.returncode != 0 and "cannot open" in r.stderr and "Traceback" not in r.stderr


def _wandb_csv(path: Path) -> Path:
    lines = ["_step,train/loss,train/grad_norm,_runtime"]
    for step in range(300):
        loss = 2 + 3 * math.exp(-step / 50)
        loss = loss * 3 if step == 200 else loss
        loss = "NaN" if step == 280 else f"{loss:.5f}"
        lines.append(f"{step},{loss},1.0,{step * 2}")
    path.write_text("\n".join(lines) + "\n")
    return path


def test_analyze_a_wandb_export(tmp_path: Path) -> None:
    r = _cli("analyze", str(_wandb_csv(tmp_path / "run.csv")))
    assert r.returncode == 0, r.stderr
    found = [(a["kind"], a["step"]) for a in map(orjson.loads, r.stdout.splitlines())]
    assert ("loss_spike", 200) in found and ("nonfinite", 280) in found


def test_analyze_a_tensorboard_export(tmp_path: Path) -> None:
    rows = [f"{1.7e9 + s},{s},{2.0 if s != 150 else 9.0}" for s in range(200)]
    path = tmp_path / "loss.csv"
    path.write_text("Wall time,Step,Value\n" + "\n".join(rows) + "\n")
    r = _cli("analyze", str(path))
    assert [a["step"] for a in map(orjson.loads, r.stdout.splitlines())] == [150]


def test_analyze_names_what_is_missing(tmp_path: Path) -> None:
    path = tmp_path / "odd.csv"
    path.write_text("epoch,accuracy\n1,0.5\n")
    r = _cli("analyze", str(path))
    assert r.returncode != 0 and "no step column found" in r.stderr and "--step-column" in r.stderr
    r = _cli("analyze", str(path), "--step-column", "epoch", "--loss-column", "nope")
    assert "column 'nope' (for loss) is not in the file" in r.stderr
    r = _cli("analyze", str(tmp_path / "absent.csv"))
    assert r.returncode != 0 and "Traceback" not in r.stderr
