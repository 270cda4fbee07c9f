"""Replica fingerprints on a real dp=2 x tp=2 run: replicas agree until a bit flips."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import orjson
import pytest

from tests.conftest import run_trainer

# Starts processes (torchrun, a collector, a browser...) or runs for seconds: `make test` only.
pytestmark = pytest.mark.slow

FLIP_STEP, FLIP_RANK = 4, 1


def _ranks(path: Path) -> dict[int, dict[int, dict]]:
    """step -> rank -> row of the ranks table."""
    out: dict[int, dict[int, dict]] = defaultdict(dict)
    for line in path.read_bytes().splitlines():
        t = orjson.loads(line).get("ranks")
        if t:
            for i, (step, rank) in enumerate(zip(t["step"], t["rank"], strict=True)):
                out[step][rank] = {k: v[i] for k, v in t.items()}
    return out


def test_a_flipped_bit_splits_its_replica_group(tmp_path: Path) -> None:
    telemetry = tmp_path / "run.jsonl"
    run_trainer(
        [
            *("--steps", "8", "--dp", "2", "--tp", "2", "--canary-every", "2"),
            *("--inject", f"sdc:rank={FLIP_RANK},step={FLIP_STEP},mode=bitflip"),
            *("--telemetry-file", str(telemetry)),
        ],
        nproc=4,
    )
    ranks = _ranks(telemetry)
    # rank = dp_index * tp + tp_index; the norm weights are replicated over tp.
    assert {r: row["replica_group"] for r, row in ranks[0].items()} == {0: 0, 1: 0, 2: 1, 3: 1}
    for step in (0, 2, 4, 6):
        fp = {r: row["replica_fingerprint"] for r, row in ranks[step].items()}
        assert all(isinstance(v, int) for v in fp.values()), fp
        assert fp[2] == fp[3], f"step {step}: the untouched group must agree"
        assert (fp[0] != fp[1]) == (step >= FLIP_STEP), f"step {step}: {fp}"
        canary = {row["canary_fingerprint"] for row in ranks[step].values()}
        assert len(canary) == 1  # the arithmetic is fine: only the memory of one rank is
    assert all(row["replica_fingerprint"] is None for row in ranks[1].values())


def test_ranks_carry_timing_traffic_and_local_gradient_norms(tmp_path: Path) -> None:
    """The same kind of run, read for what else each rank reports (exactness of the counts
    and of the local norm: tests/hooks/test_comms.py)."""
    telemetry = tmp_path / "run.jsonl"
    run_trainer(
        [*("--steps", "4", "--dp", "2", "--tp", "2", "--telemetry-file", str(telemetry))],
        nproc=4,
    )
    rows = [row for by_rank in _ranks(telemetry).values() for row in by_rank.values()]
    assert len(rows) == 16
    for row in rows:
        assert row["grad_norm_local"] > 0 and row["compute_time_s"] > 0
        assert 0 <= row["data_time_s"] < row["step_time_s"]
        for kind in ("all_gather", "reduce_scatter", "all_reduce"):
            assert row[f"{kind}_count"] > 0 and row[f"{kind}_bytes"] > 0, kind
        assert row["reduce_scatter_time_s"] > 0  # gloo: FSDP's blocking calls are timed
