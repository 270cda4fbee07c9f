"""The hooks' statistics of a dp=2 x tp=2 run equal those of one process, step by step."""

from __future__ import annotations

import math
from pathlib import Path

import orjson
import pytest

from tests.conftest import run_trainer

# Starts processes (torchrun, a collector, a browser...) or runs for seconds: `make test` only.
pytestmark = pytest.mark.slow

STEPS = 8
REL_TOL = 1e-4


def _telemetry(path: Path) -> tuple[dict, dict]:
    steps, layers = {}, {}
    for line in path.read_bytes().splitlines():
        batch = orjson.loads(line)
        if s := batch.get("steps"):
            for i, step in enumerate(s["step"]):
                steps[step] = {"loss": s["loss"][i], "grad_norm": s["grad_norm"][i]}
        if t := batch.get("layers"):
            for i, (step, layer) in enumerate(zip(t["step"], t["layer"], strict=True)):
                assert t["nonfinite_count"][i] == 0 and t["act_nonfinite_count"][i] == 0
                layers[step, layer] = {
                    name: t[name][i]
                    for name in ("grad_norm", "act_rms", "act_max_abs", "param_norm", "update_rms")
                    if t[name][i] is not None  # no update before the first optimizer step
                }
    return steps, layers


def _assert_close(sharded: dict, reference: dict, what: str) -> None:
    assert sharded.keys() == reference.keys(), f"{what}: different keys"
    for key, ref in reference.items():
        for name, value in ref.items():
            got = sharded[key][name]
            assert math.isfinite(value) and value != 0, f"{what} {key} {name}: degenerate {value}"
            assert math.isclose(got, value, rel_tol=REL_TOL), (
                f"{what} {key} {name}: {got} vs {value}"
            )


def test_sharded_run_matches_single_process(tmp_path: Path) -> None:
    common = ["--steps", str(STEPS), "--global-batch", "8", "--seed", "3", "--log-every", "1"]
    run_trainer([*common, "--telemetry-file", str(tmp_path / "one.jsonl")], nproc=1)
    run_trainer(
        [*common, "--dp", "2", "--tp", "2", "--telemetry-file", str(tmp_path / "four.jsonl")],
        nproc=4,
    )
    ref_steps, ref_layers = _telemetry(tmp_path / "one.jsonl")
    steps, layers = _telemetry(tmp_path / "four.jsonl")
    assert len(ref_steps) == STEPS and len(ref_layers) == STEPS * 5
    assert all("update_rms" in v for (step, _), v in ref_layers.items() if step > 0)
    _assert_close(steps, ref_steps, "step")
    _assert_close(layers, ref_layers, "layer")
    # The statistics move as training proceeds: equal values are not constants.
    assert ref_steps[STEPS - 1]["loss"] < ref_steps[0]["loss"]
