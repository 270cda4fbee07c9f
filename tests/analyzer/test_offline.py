"""`trainvitals analyze FILE`: what a scalar export may hold, and the error when it cannot."""

from __future__ import annotations

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
