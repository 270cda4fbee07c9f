from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from trainvitals.collector.main import create_app
from trainvitals.collector.settings import Settings
from trainvitals.schema import BatchBuilder


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(store_path=str(tmp_path / "store.duckdb"), max_body_bytes=1024 * 1024)


@pytest.fixture
def client(settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(settings)) as c:
        yield c


def make_batch(
    run_id: str = "r1",
    steps: range = range(3),
    n_layers: int = 2,
    world: int = 2,
    losses: list[float] | None = None,
) -> BatchBuilder:
    """A small but complete batch, as the hooks would send it."""
    b = BatchBuilder(run_id)
    for i, step in enumerate(steps):
        loss = losses[i] if losses else 3.0 - 0.01 * step
        b.append(
            "steps",
            step=step,
            time_unix_s=1000.0 + step,
            loss=loss,
            grad_norm=1.0,
            lr=1e-3,
            tokens=512,
            step_time_s=0.5,
            tokens_per_s=1024.0,
            tflops_per_s_per_device=0.1,
            mfu_ratio=0.25,
        )
        for layer in range(n_layers):
            b.append("layers", step=step, layer=layer, grad_norm=0.5 + layer, act_rms=1.0)
        for rank in range(world):
            b.append(
                "ranks",
                step=step,
                rank=rank,
                step_time_s=0.4 + 0.1 * rank,
                tokens_per_s=256.0,
                loss=loss,
            )
    return b


def counts(client: TestClient, run_id: str = "r1") -> dict[str, int]:
    """Rows stored for `run_id`, per table, once the writer has caught up."""
    store = client.app.state.store
    store.flush()
    return {
        t: store.query(f"SELECT count(*) FROM {t} WHERE run_id = ?", [run_id]).column(0)[0].as_py()
        for t in ("steps", "layers", "ranks")
    }
