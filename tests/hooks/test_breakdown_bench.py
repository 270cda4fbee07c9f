"""bench/hook_breakdown.py on the CPU: every hook entry point it names exists and is timed,
so that a renamed or removed hook cannot drop out of the GPU breakdown unnoticed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

# Starts processes (torchrun, a collector, a browser...) or runs for seconds: `make test` only.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_the_breakdown_times_every_hook_entry_point() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "hook_breakdown.py"), "--intervals", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "left out" not in proc.stdout, proc.stdout
    lines = proc.stdout.splitlines()
    assert lines[-1].startswith("hooks per step at the default interval (every 10)")
    assert "device n/a (no GPU)" in lines[-1]
    rows = [line for line in lines if line.endswith("n/a") and not line.startswith("hook ")]
    assert len(rows) == 2 * 7, proc.stdout  # 7 entry points, unlogged and logged steps
    for row in rows:
        host_us = float(row.split()[-2])
        assert host_us > 0, row  # every entry point ran on both kinds of step
