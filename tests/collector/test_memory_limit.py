"""The store's DuckDB works within --memory-limit; a limit that is not a size is refused."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from trainvitals.collector.main import create_app
from trainvitals.collector.memory import memory_limit_bytes
from trainvitals.collector.settings import Settings
from trainvitals.collector.store import Store, StoreError

from .conftest import make_batch

_SETTING = "SELECT current_setting('memory_limit') AS v"


@pytest.mark.parametrize(
    ("text", "n_bytes"),
    [("2GB", 2 * 10**9), ("1.5GB", 15 * 10**8), ("512MiB", 512 * 2**20), (" 4 gb ", 4 * 10**9)],
)
def test_sizes_in_decimal_and_binary_units(text: str, n_bytes: int) -> None:
    assert memory_limit_bytes(text) == n_bytes


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("lots", "not a size such as 2GB"),
        ("2", "not a size"),
        ("80%", "not a size"),
        ("200MB", "under the minimum of 256MiB"),
    ],
)
def test_a_limit_that_is_not_a_workable_size_is_refused(tmp_path, text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        memory_limit_bytes(text)
    with pytest.raises(StoreError, match=message):
        Store(str(tmp_path / "s.duckdb"), memory_limit=text)
    assert not (tmp_path / "s.duckdb").exists()  # refused before the file is made
    with pytest.raises(ValidationError, match=message):
        Settings(store_path=str(tmp_path / "s.duckdb"), memory_limit=text)


@pytest.mark.slow
def test_the_cli_refuses_a_bad_limit_in_one_line(tmp_path) -> None:
    argv = ["collector", "--store", str(tmp_path / "s.duckdb"), "--memory-limit", "lots"]
    r = subprocess.run(
        [sys.executable, "-m", "trainvitals", *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0
    expected = (
        "error: --memory-limit: memory limit 'lots' is not a size such as 2GB, 1.5GB or 512MiB"
    )
    assert r.stderr.strip() == expected


def test_the_collector_ingests_and_answers_within_its_limit(tmp_path) -> None:
    settings = Settings(store_path=str(tmp_path / "s.duckdb"), memory_limit="256MiB")
    with TestClient(create_app(settings)) as client:
        store = client.app.state.store
        assert store.query(_SETTING).column("v")[0].as_py() == "256.0 MiB"
        assert client.post("/api/v1/ingest", content=make_batch().to_json()).status_code == 202
        # 1M rank rows, sent twice (the resend takes the costlier INSERT OR IGNORE path),
        # then a grouped query over them.
        n_rows, n_ranks = 1_000_000, 1000
        steps = np.arange(n_rows) // n_ranks + 10
        rows = pa.table(
            {
                "run_id": ["r1"] * n_rows,
                "step": steps,
                "rank": np.arange(n_rows) % n_ranks,
                "step_time_s": np.random.default_rng(0).random(n_rows),
                "tokens_per_s": np.full(n_rows, 256.0),
                "loss": np.full(n_rows, 2.5),
            }
        )
        for _ in range(2):
            store.submit("r1", {"ranks": rows}).result(timeout=120)
        per_rank = store.query(
            "SELECT rank, median(step_time_s) AS m FROM ranks WHERE run_id = 'r1' GROUP BY rank"
        )
        assert per_rank.num_rows == n_ranks
        assert store.query("SELECT count(*) AS n FROM ranks").column("n")[0].as_py() == n_rows + 6


def test_a_replayed_store_is_opened_with_the_limit(tmp_path) -> None:
    path = str(tmp_path / "s.duckdb")
    Store(path).close()
    replay = Store(path, read_only=True, memory_limit="1GiB")
    try:
        assert replay.query(_SETTING).column("v")[0].as_py() == "1.0 GiB"
    finally:
        replay.close()
