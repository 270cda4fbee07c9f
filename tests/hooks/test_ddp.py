"""attach() on plain DDP: the same statistics as one process with the same global batch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from tests.hooks.test_exactness import _assert_close, _telemetry

# Starts processes (torchrun, a collector, a browser...) or runs for seconds: `make test` only.
pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).with_name("ddp_script.py")


def test_ddp_run_matches_single_process(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    subprocess.run([sys.executable, str(SCRIPT), str(one)], check=True, env=env, timeout=300)
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         str(SCRIPT), str(two)],
        check=True, env=env, timeout=300,
    )  # fmt: skip
    ref_steps, ref_layers = _telemetry(one)
    steps, layers = _telemetry(two)
    assert len(ref_steps) == 4 and len(ref_layers) == 4 * 5
    _assert_close(steps, ref_steps, "step")
    _assert_close(layers, ref_layers, "layer")
    # Each rank's own gradients, read in DDP's comm hook before the all-reduce, and the
    # buckets' traffic: every float32 gradient once per step.
    run, ranks = _run_and_ranks(two)
    assert (run["world_size"], run["dp"], run["tp"]) == (2, 2, 1)  # no mesh: every rank a replica
    n_params = run["n_params"]
    assert len(ranks) == 8
    for step in range(4):
        local = [r["grad_norm_local"] for r in ranks if r["step"] == step]
        assert all(x > 0 for x in local) and local[0] != local[1]
    assert all(r["all_reduce_bytes"] == 4 * n_params and r["all_reduce_count"] >= 1 for r in ranks)
    assert all(r["all_reduce_time_s"] > 0 for r in ranks)


def _run_and_ranks(path: Path) -> tuple[dict, list[dict]]:
    run, rows = {}, []
    for line in path.read_bytes().splitlines():
        batch = orjson.loads(line)
        if r := batch.get("runs"):
            run = {k: v[0] for k, v in r.items()}
        if t := batch.get("ranks"):
            rows += [dict(zip(t, values, strict=True)) for values in zip(*t.values(), strict=True)]
    return run, rows
