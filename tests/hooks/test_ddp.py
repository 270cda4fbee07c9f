"""attach() on plain DDP: the same statistics as one process with the same global batch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.hooks.test_exactness import _assert_close, _telemetry

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
