"""Two torchrun agents on one machine (--nnodes 2, a rendezvous on 127.0.0.1) as two nodes:
each node's leader exports its own ranks' rows, rank 0 the steps and layers rows. Every
(step, rank) row is stored once, the live alerts are those of a replay of the store, and
the steps and layers rows equal those of one process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import duckdb
import orjson
import pytest

from tests.conftest import CollectorProcess, free_port, run_trainer
from tests.hooks.test_exactness import _assert_close, _telemetry
from trainvitals.analyzer.replay import comparable, replay_store, stored_alerts

# Starts processes (torchrun, a collector, a browser...) or runs for seconds: `make test` only.
pytestmark = pytest.mark.slow

NODES, PER_NODE = 2, 4  # 8 ranks, dp=4 x tp=2: 50-120 s on a shared 2-core machine
FAULT_STEP = 10  # a faulty unit on rank 5 (node 1) from here: its canary names it
STEPS = 16
RUN_ID = "two-nodes"


def two_node_argv(node_rank: int, port: int, train_args: list[str]) -> list[str]:
    """One torchrun agent of a static rendezvous on 127.0.0.1 (its node rank given)."""
    return [
        sys.executable, "-m", "torch.distributed.run",
        f"--nnodes={NODES}", f"--node-rank={node_rank}", f"--nproc-per-node={PER_NODE}",
        "--master-addr=127.0.0.1", f"--master-port={port}",
        "-m", "trainvitals.trainer.train", *train_args,
    ]  # fmt: skip


def run_two_nodes(train_args: list[str], timeout_s: float = 600) -> None:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    agents = [
        subprocess.Popen(
            two_node_argv(node, port, train_args),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for node in range(NODES)
    ]
    outputs = [a.communicate(timeout=timeout_s)[0] for a in agents]
    for node, (agent, out) in enumerate(zip(agents, outputs, strict=True)):
        assert agent.returncode == 0, f"node {node} failed:\n{out[-5000:]}"


def test_two_nodes_export_each_rank_once_and_replay_the_live_alerts(tmp_path: Path) -> None:
    world = NODES * PER_NODE
    common = ["--steps", str(STEPS), "--global-batch", "8", "--seed", "3", "--log-every", "1"]
    collector = CollectorProcess(tmp_path / "store.duckdb")
    try:
        run_two_nodes(
            [*common, "--dp", str(world // 2), "--tp", "2", "--run-id", RUN_ID,
             "--collector", collector.url, "--telemetry-file", str(tmp_path / "nodes.jsonl"),
             "--canary-every", "2", "--inject", f"sdc:rank=5,step={FAULT_STEP}"]
        )  # fmt: skip
    finally:
        collector.stop()  # every batch was acknowledged before the agents exited
    con = duckdb.connect(str(collector.store), read_only=True)
    try:
        q = "SELECT count(*), count(DISTINCT ({k})) FROM {t} WHERE run_id = ?"
        assert con.execute(q.format(k="step", t="steps"), [RUN_ID]).fetchall() == [(STEPS,) * 2]
        ranks = con.execute(q.format(k="step, rank", t="ranks"), [RUN_ID]).fetchall()
        assert ranks == [(STEPS * world,) * 2]  # every (step, rank) once, from both leaders
        runs = "SELECT world_size FROM runs WHERE run_id = ?"
        assert con.execute(runs, [RUN_ID]).fetchall() == [(world,)]
        live = sorted(comparable(a) for a in stored_alerts(con))
        replayed = sorted(comparable(a.to_dict()) for a in replay_store(con))
        assert live == replayed
        # Node 1's rows reached the detectors live: its rank 5 is named.
        assert any(kind == "sdc" and rank == 5 for _, _, kind, rank, *_ in live), live
        assert not [a for a in live if a[2] == "ranks_missing"]  # every node's rows arrived
    finally:
        con.close()
    # Each leader's file holds its own node's ranks: rank 0's the first node's, rank 4's
    # (node 1's leader) the second's, and the steps rows are rank 0's alone.
    for leader, path in ((0, "nodes.jsonl"), (PER_NODE, f"nodes.jsonl.rank{PER_NODE}")):
        ranks, steps = set(), 0
        for line in (tmp_path / path).read_bytes().splitlines():
            batch = orjson.loads(line)
            ranks.update(batch.get("ranks", {}).get("rank", []))
            steps += len(batch.get("steps", {}).get("step", []))
        assert ranks == set(range(leader, leader + PER_NODE))
        assert steps == (STEPS if leader == 0 else 0)
    # The steps and layers rows (rank 0's) equal those of one process, up to the fault.
    run_trainer([*common, "--telemetry-file", str(tmp_path / "one.jsonl")], nproc=1)
    ref_steps, ref_layers = _telemetry(tmp_path / "one.jsonl")
    steps, layers = _telemetry(tmp_path / "nodes.jsonl")
    clean = lambda rows: {k: v for k, v in rows.items() if _step(k) < FAULT_STEP}  # noqa: E731
    _assert_close(clean(steps), clean(ref_steps), "step")
    _assert_close(clean(layers), clean(ref_layers), "layer")


def _step(key: int | tuple[int, int]) -> int:
    return key if isinstance(key, int) else key[0]
