"""Real 4-rank runs (torchrun, gloo) against a live collector: an injected crash raises one
rank_lost naming the crashed rank, an injected hang raises a hang naming the hung rank, a
pause declared as a checkpoint save raises nothing and the same pause undeclared a hang, and
a save that hangs far longer than the run's earlier save is a hang before pause_s.

The watchdog gets short thresholds so the tests take seconds; they assert on who is named,
never on how fast (bench/liveness.py measures that)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn

from tests.conftest import free_port, kill_job, patience_s, wait_until
from trainvitals.analyzer.liveness import LivenessSettings, Watchdog
from trainvitals.collector.main import create_app
from trainvitals.collector.settings import Settings
from trainvitals.trainer.launch import torchrun_command

# Starts processes (torchrun, a collector, a browser...) or runs for seconds: `make test` only.
pytestmark = pytest.mark.slow

# Heartbeats every 2 s: silent for 3 of them is lost; 8 s without a step is a hang (the
# tiny model's steps take well under a second here, even on a loaded machine).
# A declared pause is a hang after 3x the longest of its phase the run came back from, at
# least 10 s.
QUICK_FIELDS = ("silence_s", "hang_floor_s", "first_step_s", "min_history", "pause_floor_s")
QUICK = LivenessSettings(
    silence_s=6.0, hang_floor_s=8.0, first_step_s=30.0, min_history=3, pause_floor_s=10.0
)
RANKS = 4


class Collector:
    """The collector app under uvicorn on a thread of this process (its watchdog can be
    given test settings)."""

    def __init__(self, store: Path) -> None:
        self.store = store
        self.app = create_app(Settings(store_path=str(store)))
        self.url = f"http://127.0.0.1:{(port := free_port())}"
        config = uvicorn.Config(self.app, host="127.0.0.1", port=port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_until(lambda: self.server.started, timeout_s=120)
        self.app.state.watchdog.watchdog = Watchdog(QUICK)

    def query(self, sql: str) -> list[dict]:
        return self.app.state.store.query(sql).to_pylist()

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture
def collector(tmp_path: Path) -> Iterator[Collector]:
    c = Collector(tmp_path / "store.duckdb")
    yield c
    c.stop()


def start_trainer(url: str, *faults: str, steps: int = 60) -> subprocess.Popen:
    args = ["--dp", str(RANKS), "--steps", str(steps), "--log-every", "5", "--collector", url]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        torchrun_command(RANKS, [*args, *(f"--inject={f}" for f in faults)]),
        stdout=subprocess.DEVNULL,
        stderr=None if os.environ.get("TV_DEBUG") else subprocess.DEVNULL,
        env=env,
    )


def alerts(c: Collector, kind: str) -> list[dict]:
    return c.query(f"SELECT * FROM alerts WHERE kind = '{kind}' ORDER BY time_unix_s")


def test_a_crashed_rank_is_named_once(collector: Collector) -> None:
    trainer = start_trainer(collector.url, "crash:rank=2,step=15")
    try:
        assert trainer.wait(patience_s(600)) != 0  # torchrun reports the crash
    finally:
        kill_job(trainer)
    (lost,) = wait_until(lambda: alerts(collector, "rank_lost"), timeout_s=300)
    assert lost["rank"] == 2 and "rank 2 on " in lost["message"], lost
    # The others went silent after it: still one alert, and no hang on a dead job.
    wait_until(lambda: collector.app.state.watchdog.watchdog.open_runs() == [] or True)
    assert len(alerts(collector, "rank_lost")) == 1
    assert alerts(collector, "hang") == []
    # The crashed rank's own record of its fault reached the store.
    events = collector.query("SELECT rank, step FROM events WHERE kind = 'fault:crash'")
    assert events == [{"rank": 2, "step": 15}]
    assert_replay_agrees(collector)


def assert_replay_agrees(collector: Collector) -> None:
    """A replay of the stopped store raises what the collector raised live."""
    collector.stop()
    settings = [f"--set=liveness.{k}={getattr(QUICK, k)}" for k in QUICK_FIELDS]
    replay = subprocess.run(
        [sys.executable, "-m", "trainvitals", "replay", str(collector.store), "--check", *settings],
        capture_output=True, text=True, timeout=patience_s(600),
    )  # fmt: skip
    assert replay.returncode == 0, replay.stdout + replay.stderr


def test_a_hung_rank_is_named(collector: Collector) -> None:
    trainer = start_trainer(collector.url, "hang:rank=1,step=40")
    try:
        (hang,) = wait_until(lambda: alerts(collector, "hang"), timeout_s=300)
    finally:
        kill_job(trainer)
    assert hang["rank"] == 1, hang
    assert "rank 1 on " in hang["message"] and "step 40 is stuck" in hang["message"], hang
    assert alerts(collector, "rank_lost") == []  # its heartbeats went on
    events = collector.query("SELECT rank, step FROM events WHERE kind = 'fault:hang'")
    assert {"rank": 1, "step": 40} in events


def test_a_declared_pause_is_no_hang_and_an_undeclared_one_is(collector: Collector) -> None:
    # Every rank pauses 12 s twice: after step 80 declared as a checkpoint save (as the
    # trainer's own saves are), after step 160 undeclared (a loop that does not say).
    # QUICK's hang floor is 8 s once 3 heartbeats (2 s apart) have seen progress; before,
    # 30 s. The tiny model's steps take about 0.1 s here: 80 of them are seen 4 times, and
    # the 160 before the undeclared pause, with the declared one, over 10 times.
    declared = "pause:step=80,seconds=12,phase=checkpoint"
    trainer = start_trainer(
        collector.url, declared, "pause:step=160,seconds=12,phase=none", steps=200
    )
    try:
        assert trainer.wait(patience_s(600)) == 0
    finally:
        kill_job(trainer)
    rows = wait_until(lambda: r if len(r := alerts(collector, "hang")) >= 2 else None)
    hang, resolved = rows  # none for the declared pause after step 80
    assert (hang["step"], hang["severity"], hang["rank"]) == (161, "critical", None), hang
    assert "the whole job paused: all 4 ranks in data_wait (4)" in hang["message"], hang
    assert "at least 8 s" in hang["message"], hang  # the step's threshold, not start-up's
    assert resolved["severity"] == "resolved"
    assert alerts(collector, "rank_lost") == []
    assert_replay_agrees(collector)  # the stored heartbeats say which pause was declared


def test_a_save_far_longer_than_the_runs_earlier_one_is_a_hang(collector: Collector) -> None:
    # Every rank saves (declared) for 6 s after step 40, and after step 80 for an hour: a
    # hung save. Its threshold is 3x the first save's length as the heartbeats saw it (2 s
    # apart), at least QUICK's 10 s, not pause_s (1800 s): within the wait below.
    first, hung = (f"pause:step={s},seconds={t},phase=checkpoint" for s, t in ((40, 6), (80, 3600)))
    trainer = start_trainer(collector.url, first, hung, steps=120)
    try:
        (hang,) = wait_until(lambda: alerts(collector, "hang"), timeout_s=300)
        assert (hang["step"], hang["rank"]) == (81, None), hang
        assert (
            "a declared checkpoint pause, 3x the longest this run came back from"
            in (hang["message"])
        )
        assert "the whole job paused: all 4 ranks in checkpoint (4)" in hang["message"], hang
        assert_replay_agrees(collector)  # the stored heartbeats hold the first save's length
    finally:
        kill_job(trainer)
