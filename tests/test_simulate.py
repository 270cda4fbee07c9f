"""The fleet simulator: fault specs, determinism, ground truth, and documents the schema takes."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from trainvitals.schema import RANKS, to_arrow
from trainvitals.sender import merge, points
from trainvitals.simulate import Fault, FleetSpec, parse_fault, simulate


def _docs(**kw) -> list[dict]:
    spec = FleetSpec(**{"ranks": 16, "layers": 4, "step_time_s": 0.5, "steps": 20, **kw})
    return list(simulate(spec))


def _column(docs: list[dict], table: str, name: str) -> list:
    return [v for d in docs if table in d and name in d[table] for v in list(d[table][name])]


def test_parse_fault_reads_every_kind_with_defaults() -> None:
    assert parse_fault("straggler:rank=3,step=100,slowdown=0.2") == Fault(
        "straggler", 100, 3, {"slowdown": 0.2, "until": 0, "ramp": 0, "every": 0}
    )
    assert parse_fault("sdc:rank=1,step=5").params == {"grad_factor": 30.0}
    assert parse_fault("spike:step=7,factor=4") == Fault("spike", 7, -1, {"factor": 4.0})
    assert parse_fault("nan:step=9") == Fault("nan", 9)
    assert parse_fault("stall:step=3,seconds=30") == Fault("stall", 3, -1, {"seconds": 30.0})
    throttle = parse_fault("throttle:rank=2,step=4,reasons=0x40")
    assert throttle.params == {"clock_drop": 0.3, "reasons": 64.0}


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("meltdown:step=1", "unknown fault 'meltdown'"),
        ("straggler:rank=1,step=2", r"missing \['slowdown'\]"),
        ("straggler:rank=1,step=2,slowdown=0.2,speed=3", "unexpected 'speed=3'"),
        ("straggler:rank=1,step=2,slowdown", "unexpected 'slowdown'"),
        ("straggler:rank=1.5,step=2,slowdown=0.2", "rank must be a whole number"),
        ("straggler:rank=1,step=2,slowdown=fast", "slowdown must be a number"),
        ("straggler:rank=1,step=2,slowdown=0", r"slowdown must be in \(0, 10\]"),
        ("sdc:rank=-1,step=2", "rank must be a whole number >= 0, got '-1'"),
        ("stall:step=2,seconds=-1", r"seconds must be in \(0, 604800\] \(a week\), got -1"),
        ("stall:step=2,seconds=inf", r"seconds must be in \(0, 604800\] \(a week\), got inf"),
        ("stall:step=2,seconds=nan", "seconds must be a number, got 'nan'"),
        ("spike:step=5,factor=1e308", r"factor must be in \(1, 1000\], got 1e\+308"),
        ("sdc:rank=1,step=2,grad_factor=inf", r"grad_factor must be in \(1, 1e6\], got inf"),
        ("throttle:rank=0,step=1,clock_drop=1.5", "clock_drop must be in"),
    ],
)
def test_bad_fault_specs_say_what_is_wrong(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_fault(spec)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"ranks": 0}, "FleetSpec.ranks"),
        ({"step_time_s": 0}, "FleetSpec.step_time_s"),
        ({"step_time_s": math.inf}, "FleetSpec.step_time_s"),
        ({"step_time_s": 1e15}, "FleetSpec.step_time_s"),
        ({"start_unix_s": math.nan}, "FleetSpec.start_unix_s"),
        ({"start_unix_s": -1.0}, "FleetSpec.start_unix_s"),
        ({"run_id": "r" * 201}, "run_id 'rrrr"),
        ({"log_every": 3, "canary_every": 10}, "multiple of log_every"),
        ({"faults": ("sdc:rank=16,step=1",)}, r"rank 16 >= ranks \(16\)"),
        (
            {"faults": ("straggler:rank=1,step=20,slowdown=0.2",)},
            r"fault straggler: step 20 >= steps \(20\); the run's last step is 19",
        ),
    ],
)
def test_bad_fleet_specs_name_the_field(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FleetSpec(**{"ranks": 16, "layers": 4, "step_time_s": 0.5, "steps": 20, **change})


def test_every_document_validates_and_holds_one_logged_step() -> None:
    docs = _docs(log_every=2, canary_every=10)
    run_id, tables = to_arrow(docs[0])
    assert run_id == "sim-0" and set(tables) == {"runs"}
    assert tables["runs"].column("world_size").to_pylist() == [16]
    for doc in docs[1:]:
        _, tables = to_arrow(doc)
        (step,) = tables["steps"].column("step").to_pylist()
        assert step % 2 == 0
        assert tables["layers"].num_rows == 4 and tables["ranks"].num_rows == 16
        assert set(tables["ranks"].column("step").to_pylist()) == {step}
        canary = tables["ranks"].column("canary_fingerprint")
        assert canary.null_count == (0 if step % 10 == 0 else 16)
    assert _column(docs, "events", "kind") == ["run_end"]


def test_the_ranks_rows_carry_every_field() -> None:
    (first_step,) = [d for d in _docs() if "ranks" in d][:1]
    # But the stopped time: the simulated fleet is of GPU ranks, which do not measure it.
    assert set(first_step["ranks"]) == {f.name for f in RANKS.fields} - {"stopped_time_s"}


def test_a_seed_fixes_every_value() -> None:
    a, b, c = _docs(seed=1), _docs(seed=1), _docs(seed=2)
    assert _column(a, "ranks", "compute_time_s") == _column(b, "ranks", "compute_time_s")
    assert _column(a, "steps", "loss") == _column(b, "steps", "loss")
    assert _column(a, "ranks", "compute_time_s") != _column(c, "ranks", "compute_time_s")


def test_faults_change_what_they_should_and_are_recorded_as_ground_truth() -> None:
    faults = (
        "straggler:rank=3,step=5,slowdown=0.5",
        "sdc:rank=7,step=10",
        "spike:step=12,factor=5",
        "nan:step=15",
        "stall:step=16,seconds=20",
        "throttle:rank=1,step=8",
    )
    clean, faulty = _docs(canary_every=5), _docs(canary_every=5, faults=faults)
    rows = [
        dict(zip(d["events"], row, strict=True))
        for d in faulty
        if "events" in d
        for row in zip(*d["events"].values(), strict=True)
    ]
    truth = {(e["kind"], e["rank"], e["step"]) for e in rows}
    assert truth == {
        ("fault:straggler", 3, 5),
        ("fault:sdc", 7, 10),
        ("fault:spike", -1, 12),
        ("fault:nan", -1, 15),
        ("fault:stall", -1, 16),
        ("fault:throttle", 1, 8),
        ("run_end", -1, 20),
    }
    straggler = next(e for e in rows if e["kind"] == "fault:straggler")
    assert json.loads(straggler["detail"]) == {"slowdown": 0.5, "until": 0, "ramp": 0, "every": 0}

    def step(docs, n):
        return next(d for d in docs if "steps" in d and d["steps"]["step"][0] == n)

    s6, c6 = step(faulty, 6)["ranks"], step(clean, 6)["ranks"]
    ratio = s6["compute_time_s"] / c6["compute_time_s"]
    assert ratio[3] == pytest.approx(1.5) and np.allclose(np.delete(ratio, 3), 1.0)
    assert s6["wait_time_s"][3] == 0.0  # everyone waits for the straggler
    s10 = step(faulty, 10)["ranks"]
    fingerprints = s10["canary_fingerprint"]
    assert (np.delete(fingerprints, 7) == fingerprints[0]).all()
    assert fingerprints[7] != fingerprints[0]
    replicas = s10["replica_fingerprint"]
    peers = s10["replica_group"] == s10["replica_group"][7]
    assert len(set(replicas[peers].tolist())) == 2  # rank 7 disagrees with its replicas
    assert s10["grad_norm_local"][7] > 10 * np.median(s10["grad_norm_local"])
    spike, before = step(faulty, 12)["steps"]["loss"][0], step(faulty, 11)["steps"]["loss"][0]
    assert spike > 3 * before
    nan = step(faulty, 15)
    assert math.isnan(nan["steps"]["loss"][0]) and math.isnan(nan["steps"]["grad_norm"][0])
    assert nan["layers"]["nonfinite_count"][-1] > 0
    stall = step(faulty, 16)["steps"]["step_time_s"][0]
    assert stall > 20 > step(clean, 16)["steps"]["step_time_s"][0]
    s9 = step(faulty, 9)["ranks"]
    assert s9["throttle_reasons"][1] == 0x20 and s9["throttle_reasons"][0] == 0
    assert s9["sm_clock_mhz"][1] < 0.75 * s9["sm_clock_mhz"][0]


def test_a_straggler_follows_its_schedule_as_the_trainers_does() -> None:
    """until, ramp and every, as the trainer's straggler takes them (faultspec)."""
    schedules = {
        "every=5": [1.5, 1, 1, 1, 1, 1.5, 1, 1, 1, 1, 1.5],
        "until=8": [1.5] * 6 + [1] * 5,
        "ramp=4": [1.125, 1.25, 1.375, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5],
    }
    clean = _docs()
    for schedule, expected in schedules.items():
        faulty = _docs(faults=(f"straggler:rank=3,step=2,slowdown=0.5,{schedule}",))
        ratios = [
            f["ranks"]["compute_time_s"][3] / c["ranks"]["compute_time_s"][3]
            for f, c in zip(faulty, clean, strict=True)
            if "ranks" in f and 2 <= f["steps"]["step"][0] <= 12
        ]
        assert ratios == pytest.approx(expected, rel=1e-4), schedule  # the drift moves a hair


