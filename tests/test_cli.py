"""The `trainvitals` command: help for every job, clear errors for bad flags."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _cli(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trainvitals", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


@pytest.mark.slow
@pytest.mark.parametrize("command", ["train", "collector", "dashboard", "demo"])
def test_every_subcommand_explains_itself(command: str) -> None:
    r = _cli(command, "--help")
    assert r.returncode == 0 and "usage: trainvitals " + command in r.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["train", "--dp", "2", "--tp", "2", "--global-batch", "3"],
            "global_batch (3) must be divisible by dp",
        ),
        (["train", "--preset", "huge"], "preset must be one of"),
        (["train", "--steps", "ten"], "invalid int value"),
        (["train", "--collector", "localhost:8000"], "must be an http(s) URL"),
        (["train", "--nproc", "3", "--dp", "2"], "--nproc 3 must equal dp x tp = 2"),
    ],
)
def test_bad_train_flags_get_a_clear_error(args: list[str], message: str) -> None:
    r = _cli(*args)
    assert r.returncode != 0
    assert message in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_collector_refuses_an_unopenable_store(tmp_path) -> None:
    r = _cli("collector", "--store", str(tmp_path / "missing-dir" / "x.duckdb"), "--port", "1")
    assert r.returncode != 0 and "cannot open store" in r.stderr + r.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--port", "70000"], "error: --port: Input should be less than or equal to 65535"),
        (["--retention-days", "-1"], "error: --retention-days: Input should be greater than"),
        (["--retention-days", "nan"], "error: --retention-days: Input should be a finite number"),
    ],
)
def test_collector_checks_its_flags_before_creating_the_store(tmp_path, flags, message) -> None:
    store = tmp_path / "x.duckdb"
    r = _cli("collector", "--store", str(store), *flags)
    assert r.returncode != 0 and message in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    assert not store.exists()


SIM = ["simulate", "--ranks", "2", "--layers", "1", "--steps", "2", "--step-time", "1"]
PLAN = ["plan", "--tokens", "1e12", "--gpu", "H100", "--count", "8"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["import", "{batch}", "--collector", "http://[::1"], "is not a valid URL"),
        ([*SIM, "--collector", "http://[::1"], "is not a valid URL"),
        ([*SIM, "--collector", "ftp://host"], "must be an http(s) URL"),
        ([*SIM, "--out", "{out}", "--start-unix-s", "nan"], "start_unix_s must be a finite"),
        ([*SIM[:-1], "inf", "--out", "{out}"], "step_time_s must be in"),
        ([*SIM, "--out", "{out}", "--run-id", "r" * 201], "run_id 'rrrr"),
        (
            [*SIM, "--out", "{out}", "--fault", "stall:step=1,seconds=inf"],
            "fault 'stall:step=1,seconds=inf': seconds must be in (0, 604800] (a week), got inf",
        ),
        (
            [*SIM, "--out", "{out}", "--fault", "spike:step=1,factor=1e308"],
            "fault 'spike:step=1,factor=1e308': factor must be in (1, 1000], got 1e+308",
        ),
        (
            [*SIM, "--out", "{out}", "--fault", "straggler:rank=1,step=100,slowdown=0.2"],
            "fault straggler: step 100 >= steps (2); the run's last step is 1",
        ),
        (["train", "--steps", "1", "--inject", "nan:step=inf"], "step must be a whole number"),
        (["train", "--steps", "1", "--inject", "nan:step=1e400"], "step must be a whole number"),
        (
            ["train", "--dp", "2", "--global-batch", "8", "--inject", "nan:step=abc"],
            "--inject 'nan:step=abc': step must be a whole number",
        ),
        (["train", "--run-id", "r" * 201], "run_id 'rrrr"),
        (["train", "--grad-clip", "nan"], "grad_clip must be > 0"),
        ([*PLAN, "--params", "nan"], "params must be a finite number > 0"),
        ([*PLAN, "--params", "1e9", "--power-w", "-700"], "power_w must be a finite number > 0"),
    ],
)
def test_bad_input_gets_one_line_before_anything_starts(tmp_path, args, message) -> None:
    from trainvitals.schema import encode_json
    from trainvitals.simulate import FleetSpec, simulate

    batch, out = tmp_path / "one.jsonl", tmp_path / "out.jsonl"
    batch.write_bytes(encode_json(next(simulate(FleetSpec(2, 1, 1.0, 2)))) + b"\n")
    r = _cli(*(a.format(batch=batch, out=out) for a in args))
    assert r.returncode != 0 and message in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    assert not out.exists()


@pytest.mark.slow
def test_collector_replay_names_its_store(tmp_path) -> None:
    """`collector --replay STORE` serves STORE read-only, as `--store STORE --replay` does."""
    import httpx
    import orjson

    from tests.collector.conftest import make_batch
    from tests.conftest import CollectorProcess
    from trainvitals.collector.store import Store
    from trainvitals.schema import to_arrow

    path = tmp_path / "run.duckdb"
    store = Store(str(path))
    store.start()
    store.submit("r1", to_arrow(orjson.loads(make_batch().to_json()))[1]).result(timeout=60)
    store.close()
    replay = CollectorProcess(None, "--replay", str(path))
    try:
        runs = httpx.get(f"{replay.url}/api/v1/runs", timeout=10).json()
        assert [run["run_id"] for run in runs] == ["r1"]
        ingest = httpx.post(f"{replay.url}/api/v1/ingest", content=make_batch().to_json())
        assert ingest.status_code == 409
    finally:
        replay.stop()
    r = _cli("collector", "--store", str(path), "--replay", str(tmp_path / "other.duckdb"))
    assert r.returncode != 0 and r.stderr.strip() == (
        "error: name the store once: --replay STORE, or --store STORE --replay"
    )


def test_simulate_writes_out_whole_or_not_at_all(tmp_path, monkeypatch) -> None:
    """Stopped half-way (Ctrl-C, an error), `simulate --out` leaves the file as it was."""
    from trainvitals import cli
    from trainvitals import simulate as sim

    out = tmp_path / "sim.jsonl"
    out.write_bytes(b"an earlier run\n")
    whole = sim.simulate

    def interrupted(spec, per_node=False):
        docs = whole(spec, per_node=per_node)
        yield next(docs)
        yield next(docs)
        raise KeyboardInterrupt

    monkeypatch.setattr(sim, "simulate", interrupted)
    with pytest.raises(KeyboardInterrupt):
        cli.main([*SIM, "--out", str(out)])
    assert out.read_bytes() == b"an earlier run\n"
    assert [p.name for p in tmp_path.iterdir()] == ["sim.jsonl"]  # no partial file left
    monkeypatch.setattr(sim, "simulate", whole)
    with pytest.raises(SystemExit) as done:
        cli.main([*SIM, "--out", str(out)])
    assert done.value.code == 0 and len(out.read_bytes().splitlines()) == 3
    assert [p.name for p in tmp_path.iterdir()] == ["sim.jsonl"]


@pytest.mark.slow
def test_config_prints_a_file_that_every_analyzer_command_reads_back(tmp_path) -> None:
    r = _cli("config", "--set", "stall.min_gap_s=30")
    assert r.returncode == 0 and "[stall]\nmin_gap_s = 30.0\n" in r.stdout
    path = tmp_path / "analyzer.toml"
    path.write_text(r.stdout)
    again = _cli("config", "--analyzer-config", str(path))
    assert again.returncode == 0 and again.stdout == r.stdout


@pytest.mark.slow
@pytest.mark.parametrize("command", ["collector", "replay", "analyze", "config"])
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--set", "stall.min_gap_s=soon"], "--set: stall.min_gap_s must be a number, got 'soon'"),
        (["--set", "stal.min_gap_s=3"], "--set: no detector section 'stal'"),
        (["--analyzer-config", "{missing}"], "cannot read it"),
    ],
)
def test_bad_detector_settings_get_one_line(tmp_path, command, flags, message) -> None:
    store = tmp_path / "x.duckdb"
    positional = {"replay": [str(store)], "analyze": [str(tmp_path / "x.csv")]}.get(command, [])
    if command == "collector":
        positional = ["--store", str(store)]
    if command == "replay":  # a real (empty) store, so that only the settings are wrong
        from trainvitals.collector.store import Store

        Store(str(store)).close()
    (tmp_path / "x.csv").write_text("step,loss\n0,2.0\n1,1.9\n")
    flags = [f.format(missing=tmp_path / "missing.toml") for f in flags]
    r = _cli(command, *positional, *flags)
    assert r.returncode != 0 and message in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    assert command != "collector" or not store.exists()
