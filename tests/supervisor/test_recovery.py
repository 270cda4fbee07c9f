"""From alert to recovery, for real: two torchrun agents on this host (each a "node"), a
live collector, DCP checkpoints, `trainvitals supervise` acting on the alerts.

- SDC on node1 (2 x 2 ranks, dp x tp): node1 is fenced, the checkpoints after the last
  agreeing canary are set aside, the run resumes on node0 alone (dp 2 -> 1) and finishes;
- a crash on node1 (2 x 1 ranks): fenced on the collector's rank_lost, resumed on node0;
- a divergence (2 x 1 ranks): rolled back to before the onset, the data since skipped;
- a loss spike (2 x 1 ranks): the step re-run from the checkpoint before it reproduces the
  loss, so it is the data: rolled back, that batch skipped, nobody fenced.
Each time the loss curve after the resume continues the one before the fault. The tests
assert what was done and the losses, never how fast (bench/recovery.py measures that).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from tests.conftest import CollectorProcess

POLICY = """
[limits]
cooldown_s = 0
failure_wait_s = 90
[kinds.sdc]
mode = "act"
[kinds.rank_lost]
mode = "act"
[kinds.loss_diverging]
mode = "act"
skip_data = true
"""
# Acting on loss spikes too would re-run the spike that comes before a divergence, and
# that spike reproduces (the bad window lies before it): only the spike test acts on them.
SPIKES = '[kinds.loss_spike]\nmode = "act"\n'


@pytest.fixture
def collector(tmp_path: Path) -> Iterator[CollectorProcess]:
    # A rank silent for 6 s is lost (default 10 s): the crash test waits less.
    c = CollectorProcess(tmp_path / "store.duckdb", "--set", "liveness.silence_s=6")
    yield c
    c.stop()


def supervise(
    tmp_path: Path, url: str, run_id: str, ranks_per_node: int, train: list[str], policy=POLICY
):
    (tmp_path / "policy.toml").write_text(policy)
    dp = 2 * ranks_per_node // int(train[train.index("--tp") + 1]) if "--tp" in train else 2
    argv = [
        sys.executable, "-m", "trainvitals", "supervise", "--nodes", "node0,node1",
        "--nproc-per-node", str(ranks_per_node), "--collector", url,
        "--policy", str(tmp_path / "policy.toml"), "--fence-file", str(tmp_path / "fence.json"),
        "--log-dir", str(tmp_path / "logs"), "--poll-s", "0.5", "--",
        "-m", "trainvitals.trainer.train", "--dp", str(dp), "--run-id", run_id,
        "--collector", url, "--checkpoint-dir", str(tmp_path / "ckpt"), "--resume",
        "--telemetry-file", str(tmp_path / "telemetry.jsonl"), *train,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=400, env=env)
    logs = "".join(p.read_text() for p in sorted((tmp_path / "logs").glob("*.log")))
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}\n{logs[-6000:]}"
    return proc


def events(url: str, run_id: str) -> dict[str, list[dict]]:
    """The run's events by kind, each with its detail parsed."""
    out: dict[str, list[dict]] = {}
    for e in httpx.get(f"{url}/api/v1/runs/{run_id}/events", timeout=10).json():
        out.setdefault(e["kind"], []).append({**e, "detail": json.loads(e["detail"] or "{}")})
    return out


def losses(path: Path) -> list[tuple[int, float]]:
    """(step, loss) in the order rank 0 trained them, every launch: re-done steps twice."""
    out = []
    for line in path.read_bytes().splitlines():
        if s := orjson.loads(line).get("steps"):
            out += list(zip(s["step"], s["loss"], strict=True))
    return out


def first_and_redone(curve: list[tuple[int, float]]) -> tuple[dict[int, float], dict[int, float]]:
    """step -> loss of the first launch that trained it, and of the last."""
    first, last = {}, {}
    for step, loss in curve:
        first.setdefault(step, loss)
        last[step] = loss
    return first, last


