"""Fault specs: parsed strictly, applied only where and when they say."""

from __future__ import annotations

import pytest
import torch

from trainvitals.trainer.faults import FaultInjector, corrupt, parse_fault


def test_parse_fills_defaults_and_types() -> None:
    f = parse_fault("sdc:rank=2,step=30")
    assert (f.kind, f.rank, f.step, f.params["fraction"]) == ("sdc", 2, 30, 0.001)
    assert parse_fault("straggler:rank=1,step=5,slowdown=0.25").params["slowdown"] == 0.25


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("meltdown:step=1", "unknown fault 'meltdown'"),
        ("straggler:rank=1,step=5", "missing ['slowdown']"),
        ("straggler:rank=1,step=5,slowdown=0", "slowdown must be in"),
        ("nan:step=1.5", "whole number"),
        ("nan:step=-1", "whole number"),
        ("spike:step=3,kind=cosmic", "spike kind"),
        ("sdc:rank=1,step=2,colour=red", "unexpected 'colour=red'"),
        ("crash:rank=x,step=2", "rank must be a whole number >= 0, got 'x'"),
        ("nan:step=inf", "step must be a whole number"),
        ("nan:step=1e400", "step must be a whole number"),
        ("straggler:rank=1,step=5,slowdown=nan", "slowdown must be a number"),
        ("straggler:rank=1,step=5,slowdown=inf", "slowdown must be in"),
    ],
)
def test_bad_specs_are_refused(spec: str, message: str) -> None:
    with pytest.raises(ValueError) as err:
        parse_fault(spec)
    assert message in str(err.value)


def test_rank_beyond_world_is_refused() -> None:
    with pytest.raises(ValueError, match="rank 4 >= world size 4"):
        FaultInjector(["crash:rank=4,step=1"], rank=0, world_size=4)


def test_corrupt_changes_about_the_fraction_asked() -> None:
    t = torch.ones(100_000)
    changed = (corrupt(t, 0.01) != t).float().mean().item()
    assert 0.008 < changed < 0.012
    assert torch.equal(corrupt(t, 0.01), corrupt(t, 0.01))  # a persistent unit: same elements


def test_faults_apply_to_their_rank_and_steps() -> None:
    inj = FaultInjector(
        ["spike:step=3,kind=lr", "nan:step=4", "spike:step=5"], rank=1, world_size=2
    )
    assert [inj.lr_factor(s) for s in (2, 3, 4)] == [1.0, 30.0, 1.0]
    assert torch.isnan(inj.loss(4, torch.tensor(2.0))) and inj.loss(3, torch.tensor(2.0)) == 2.0
    x, y = torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long)
    assert inj.batch(4, x, y)[0] is x
    noisy, _ = inj.batch(5, x, y)
    assert noisy.shape == x.shape and noisy.float().std() > 10


def test_cli_rejects_a_bad_spec_before_starting() -> None:
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "trainvitals.trainer.train", "--inject", "straggler:rank=0"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2 and "missing" in r.stderr and "Traceback" not in r.stderr


def test_ground_truth_is_recorded_once_at_each_fault_step() -> None:
    class Recorder:
        canary = None

        def __init__(self) -> None:
            self.events: list[tuple] = []

        def event(self, kind, step, rank=-1, detail=None) -> None:
            self.events.append((kind, step, rank, detail))

    specs = ["spike:step=3,kind=lr", "straggler:rank=1,step=3,slowdown=0.2", "nan:step=5"]
    monitor = Recorder()
    for rank in (0, 1):  # only rank 0 writes ground truth
        inj = FaultInjector(specs, rank=rank, world_size=2)
        for step in range(8):
            inj.record(monitor, step)
    assert monitor.events == [
        ("fault:spike", 3, -1, {"kind": "lr"}),
        ("fault:straggler", 3, 1, {"slowdown": 0.2}),
        ("fault:nan", 5, -1, {}),
    ]
