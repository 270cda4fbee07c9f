"""The store's read-only side: what `collector --replay` accepts."""

from __future__ import annotations

import pytest

from trainvitals.cli import main
from trainvitals.collector.store import Store, StoreError


@pytest.mark.parametrize("content", [None, "readme.txt"])
def test_replay_refuses_a_folder_that_is_not_an_export(tmp_path, monkeypatch, content) -> None:
    import uvicorn

    def serve(*_args, **_kwargs) -> None:  # a regression fails here rather than serving
        raise AssertionError("the collector started serving the folder")

    monkeypatch.setattr(uvicorn, "run", serve)
    if content:
        (tmp_path / content).write_text("not telemetry")
    with pytest.raises(StoreError, match="is not a trainvitals export: no table folder"):
        Store(str(tmp_path), read_only=True)
    with pytest.raises(SystemExit) as stopped:  # the command says so, and serves nothing
        main(["collector", "--replay", str(tmp_path), "--port", "1"])
    message = str(stopped.value.code)
    assert message == (
        f"error: {tmp_path} is not a trainvitals export: no table folder (runs, steps, "
        "layers, ranks, events, alerts, heartbeats); `trainvitals export STORE OUT` writes "
        "OUT/<table>/run_id=<id>/*.parquet. To serve a store, name its DuckDB file"
    )


def test_a_group_of_small_batches_is_inserted_as_one_chunk() -> None:
    """DuckDB scans an Arrow table chunk by chunk (about 80 us each): a group commit of
    3,000 one-run batches of an OTLP request took 251 ms to insert, 4.4 ms in one chunk."""
    import pyarrow as pa

    from trainvitals.collector.store import _merged

    small = [{"steps": pa.table({"step": [i, i + 1]})} for i in range(0, 512, 2)]
    merged = _merged(small)["steps"]
    assert merged.column("step").num_chunks == 1
    assert merged.column("step").to_pylist() == list(range(512))
    large = [{"steps": pa.table({"step": list(range(i, i + 4096))})} for i in (0, 4096)]
    assert _merged(large)["steps"].column("step").num_chunks == 2  # not copied


class _Listener:
    """A commit listener that notes what the store tells it, and whether its store's
    connection was still open when it was closed."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.calls: list[tuple] = []

    def committed(self, run_id, tables) -> None:
        self.calls.append(("committed", run_id, tables["steps"].column("step").to_pylist()))

    def forget(self, run_ids) -> None:
        self.calls.append(("forget", run_ids))

    def drain(self, timeout_s) -> bool:
        self.calls.append(("drain",))
        return True

    def close(self, timeout_s) -> None:
        self.store.query("SELECT 1")  # fails once the connection is closed
        self.calls.append(("close",))


def test_commit_listeners_hear_the_rows_each_commit_added_then_flush_retention_and_close(
    tmp_path,
) -> None:
    from trainvitals.schema import to_arrow

    from .conftest import make_batch

    store = Store(str(tmp_path / "s.duckdb"), retention_days=1)
    listener = _Listener(store)
    store.listen(listener)
    store.start()
    for steps in (range(3), range(2, 5)):  # the second resends steps 2: not passed on
        store.submit(*to_arrow(make_batch(steps=steps).to_dict())).result(timeout=60)
    store.flush()
    assert store.drop_expired() == ["r1"]  # its steps' times are from 1970
    store.close()
    assert listener.calls == [
        ("committed", "r1", [0, 1, 2]),
        ("committed", "r1", [3, 4]),
        ("drain",),
        ("forget", ["r1"]),
        ("close",),
    ]
