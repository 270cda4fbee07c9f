"""`trainvitals analyze FILE`: what a scalar export may hold, and the error when it cannot."""

from __future__ import annotations

import math
import random
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from trainvitals.analyzer.offline import analyze_file


def _csv(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_dates_and_times_read_as_seconds_since_the_epoch(tmp_path: Path) -> None:
    path = _csv(
        tmp_path / "iso.csv",
        "step,loss,timestamp\n0,2.0,2024-01-01T00:00:00\n1,NaN,2024-01-01T00:00:10\n",
    )
    (alert,) = analyze_file(path)
    assert (alert.kind, alert.step, alert.time_unix_s) == ("nonfinite", 1, 1704067210.0)


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ("step,loss\n1,2.0\n2,abc\n", "column 'loss' (for loss) must hold numbers (float64): "
         "Failed to parse string: 'abc'"),
        ("step,loss\n1.5,2.0\n", "column 'step' (for step) must hold whole numbers (int64)"),
        ("step,loss,timestamp\n0,2.0,soon\n", "column 'timestamp' (for time_unix_s) must hold "
         "seconds since the epoch (float64) or dates and times: Failed to parse string: 'soon'"),
        ("step,loss\n0,2.0\n1,2.0\n1,2.1\n", "column 'step' (for step) repeats step 1; keep "
         "one row per step"),
        ("_step,train/loss\n3,2.0\n-2,2.0\n", "column '_step' (for step) holds -2; steps must "
         "be in [0, 2**53)"),
        ("", "cannot read it: Empty CSV file"),
    ],
)  # fmt: skip
def test_values_that_cannot_be_analysed_name_the_file_and_column(
    tmp_path: Path, rows: str, message: str
) -> None:
    path = _csv(tmp_path / "export.csv", rows)
    with pytest.raises(ValueError) as e:
        analyze_file(path)
    assert str(e.value).startswith(f"{path}: {message}")


