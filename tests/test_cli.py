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


@pytest.mark.parametrize("command", ["train", "collector", "dashboard", "demo"])
def test_every_subcommand_explains_itself(command: str) -> None:
    r = _cli(command, "--help")
    assert r.returncode == 0 and "usage: trainvitals " + command in r.stdout


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


def test_collector_refuses_an_unopenable_store(tmp_path) -> None:
    r = _cli("collector", "--store", str(tmp_path / "missing-dir" / "x.duckdb"), "--port", "1")
    assert r.returncode != 0 and "cannot open store" in r.stderr + r.stdout
