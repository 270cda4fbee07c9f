"""The second driver: replaying a stored run gives the live alerts; scalar exports analysed."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import duckdb
import orjson
import pytest

from tests.conftest import CollectorProcess
from trainvitals.schema import to_arrow


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trainvitals", *args], capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow
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
    found = {(a["kind"], a["rank"]) for a in alerts}
    assert (
        {("straggler", 1), ("sdc", 2)}
        <= found
        <= {("straggler", 1), ("sdc", 2), ("sdc_replica", 2)}  # the canary names rank 2
    )
    assert "goodput of run" in r.stderr and '"ratio"' in r.stderr
    assert f"{len(alerts)} alerts replayed, identical to the {len(alerts)}" in r.stderr

    # A mismatch names the alerts on each side: one live alert lost, one the replay lacks.
    with duckdb.connect(str(store)) as con:
        con.execute("DELETE FROM alerts WHERE kind = 'straggler'")
        con.execute(
            "INSERT INTO alerts (run_id, step, kind, severity, message, time_unix_s, rank) "
            "VALUES ('x', 7, 'hang', 'critical', 'a hang the replay does not raise', 0, 3)"
        )
    r = _cli("replay", str(store), "--check")
    assert r.returncode == 1 and "DIFFERENT from" in r.stderr, r.stderr
    assert "replayed only: " in r.stderr and " straggler (rank 1, layer None): " in r.stderr
    assert "live only: x step 7 hang (rank 3, layer None): a hang the replay" in r.stderr


@pytest.mark.slow
def test_replay_skips_the_gaps_between_steps(tmp_path) -> None:
    """A run resumed at a far step: replay reads the windows that hold steps, and ends."""
    from tests.collector.conftest import make_batch
    from trainvitals.collector.store import Store

    path = tmp_path / "gap.duckdb"
    store = Store(str(path))
    store.start()
    tables = to_arrow(orjson.loads(make_batch("gap", steps=[0, 1, 10**12]).to_json()))[1]
    store.submit("gap", tables).result(timeout=60)
    store.close()
    r = subprocess.run(
        [sys.executable, "-m", "trainvitals", "replay", str(path)],
        capture_output=True,
        text=True,
        timeout=600,  # a hang guard: one window per 10,000 steps would be 10**8 windows
    )
    assert r.returncode == 0, r.stderr
    assert "0 alerts" in r.stderr


@pytest.mark.slow
def test_replay_of_a_missing_store() -> None:
    r = _cli("replay", "/nonexistent/store.duckdb")
    assert r.returncode != 0 and "cannot open" in r.stderr and "Traceback" not in r.stderr


def _simulated_store(path: Path) -> Path:
    """A stopped collector's store of a small simulated run that raised alerts live."""
    from trainvitals.simulate import FleetSpec

    faults = ("straggler:rank=3,step=20,slowdown=0.5", "spike:step=40")
    spec = FleetSpec(ranks=8, layers=2, step_time_s=1.0, steps=60, faults=faults)
    _store_live(spec, path)
    return path


def _store_live(spec, path: Path) -> None:
    """Ingest the simulated run into a collector store at `path`, analysed live."""
    from trainvitals.analyzer import Analyzer
    from trainvitals.collector.analysis import follow
    from trainvitals.collector.store import Store
    from trainvitals.simulate import simulate

    store = Store(str(path))
    follow(store, Analyzer(), delay_s=0.0)
    store.start()
    try:
        done = [store.submit(*to_arrow(doc)) for doc in simulate(spec)]
        store.flush(60)
        assert all(f.exception() is None for f in done)
    finally:
        store.close()


def _alerts(r: subprocess.CompletedProcess) -> list[tuple]:
    return [(a["kind"], a["step"], a["rank"]) for a in map(orjson.loads, r.stdout.splitlines())]


@pytest.mark.slow
def test_replay_reads_older_stores_and_export_folders(tmp_path: Path) -> None:
    """As `collector --replay` does: columns and tables an older store lacks read as
    empty, and an export folder replays like the store it came from."""
    import shutil

    import duckdb

    from trainvitals.collector.export import export_store

    current = _simulated_store(tmp_path / "current.duckdb")
    r = _cli("replay", str(current), "--check")
    assert r.returncode == 0, r.stderr
    expected = _alerts(r)
    assert {("straggler", 3), ("loss_spike", None)} <= {(k, rank) for k, _, rank in expected}

    older = shutil.copy(current, tmp_path / "older.duckdb")  # columns added since, dropped
    with duckdb.connect(str(older)) as con:
        con.execute("ALTER TABLE runs DROP COLUMN token_target")
        con.execute("ALTER TABLE steps DROP COLUMN nonfinite_steps")
        con.execute("ALTER TABLE layers DROP COLUMN act_nonfinite_steps")
    r = _cli("replay", str(older), "--check")
    assert r.returncode == 0, r.stderr
    assert _alerts(r) == expected and "Traceback" not in r.stderr
    n = len(expected)
    assert f"{n} alerts replayed, identical to the {n} the collector raised" in r.stderr

    no_alerts = shutil.copy(current, tmp_path / "no-alerts.duckdb")  # before alerts were kept
    with duckdb.connect(str(no_alerts)) as con:
        con.execute("DROP TABLE alerts")
    r = _cli("replay", str(no_alerts))
    assert r.returncode == 0, r.stderr
    assert _alerts(r) == expected
    assert f"{n} alerts replayed; not compared: {no_alerts} has no alerts table" in r.stderr
    assert _cli("replay", str(no_alerts), "--check").returncode == 1  # nothing to check against

    export_store(str(current), str(tmp_path / "export"))
    r = _cli("replay", str(tmp_path / "export"), "--check")
    assert r.returncode == 0, r.stderr
    assert _alerts(r) == expected


