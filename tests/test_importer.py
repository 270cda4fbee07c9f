"""`trainvitals import` of spool directories: one rank's, or the folder of rank<k>/ above."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import duckdb
import pytest

from tests.collector.conftest import make_batch
from trainvitals.hooks.spool import Spool
from trainvitals.importer import spool_files


def _import(path: Path, collector_url: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "trainvitals", "import", str(path), "--collector", collector_url]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


def test_spool_files_go_rank_by_rank_each_rank_oldest_first(tmp_path: Path) -> None:
    for rank in (10, 2, 0):  # rank10 sorts after rank2: by number, not by name
        spool = Spool(tmp_path / f"rank{rank}")
        spool.put(b"{}")
        spool.put(b"{}")
    (tmp_path / "rank2" / "000000000002.tmp").write_bytes(b"{")  # half written: not sent
    names = [str(p.relative_to(tmp_path)) for p in spool_files(tmp_path)]
    assert names == [f"rank{k}/{i:012d}.json" for k in (0, 2, 10) for i in (0, 1)]
    assert spool_files(tmp_path / "rank2") == Spool(tmp_path / "rank2").pending()


def test_import_of_the_spool_folder_loads_every_rank(tmp_path: Path, collector) -> None:
    root = tmp_path / "spool"  # as $TRAINVITALS_SPOOL_DIR after a run lost its collector
    for rank, first in ((0, 0), (1, 3)):
        Spool(root / f"rank{rank}").put(make_batch(steps=range(first, first + 3)).to_json())
    r = _import(root, collector.url)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"2 batches stored, 0 rejected, from {root}" in r.stdout
    collector.stop()
    con = duckdb.connect(str(collector.store), read_only=True)
    steps = con.execute("SELECT step FROM steps WHERE run_id = 'r1' ORDER BY step").fetchall()
    con.close()
    assert [s for (s,) in steps] == list(range(6))


@pytest.mark.parametrize("layout", [[], ["rank0"], ["rank0", "rank1"]])
def test_import_of_an_empty_spool_says_there_is_nothing_to_import(
    tmp_path: Path, layout: list[str]
) -> None:
    root = tmp_path / "spool"
    root.mkdir()
    for name in layout:
        Spool(root / name)
    r = _import(root, "http://127.0.0.1:9")  # never contacted: nothing to send
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip() == f"nothing to import: {root} holds no spooled batches"
