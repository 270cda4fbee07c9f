"""Replica fingerprints on a real dp=2 x tp=2 run: replicas agree until a bit flips."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import orjson

from tests.conftest import run_trainer

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
