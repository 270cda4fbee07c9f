"""Collector settings, as the command line reports a bad one."""

from __future__ import annotations

import pytest

from trainvitals.cli import main
from trainvitals.collector.settings import Settings


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


def test_the_detectors_run_with_the_settings_of_file_env_and_flags(tmp_path, monkeypatch) -> None:
    from fastapi.testclient import TestClient

    from trainvitals.collector.main import create_app

    config = tmp_path / "analyzer.toml"
    config.write_text("[stall]\nmin_gap_s = 40\nmin_intervals = 5\n")
    monkeypatch.setenv("TRAINVITALS_ANALYZER__STALL__MIN_GAP_S", "30")
    settings = Settings(
        store_path=str(tmp_path / "s.duckdb"),
        analyzer_config=str(config),
        analyzer_set=["liveness.silence_s=4"],
    )
    with TestClient(create_app(settings)) as client:
        state = client.app.state
        stall = state.analysis.analyzer.config.stall
        assert (stall.min_gap_s, stall.min_intervals) == (30.0, 5.0)  # env over file
        assert state.watchdog.watchdog.settings.silence_s == 4.0
