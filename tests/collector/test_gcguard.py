"""The garbage collector guard (collector/gcguard.py): full collections walk only what
gathered since the last freeze, cycles are reclaimed before anything is frozen, and the
collector gives CPython its own collection back when it stops."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from trainvitals.collector.gcguard import GcGuard
from trainvitals.collector.main import create_app
from trainvitals.collector.settings import Settings


class _Node:
    """A container the collector tracks; `me` makes a reference cycle."""

    me: _Node | None = None


def _garbage_cycle_in_generation_2() -> weakref.ref:
    """A reference cycle that reached generation 2 alive, then died: only a full
    collection reclaims it. Returns a weak reference to it."""
    node = _Node()
    node.me = node
    gc.collect(1)  # survivors of generation 1 move to generation 2
    ref = weakref.ref(node)
    del node
    return ref


@pytest.fixture
def clock() -> list[float]:
    return [0.0]


@pytest.fixture
def guard(clock: list[float]) -> Iterator[GcGuard]:
    g = GcGuard(max_objects=1000, full_every_s=60.0, clock=lambda: clock[0])
    try:
        g.take_over()
        yield g
    finally:
        g.close()


def test_taking_over_freezes_what_lives_and_closing_gives_collection_back() -> None:
    before = gc.get_threshold()
    guard = GcGuard()
    try:
        guard.take_over()
        assert gc.get_threshold()[:2] == before[:2]  # the young generations as usual
        assert gc.get_threshold()[2] > 1_000_000  # automatic full collections off
        assert gc.get_freeze_count() > 0
    finally:
        guard.close()
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0


def test_two_guards_give_collection_back_when_the_last_one_closes() -> None:
    """Tests run two collectors in one process, and close them in any order."""
    before = gc.get_threshold()
    first, second = GcGuard(), GcGuard()
    try:
        first.take_over()
        second.take_over()
        first.close()
        assert gc.get_threshold()[2] > 1_000_000  # the second still guards
    finally:
        first.close()
        second.close()
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0


def test_past_the_limit_cycles_are_reclaimed_then_the_rest_frozen(guard: GcGuard) -> None:
    frozen = gc.get_freeze_count()
    kept = [[i] for i in range(5000)]  # long-lived state: 5,000 tracked lists
    dead = _garbage_cycle_in_generation_2()
    assert dead() is not None  # automatic full collections are off
    assert guard.check()
    assert dead() is None  # collected before the freeze, not frozen alive
    assert guard.freezes == 1
    assert gc.get_freeze_count() >= frozen + len(kept)
    assert not any(x is kept for x in gc.get_objects(generation=2))  # never walked again


def test_below_the_limit_generation_2_is_collected_every_full_every_s(
    clock: list[float],
) -> None:
    guard = GcGuard(max_objects=10**9, full_every_s=60.0, clock=lambda: clock[0])
    try:
        guard.take_over()
        dead = _garbage_cycle_in_generation_2()
        assert not guard.check()  # under the limit and not due: nothing walked
        assert dead() is not None
        clock[0] = 60.0
        assert guard.check()
        assert dead() is None
        assert guard.freezes == 0  # collected, nothing frozen under the limit
    finally:
        guard.close()


def _frozen_objects(client: TestClient) -> float:
    line = next(
        x
        for x in client.get("/metrics").text.splitlines()
        if x.startswith("trainvitals_collector_gc_frozen_objects ")
    )
    return float(line.split()[-1])


def test_the_collector_runs_the_guard_and_can_leave_it_off(tmp_path) -> None:
    before = gc.get_threshold()
    on = Settings(store_path=str(tmp_path / "on.duckdb"))
    with TestClient(create_app(on)) as client:
        assert client.get("/healthz").status_code == 200
        assert gc.get_threshold()[2] > 1_000_000
        assert _frozen_objects(client) > 0  # in /metrics
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0
    off = Settings(store_path=str(tmp_path / "off.duckdb"), gc_max_objects=0)
    with TestClient(create_app(off)) as client:
        assert client.get("/healthz").status_code == 200
        assert gc.get_threshold() == before
        assert _frozen_objects(client) == 0
