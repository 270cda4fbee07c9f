"""Heartbeats: the phases a training step goes through, what is sent and when, and that a dead
collector or an ending process never troubles training."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from tests.conftest import free_port, wait_until
from trainvitals.hooks import InMemoryExporter, attach


class Receiver:
    """A collector stand-in on 127.0.0.1 that keeps every heartbeat row it is sent; one that
    predates some phases (`refused`) answers them as such a collector did, with a 422."""

    def __init__(self, refused: tuple[str, ...] = ()) -> None:
        rows = self.rows = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                doc = orjson.loads(self.rfile.read(int(self.headers["content-length"])))
                cols = doc["heartbeats"]
                if cols["phase"][0] in refused:
                    detail = f"heartbeats.phase: {cols['phase'][0]!r} is not one of [...]"
                    self.send_response(422)
                    self.end_headers()
                    self.wfile.write(orjson.dumps({"detail": detail}))
                    return
                rows.extend(
                    dict(zip(cols, values, strict=True))
                    for values in zip(*cols.values(), strict=True)
                )
                self.send_response(202)
                self.end_headers()

            def log_message(self, *_args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))


def test_a_step_goes_through_its_phases() -> None:
    m = model()
    monitor = attach(m, log_every=1000)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    live = monitor.liveness
    seen = []
    hook = register_optimizer_step_pre_hook(lambda *_: seen.append(live.phase))
    try:
        assert (live.phase, live.step_started, live.step_finished) == ("idle", -1, -1)
        loss = m(torch.randn(4, 8)).square().mean()
        assert (live.phase, live.step_started) == ("forward", 0)
        loss.backward()
        assert live.phase == "backward"
        monitor.step(loss=loss, tokens=4)
        assert (live.phase, live.step_finished) == ("data_wait", 0)
        opt.step()
        assert seen == ["optimizer"] and live.phase == "data_wait"
        with torch.no_grad():
            m(torch.randn(4, 8))  # an evaluation is not the next step
        assert (live.phase, live.step_started) == ("data_wait", 0)
    finally:
        hook.remove()
        monitor.close()


def test_a_declared_pause_is_the_phase_while_it_lasts() -> None:
    m = model()
    out = InMemoryExporter()
    monitor = attach(m, log_every=1000, exporter=out)
    live = monitor.liveness
    try:
        loss = m(torch.randn(4, 8)).square().mean()
        loss.backward()
        monitor.step(loss=loss, tokens=4)
        with monitor.pause("eval"):
            with torch.no_grad():
                m(torch.randn(4, 8))  # the evaluation's forwards leave the phase alone
            assert (live.phase, live.step_started) == ("eval", 0)
        assert live.phase == "data_wait"
        with pytest.raises(RuntimeError), monitor.pause():  # an error inside: restored too
            assert live.phase == "checkpoint"
            with monitor.pause("checkpoint"):  # nested (an async save's wait): one event
                pass
            assert live.phase == "checkpoint"
            raise RuntimeError("the save failed")
        assert live.phase == "data_wait"
        with pytest.raises(
            ValueError, match=r"pause phase must be one of \['checkpoint', 'eval'\]"
        ):
            monitor.pause("nap").__enter__()
        assert live.phase == "data_wait"
    finally:
        monitor.close()
    # Each pause is an event at its end with its duration, after the step it followed.
    pauses = [e for e in out.rows("events") if e["kind"].startswith("pause")]
    assert [(e["kind"], e["step"]) for e in pauses] == [("pause:eval", 0), ("pause:checkpoint", 0)]
    assert all(orjson.loads(e["detail"])["duration_s"] >= 0 for e in pauses)


def test_a_collector_older_than_declared_pauses_hears_data_wait() -> None:
    receiver = Receiver(refused=("checkpoint", "eval"))
    m = model()
    monitor = attach(m, heartbeat_url=receiver.url, heartbeat_interval_s=1.0, log_every=1000)
    try:
        with monitor.pause("checkpoint"):
            wait_until(lambda: any(r["phase"] == "data_wait" for r in receiver.rows))
    finally:
        monitor.close()
        receiver.close()
    assert "checkpoint" not in {r["phase"] for r in receiver.rows}
    assert monitor.heartbeat.failed == 0  # each refused one was sent again, as data_wait


def test_every_interval_a_heartbeat_and_ended_at_close(receiver: Receiver) -> None:
    m = model()
    # A heartbeat's time-out is its interval (at most 2 s): 50 ms timed out against this
    # receiver at load 15, so one every second.
    monitor = attach(m, heartbeat_url=receiver.url, heartbeat_interval_s=1.0, log_every=1000)
    for _ in range(3):
        loss = m(torch.randn(4, 8)).square().mean()
        loss.backward()
        monitor.step(loss=loss, tokens=4)
    wait_until(lambda: len(receiver.rows) >= 3)
    monitor.close()
    first, last = receiver.rows[0], receiver.rows[-1]
    assert first["phase"] == "idle" and first["rank"] == 0
    assert (last["phase"], last["step_finished"]) == ("ended", 2)
    assert monitor.heartbeat.failed == 0
    n = len(receiver.rows)
    monitor.close()  # a second close sends nothing more
    assert len(receiver.rows) == n


def test_a_dead_collector_is_counted_and_training_goes_on() -> None:
    m = model()
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    monitor = attach(m, heartbeat_url=dead, heartbeat_interval_s=0.02, log_every=1000)
    for _ in range(5):
        loss = m(torch.randn(4, 8)).square().mean()
        loss.backward()
        monitor.step(loss=loss, tokens=4)
    wait_until(lambda: monitor.heartbeat.failed >= 2)
    monitor.close()
    assert monitor.heartbeat.sent == 0


@pytest.mark.slow
@pytest.mark.parametrize(
    ("ending", "code"), [("raise SystemExit(3)", 3), ("os.kill(os.getpid(), signal.SIGTERM)", -15)]
)
def test_a_process_ending_without_close_exports_what_is_queued_and_says_exited(
    receiver: Receiver, ending: str, code: int, tmp_path
) -> None:
    """An error exit (atexit) or torchrun's SIGTERM: the telemetry still queued is exported
    first (a batch goes every 30 s: all 5 logged steps are queued at the end), then a last
    heartbeat of phase "exited"."""
    out = tmp_path / "steps.jsonl"
    script = textwrap.dedent(f"""
        import os, signal, torch
        from trainvitals.hooks import attach
        from trainvitals.hooks.exporter import JsonlExporter

        m = torch.nn.Linear(4, 4)
        monitor = attach(m, exporter=JsonlExporter({str(out)!r}), heartbeat_url={receiver.url!r},
                         heartbeat_interval_s=60, log_every=1, export_interval_s=30)
        for step in range(5):
            monitor.step(loss=m(torch.ones(2, 4)).sum(), tokens=8)
        {ending}
    """)
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == code, done.stderr
    assert [r["phase"] for r in receiver.rows] == ["idle", "exited"]
    steps = [
        s for line in out.read_bytes().splitlines() for s in orjson.loads(line)["steps"]["step"]
    ]
    assert steps == [0, 1, 2, 3, 4]


@pytest.mark.slow
def test_a_rank_waiting_for_a_tensor_parallel_peer_mid_forward_says_collective(
    tmp_path: Path,
) -> None:
    """On gloo, DTensor's all-reduce returns before it completes and the host blocked at
    the output's first use while its heartbeat said "forward", so a hang mid-forward named
    the peer that waited too. Rank 0 of a tp = 2 run now says "collective" while it waits
    for rank 1, held in its first block's feed-forward, and "forward" again after."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node=2", str(Path(__file__).with_name("tp_wait_script.py")),
            str(tmp_path)]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-5000:]
    seen = json.loads((tmp_path / "phases.json").read_text())
    assert "collective" in seen and seen[-1] == "after: forward", seen


@pytest.mark.slow
def test_a_rank_waiting_for_a_tensor_parallel_peer_mid_backward_says_collective(
    tmp_path: Path,
) -> None:
    """The backward's tensor-parallel all-reduces (the colwise inputs' gradients) run
    inside autograd, and a rank blocked there said "backward", as its peer stuck mid-
    backward did: a hang there named both. Rank 0 of a tp = 2 run now says "collective"
    while it waits for rank 1, held before its first block's feed-forward backward."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node=2", str(Path(__file__).with_name("tp_wait_script.py")),
            str(tmp_path), "backward"]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-5000:]
    seen = json.loads((tmp_path / "phases.json").read_text())
    assert "collective" in seen and seen[-1] == "after: backward", seen