def test_sdc_on_a_node_fences_it_rolls_back_and_resumes_on_the_other(
    tmp_path: Path, collector: CollectorProcess
) -> None:
    train = ["--tp", "2", "--steps", "30", "--checkpoint-every", "5", "--checkpoint-async",
             "--canary-every", "5", "--inject", "sdc:node=node1,rank=0,step=17"]  # fmt: skip
    supervise(tmp_path, collector.url, "sup-sdc", 2, train)
    ev = events(collector.url, "sup-sdc")

    # Rank 2 (node1, local rank 0) is named by the canary at step 20; the canary at step 15
    # agreed, so the checkpoint of step 14 is the last one known clean.
    (fence,) = ev["action:fence"]
    assert fence["detail"]["node"] == "node1" and fence["rank"] == 2
    assert "sdc" in json.loads((tmp_path / "fence.json").read_text())["node1"]["reason"]
    (rollback,) = ev["action:rollback"]
    assert rollback["detail"]["to_checkpoint_step"] == 14, rollback
    assert rollback["detail"]["resume_step"] == 15
    set_aside = sorted(p.name.split(".")[0] for p in (tmp_path / "ckpt/rolled-back").iterdir())
    assert "step-00000019" in set_aside and "step-00000014" not in set_aside
    (relaunch,) = ev["action:relaunch"]
    assert relaunch["detail"]["nodes"] == ["node0"]
    (stop,) = ev["action:stop"]  # before the ranks were stopped
    assert stop["detail"]["nodes"] == ["node0", "node1"] and stop["detail"]["launch"] == 0
    # node1's ranks, fenced, are never heard again: the stop's doing, not lost ranks.
    alerts = httpx.get(f"{collector.url}/api/v1/runs/sup-sdc/alerts").json()
    assert not [a for a in alerts if a["kind"] in ("rank_lost", "hang")], alerts
    (restart,) = ev["restart"]
    assert restart["step"] == 15 and restart["detail"]["resumed_from_step"] == 14
    assert [e["step"] for e in ev["run_end"]] == [30]  # it reached its last step
    # Async checkpoints: each one's stall at its start, and its completion.
    assert {e["step"] for e in ev["checkpoint_stall"]} >= {4, 9, 14}
    assert all(e["detail"]["async"] for e in ev["checkpoint"])

    first, last = first_and_redone(losses(tmp_path / "telemetry.jsonl"))
    assert sorted(last) == list(range(30))
    for step in (15, 16):  # re-done before the fault, on dp=1 instead of 2: the same batch
        assert last[step] == pytest.approx(first[step], rel=0.01)
    assert all(math.isfinite(x) for x in last.values())
    assert last[29] < last[14]  # and it went on learning

    # The post-mortem replay of the stopped store raises the same alerts and counts the
    # supervisor's actions in the run's goodput.
    collector.stop()
    replay = subprocess.run(
        [sys.executable, "-m", "trainvitals", "replay", str(collector.store), "--check",
         "--set", "liveness.silence_s=6"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert replay.returncode == 0, replay.stderr + "\nreplayed:\n" + replay.stdout
    assert "supervisor: 1 node(s) fenced, 1 rollback(s) of " in replay.stderr, replay.stderr


def test_a_crashed_node_is_fenced_and_the_job_resumes_on_the_other(
    tmp_path: Path, collector: CollectorProcess
) -> None:
    train = ["--steps", "30", "--checkpoint-every", "5",
             "--inject", "crash:node=node1,rank=0,step=17"]  # fmt: skip
    supervise(tmp_path, collector.url, "sup-crash", 1, train)
    ev = events(collector.url, "sup-crash")

    (fence,) = ev["action:fence"]  # from the collector's rank_lost naming rank 1
    assert fence["detail"]["node"] == "node1" and fence["rank"] == 1
    assert fence["detail"]["why"].startswith("rank_lost")
    (rollback,) = ev["action:rollback"]
    assert rollback["detail"]["to_checkpoint_step"] == 14  # the latest complete one
    assert ev["action:relaunch"][0]["detail"]["nodes"] == ["node0"]
    assert [e["step"] for e in ev["run_end"]] == [30]

    first, last = first_and_redone(losses(tmp_path / "telemetry.jsonl"))
    assert sorted(last) == list(range(30))
    for step in (15, 16):
        assert last[step] == pytest.approx(first[step], rel=0.01)
    assert last[29] < last[14]


def test_a_divergence_is_rolled_back_to_before_its_onset_and_its_data_skipped(
    tmp_path: Path, collector: CollectorProcess
) -> None:
    # Data window 20 tips training into an instability (the learning rate grows 2x a step).
    # 40 steps: the alert comes near the end (at step 31 in one run), so the job often
    # ends before the supervisor reads it: its last look, once the collector has analysed
    # the last steps, still rolls it back.
    train = ["--steps", "40", "--checkpoint-every", "10",
             "--inject", "diverge:step=20,growth=2"]  # fmt: skip
    proc = supervise(tmp_path, collector.url, "sup-div", 1, train)
    ev = events(collector.url, "sup-div")
    # Its last look asked the collector over HTTP how far the analysis had come.
    assert "a last look at its alerts" in proc.stdout
    assert "analysis progress" not in proc.stdout + proc.stderr

    assert "action:fence" not in ev  # no node to blame
    (rollback,) = ev["action:rollback"]
    kept = rollback["detail"]["to_checkpoint_step"]
    assert kept in (9, 19), rollback  # before the onset, which follows the bad window
    first_skipped, last_skipped = map(int, rollback["detail"]["skip_data"].split(":"))
    assert first_skipped == kept + 1 <= 20 <= last_skipped  # window 20 is never met again
    assert ev["action:relaunch"][0]["detail"]["nodes"] == ["node0", "node1"]
    assert [e["step"] for e in ev["run_end"]] == [40]

    first, last = first_and_redone(losses(tmp_path / "telemetry.jsonl"))
    healthy = first[kept]
    assert max(first[s] for s in range(20, rollback["detail"]["from_step"] + 1)) > 2 * healthy
    assert max(last[s] for s in range(kept + 1, 40)) < 1.1 * healthy  # no climb after it
    assert last[39] < healthy


def test_a_loss_spike_that_a_re_run_reproduces_is_the_data_and_its_batch_is_skipped(
    tmp_path: Path, collector: CollectorProcess
) -> None:
    train = ["--steps", "32", "--checkpoint-every", "5",
             "--inject", "spike:step=24,kind=batch"]  # fmt: skip
    supervise(tmp_path, collector.url, "sup-spike", 1, train, policy=POLICY + SPIKES)
    ev = events(collector.url, "sup-spike")

    (rerun,) = ev["action:rerun"]  # from the checkpoint of step 23's weights: same batch
    assert rerun["step"] == 24 and rerun["detail"]["verdict"] == "data", rerun
    assert rerun["detail"]["rerun_loss"] == pytest.approx(rerun["detail"]["stored_loss"], rel=1e-3)
    assert "action:fence" not in ev
    (rollback,) = ev["action:rollback"]
    assert (rollback["detail"]["to_checkpoint_step"], rollback["detail"]["skip_data"]) == (
        19,
        "24:24",
    )
    assert ev["action:relaunch"][0]["detail"]["nodes"] == ["node0", "node1"]
    assert [e["step"] for e in ev["run_end"]] == [32]

    first, last = first_and_redone(losses(tmp_path / "telemetry.jsonl"))
    assert first[24] > 2 * first[23]  # the spike
    assert last[24] < 1.1 * first[23]  # gone: step 24 trained on the next window
