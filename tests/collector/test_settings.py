"""Collector settings, as the command line reports a bad one."""

from __future__ import annotations

import pytest

from trainvitals.cli import main


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("nan", "error: --retention-days: Input should be a finite number"),
        ("inf", "error: --retention-days: Input should be a finite number"),
        ("-1", "error: --retention-days: Input should be greater than or equal to 0"),
    ],
)
def test_retention_days_must_be_a_finite_number(tmp_path, value, message) -> None:
    store = tmp_path / "s.duckdb"
    with pytest.raises(SystemExit) as stopped:
        main(["collector", "--store", str(store), "--retention-days", value])
    assert stopped.value.code == message
    assert not store.exists()  # refused before anything was created