@pytest.mark.slow
def test_replay_refuses_what_is_not_a_trainvitals_store(tmp_path: Path) -> None:
    other = tmp_path / "other.duckdb"
    import duckdb

    with duckdb.connect(str(other)) as con:
        con.execute("CREATE TABLE trades (id INTEGER)")
    (tmp_path / "folder").mkdir()
    (tmp_path / "notes.txt").write_text("not a database\n")
    cases = {
        other: f"error: {other} is not a trainvitals store: it has no steps table with run_id "
        "and step columns (its tables: trades)",
        tmp_path / "folder": f"error: {tmp_path / 'folder'} is not a trainvitals export: "
        "no table folder (runs, steps, layers, ranks, events, alerts, heartbeats)",
        tmp_path / "notes.txt": f"error: cannot open {tmp_path / 'notes.txt'} read-only: ",
    }
    for path, message in cases.items():
        r = _cli("replay", str(path))
        assert r.returncode != 0 and r.stdout == ""
        assert r.stderr.startswith(message) and len(r.stderr.strip().splitlines()) == 1, r.stderr


def _wandb_csv(path: Path) -> Path:
    lines = ["_step,train/loss,train/grad_norm,_runtime"]
    for step in range(300):
        loss = 2 + 3 * math.exp(-step / 50)
        loss = loss * 3 if step == 200 else loss
        loss = "NaN" if step == 280 else f"{loss:.5f}"
        lines.append(f"{step},{loss},1.0,{step * 2}")
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.slow
def test_analyze_a_wandb_export(tmp_path: Path) -> None:
    r = _cli("analyze", str(_wandb_csv(tmp_path / "run.csv")))
    assert r.returncode == 0, r.stderr
    alerts = list(map(orjson.loads, r.stdout.splitlines()))
    found = [(a["kind"], a["step"]) for a in alerts]
    assert ("loss_spike", 200) in found and ("nonfinite", 280) in found
    assert not any("/api/v1/" in a["message"] for a in alerts)  # no collector behind a file


@pytest.mark.slow
def test_analyze_a_tensorboard_export(tmp_path: Path) -> None:
    rows = [f"{1.7e9 + s},{s},{2.0 if s != 150 else 9.0}" for s in range(200)]
    path = tmp_path / "loss.csv"
    path.write_text("Wall time,Step,Value\n" + "\n".join(rows) + "\n")
    r = _cli("analyze", str(path))
    assert [a["step"] for a in map(orjson.loads, r.stdout.splitlines())] == [150]


@pytest.mark.slow
def test_analyze_names_what_is_missing(tmp_path: Path) -> None:
    path = tmp_path / "odd.csv"
    path.write_text("epoch,accuracy\n1,0.5\n")
    r = _cli("analyze", str(path))
    assert r.returncode != 0 and "no step column found" in r.stderr and "--step-column" in r.stderr
    r = _cli("analyze", str(path), "--step-column", "epoch", "--loss-column", "nope")
    assert "column 'nope' (for loss) is not in the file" in r.stderr
    r = _cli("analyze", str(tmp_path / "absent.csv"))
    assert r.returncode != 0 and "Traceback" not in r.stderr


def test_live_alerts_of_a_simulated_fleet_replay_identically(tmp_path: Path) -> None:
    """Every detector fires once at least; the collector's live driver and the replay
    driver agree alert for alert (kind, step, rank, layer, message)."""
    import duckdb

    from trainvitals.analyzer.replay import comparable, replay_store, store_goodput, stored_alerts
    from trainvitals.simulate import FleetSpec

    faults = (
        "straggler:rank=3,step=100,slowdown=0.2",
        "sdc:rank=5,step=150",
        "spike:step=200",
        "stall:rank=7,step=250,seconds=120",
        "throttle:rank=9,step=300",
        "nan:step=380",
    )
    spec = FleetSpec(
        ranks=24,
        layers=4,
        step_time_s=1.0,
        steps=400,
        canary_every=10,
        ranks_per_node=8,
        faults=faults,
    )
    path = str(tmp_path / "sim.duckdb")
    _store_live(spec, Path(path))
    con = duckdb.connect(path, read_only=True)
    live, replayed = stored_alerts(con), [a.to_dict() for a in replay_store(con)]
    assert sorted(map(comparable, replayed)) == sorted(map(comparable, live))
    found = {(a["kind"], a["rank"]) for a in replayed}
    assert {
        ("straggler", 3),
        ("sdc", 5),
        ("sdc_replica", 5),
        ("sdc_outlier", 5),
        ("loss_spike", None),
        ("stall", 7),
        ("throttle", 9),
        ("nonfinite", None),
    } <= found
    (g,) = store_goodput(con)
    assert g.stalls == 1 and 0.5 < g.ratio < 1