@pytest.mark.slow
def test_a_column_of_the_wrong_type_gets_one_line_not_a_traceback(tmp_path: Path) -> None:
    path = tmp_path / "lists.parquet"
    pq.write_table(pa.table({"step": [1, 2], "loss": [[1.0], [2.0]]}), path)
    r = subprocess.run(
        [sys.executable, "-m", "trainvitals", "analyze", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr == (
        f"error: {path}: column 'loss' (for loss) must hold numbers (float64): "
        "it holds list<element: double>\n"
    )


def test_an_exact_column_name_wins_over_one_that_differs_in_case(tmp_path: Path) -> None:
    path = tmp_path / "two.parquet"
    losses = {"loss": [2.0, float("nan")], "Loss": [2.0, 2.0]}
    pq.write_table(pa.table({"step": [0, 1], **losses}), path)
    assert [(a.kind, a.step) for a in analyze_file(path)] == [("nonfinite", 1)]


def _export(path: Path, columns: dict[str, list]) -> Path:
    pq.write_table(pa.table(columns), path)
    return path


def _noisy_loss(n: int, seed: int, noise: float) -> list[float]:
    rng = random.Random(seed)
    return [(2.5 + 2 * math.exp(-s / 150)) * math.exp(rng.gauss(0, noise)) for s in range(n)]


def test_analyze_uses_a_grad_norm_column_as_second_signal(tmp_path: Path) -> None:
    # A +15% one-step spike at 3% noise is a spike only with the gradient norm's 3x jump.
    loss = _noisy_loss(600, 1, 0.03)
    loss[400] *= 1.15
    grad = [1.0 + 0.05 * ((s * 7919) % 11 - 5) / 5 for s in range(600)]  # +-5%, no jump
    grad[400] = 3.0
    lr = [1e-3] * 600
    with_grad = {"_step": list(range(600)), "train/loss": loss, "train/grad_norm": grad}
    path = _export(tmp_path / "wandb.parquet", {**with_grad, "learning_rate": lr})
    assert [(a.kind, a.step) for a in analyze_file(path)] == [("loss_spike", 400)]
    alone = _export(tmp_path / "loss.parquet", {"_step": list(range(600)), "train/loss": loss})
    assert analyze_file(alone) == []


def test_analyze_takes_a_dynamic_loss_scalers_overflows_for_skipped_steps(tmp_path: Path) -> None:
    # An fp16 run's log: the gradient norm is inf on the steps the GradScaler skipped.
    grad = [1.0] * 600
    for step in (5, 6, 7, 150, 320, 321, 480):
        grad[step] = math.inf
    path = _export(tmp_path / "fp16.parquet", {"step": list(range(600)),
                                                "loss": _noisy_loss(600, 2, 0.01),
                                                "grad_norm": grad})  # fmt: skip
    assert {a.kind for a in analyze_file(path)} == {"nonfinite"}
    assert analyze_file(path, loss_scaling="dynamic") == []
    cli = [sys.executable, "-m", "trainvitals", "analyze", str(path), "--loss-scaling", "dynamic"]
    done = subprocess.run(cli, capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout) == (0, ""), done.stderr


def test_analyze_reads_lr_and_tells_a_warm_restart_from_a_divergence(tmp_path: Path) -> None:
    # The loss rises 30% when the learning rate goes back to its earlier peak (a warm
    # restart, not a fault); from the lr column, analyze knows.
    n = 1200
    lr = [1e-3 if s < 600 else 2e-4 for s in range(n)]
    lr[900:] = [1e-3] * (n - 900)
    loss = _noisy_loss(n, 2, 0.01)
    loss[900:] = [x * 1.3 for x in loss[900:]]
    steps = {"step": list(range(n)), "loss": loss}
    restart = _export(tmp_path / "restart.parquet", {**steps, "lr": lr})
    assert analyze_file(restart) == []
    no_lr = _export(tmp_path / "no_lr.parquet", steps)
    assert "loss_diverging" in {a.kind for a in analyze_file(no_lr)}


def test_analyze_flags_a_loss_climbing_from_3_to_40(tmp_path: Path) -> None:
    # The curve: no jump, the loss climbs to 40 over 300 steps, grad norm 100x.
    n, onset = 900, 500
    loss = _noisy_loss(n, 3, 0.02)
    frac = [min(1.0, max(0, s - onset) / 300) for s in range(n)]
    loss = [x * (40 / 2.5) ** f for x, f in zip(loss, frac, strict=True)]
    grad = [math.exp(math.log(100) * f) for f in frac]
    path = _export(
        tmp_path / "climb.parquet", {"step": list(range(n)), "loss": loss, "grad_norm": grad}
    )
    (alert,) = [a for a in analyze_file(path) if a.kind == "loss_diverging"]
    assert onset <= alert.start_step and alert.step - onset <= 50
    assert "Data:" not in alert.message  # a file has no collector to query


@pytest.mark.slow
def test_analyze_takes_grad_norm_and_lr_columns_by_name(tmp_path: Path) -> None:
    loss = _noisy_loss(600, 1, 0.03)
    loss[400] *= 1.15
    gn = [1.0] * 600
    gn[400] = 3.0
    columns = {"it": list(range(600)), "objective": loss, "gn": gn, "rate": [1e-3] * 600}
    path = _export(tmp_path / "odd_names.parquet", columns)
    flags = ["--step-column", "it", "--loss-column", "objective"]
    named = [*flags, "--grad-norm-column", "gn", "--lr-column", "rate"]
    runs = {
        tuple(extra): subprocess.run(
            [sys.executable, "-m", "trainvitals", "analyze", str(path), *extra],
            capture_output=True,
            text=True,
            timeout=120,
        )
        for extra in (flags, named)
    }
    assert [r.returncode for r in runs.values()] == [0, 0], [r.stderr for r in runs.values()]
    assert runs[tuple(flags)].stdout == ""  # +15% alone is no spike
    (line,) = runs[tuple(named)].stdout.splitlines()
    assert '"kind":"loss_spike"' in line and '"step":400' in line