def test_per_node_documents_hold_the_same_rows() -> None:
    spec = {"ranks": 20, "layers": 2, "step_time_s": 1.0, "steps": 3, "ranks_per_node": 8}
    whole = list(simulate(FleetSpec(**spec)))
    split = list(simulate(FleetSpec(**spec), per_node=True))
    assert len(split) == 1 + 3 * 3  # runs, then 3 nodes (8 + 8 + 4 ranks) per step
    assert [len(d["ranks"]["rank"]) for d in split[1:4]] == [8, 8, 4]
    assert "steps" in split[1] and "steps" not in split[2]
    assert _column(split, "ranks", "loss") == _column(whole, "ranks", "loss")


def test_merged_documents_keep_rows_and_nulls() -> None:
    docs = _docs(canary_every=10)[1:4]  # steps 0 (a canary step), 1 and 2
    merged = merge(docs)
    _, tables = to_arrow(merged)
    assert tables["ranks"].num_rows == 48
    assert tables["ranks"].column("canary_fingerprint").null_count == 32
    assert points(merged) == sum(points(d) for d in docs)


@pytest.mark.slow
def test_cli_writes_json_lines_and_refuses_bad_faults(tmp_path) -> None:
    out = tmp_path / "sim.jsonl"
    argv = [sys.executable, "-m", "trainvitals", "simulate", "--ranks", "8", "--layers", "2"]
    ok = subprocess.run(
        [*argv, "--step-time", "0.1", "--steps", "5", "--out", str(out), "--fault", "nan:step=2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ok.returncode == 0, ok.stderr
    lines = out.read_bytes().splitlines()
    assert len(lines) == 6 and b'"loss":["NaN"]' in lines[3]
    bad = subprocess.run(
        [*argv, "--step-time", "0.1", "--out", str(out), "--fault", "nan:when=2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode != 0 and "unexpected 'when=2'" in bad.stderr


def test_the_largest_fault_values_allowed_simulate_finite_telemetry() -> None:
    faults = (
        "stall:step=3,seconds=604800",
        "spike:step=5,factor=1000",
        "sdc:rank=1,step=6,grad_factor=1e6",
    )
    docs = _docs(faults=faults)
    times = _column(docs, "steps", "time_unix_s")
    assert times[4] - times[2] > 604800 and np.isfinite(_column(docs, "steps", "grad_norm")).all()


def _seconds_per_step(docs: list[dict]) -> float:
    """Wall time (goodput.py's: from the start of the first logged step to the end of the
    last) over the steps it spans."""
    steps, times = _column(docs, "steps", "step"), _column(docs, "steps", "time_unix_s")
    wall = times[-1] - (times[0] - _column(docs, "steps", "step_time_s")[0])
    return wall / (steps[-1] - steps[0] + 1)


def test_steps_that_are_not_logged_take_the_time_a_logged_step_takes() -> None:
    """With a straggler, every step is slower, logged or not: the time per step does not
    depend on log_every (before, unlogged steps took the nominal step time)."""
    kw = {"steps": 200, "faults": ("straggler:rank=3,step=0,slowdown=0.5",)}
    every, tenth = _docs(**kw), _docs(log_every=10, **kw)
    step_time = float(np.median(_column(every, "steps", "step_time_s")))
    assert step_time == pytest.approx(0.5 * (0.01 + 0.85 * 1.5 + 0.14), rel=0.02)
    assert _seconds_per_step(every) == pytest.approx(step_time, rel=0.01)
    assert _seconds_per_step(tenth) == pytest.approx(step_time, rel=0.01)
    clean = _docs(steps=200, log_every=10)  # unlogged steps: the noise of logged ones
    median = float(np.median(_column(clean, "steps", "step_time_s")))
    assert _seconds_per_step(clean) == pytest.approx(median, rel=0.01)
    throttled = _docs(log_every=10, steps=200, faults=("throttle:rank=2,step=0,clock_drop=0.5",))
    assert _seconds_per_step(throttled) > 1.5 * _seconds_per_step(clean)


def test_a_nan_on_a_step_that_is_not_logged_shows_on_the_next_logged_one() -> None:
    """As the hooks report it: steps.nonfinite_steps, layers.act_nonfinite_steps and a NaN
    act_max_abs on the layers it reached, at the next logged step (15 -> 20)."""
    docs = _docs(steps=40, log_every=10, canary_every=10, faults=("nan:step=15",))
    by_step = {d["steps"]["step"][0]: d for d in docs if "steps" in d}
    assert [by_step[s]["steps"]["nonfinite_steps"][0] for s in (0, 10, 20, 30)] == [0, 0, 1, 0]
    at_20 = by_step[20]["layers"]
    assert at_20["act_nonfinite_steps"].tolist() == [0, 0, 1, 1]
    assert np.isnan(at_20["act_max_abs"][2:]).all() and np.isfinite(at_20["act_max_abs"][:2]).all()
    assert math.isfinite(by_step[20]["steps"]["loss"][0])  # the loop went on past it
    for s in (10, 30):
        assert np.isfinite(by_step[s]["layers"]["act_max_abs"]).all()
        assert by_step[s]["layers"]["act_nonfinite_steps"].tolist() == [0, 0, 0, 0]
    _, tables = to_arrow(by_step[20])  # the schema takes it
    assert tables["steps"].column("nonfinite_steps").to_pylist() == [1]


def test_a_nan_on_a_logged_step_counts_that_step_too() -> None:
    (doc,) = [
        d for d in _docs(faults=("nan:step=5",)) if "steps" in d and d["steps"]["step"][0] == 5
    ]
    assert doc["steps"]["nonfinite_steps"].tolist() == [1]
    assert doc["layers"]["act_nonfinite_steps"].tolist() == [0, 0, 1, 1]
    assert (
        doc["layers"]["act_nonfinite_count"][2:].min() > 0
        and np.isnan(doc["layers"]["act_rms"][2:]).all()
    )
    assert (
        doc["steps"]["nonfinite_count"][0]
        == doc["layers"]["nonfinite_count"].sum() + doc["layers"]["act_nonfinite_count"].sum()
    )
