"""Stopping a job: real torchrun agents whose ranks outlive them."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from tests.conftest import wait_until
from trainvitals.supervisor.launch import Agents

# A rank that ignores SIGTERM, as one stuck in a collective does (Python runs its handler
# only between bytecodes), and says its pid.
STUBBORN = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
open(os.path.join(sys.argv[1], str(os.getpid())), "w").close()
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    """A process that runs (a zombie has ended: only its parent has not reaped it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def test_stop_kills_ranks_that_outlive_their_agent(tmp_path: Path) -> None:
    script, pids_dir = tmp_path / "stubborn.py", tmp_path / "pids"
    script.write_text(STUBBORN)
    pids_dir.mkdir()
    agents = Agents(["node0"], 2, [str(script), str(pids_dir)], tmp_path / "logs", "t")
    try:
        wait_until(lambda: len(list(pids_dir.iterdir())) == 2, timeout_s=120)
        ranks = [int(p.name) for p in pids_dir.iterdir()]
        # torchrun passes SIGTERM on and waits 30 s before it kills its ranks itself: the
        # supervisor's SIGKILL of the agent comes first, and the ranks, each in a session
        # of its own, outlive it unless stop() kills them too.
        agents.stop(timeout_s=1)
        assert all(p.poll() is not None for p in agents.procs)
        wait_until(lambda: not any(_alive(pid) for pid in ranks), timeout_s=30)
    finally:
        for pid in (int(p.name) for p in pids_dir.iterdir()):  # never leave one behind
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
