"""`trainvitals supervise` refuses bad input with one line, before anything starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainvitals.cli import main

JOB = ["--", "-m", "trainvitals.trainer.train", "--dp", "2", "--run-id", "r", "--resume"]


def supervise(tmp_path: Path, *flags: str, job: list[str] | None = None) -> str:
    argv = [
        "supervise", "--nodes", "node0,node1", "--nproc-per-node", "1",
        "--collector", "http://127.0.0.1:9", "--log-dir", str(tmp_path / "logs"), *flags,
        *(job if job is not None else [*JOB, "--checkpoint-dir", str(tmp_path / "ckpt")]),
    ]  # fmt: skip
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert not (tmp_path / "logs").exists(), "a job was launched"
    return str(e.value.code)


def test_a_policy_that_does_not_parse(tmp_path: Path) -> None:
    (tmp_path / "p.toml").write_text("[kinds.sdc\nmode = 'act'")
    message = supervise(tmp_path, "--policy", str(tmp_path / "p.toml"))
    assert message.startswith("error: policy") and "not valid TOML" in message


def test_a_policy_with_an_unknown_alert_kind(tmp_path: Path) -> None:
    (tmp_path / "p.toml").write_text("[kinds.disk_full]\nmode = 'act'")
    assert "unknown alert kind 'disk_full'" in supervise(
        tmp_path, "--policy", str(tmp_path / "p.toml")
    )


def test_a_fence_list_that_excludes_every_node(tmp_path: Path) -> None:
    fence = tmp_path / "fence.json"
    fence.write_text(json.dumps({"node0": {"reason": "sdc"}, "node1": {"reason": "hang"}}))
    message = supervise(tmp_path, "--fence-file", str(fence))
    assert "excludes every node of the job (node0, node1)" in message


def test_a_webhook_without_a_token(tmp_path: Path) -> None:
    assert "needs a token" in supervise(tmp_path, "--webhook-port", "9097")


def test_a_job_that_cannot_resume(tmp_path: Path) -> None:
    job = ["--", "-m", "trainvitals.trainer.train", "--run-id", "r"]
    assert "needs --run-id, --checkpoint-dir and --resume" in supervise(tmp_path, job=job)
    assert "give the job's command after --" in supervise(tmp_path, job=[])
