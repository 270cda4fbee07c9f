"""The spool never gives a number twice: a batch set aside, or spooled by another process
into the same folder, is never replaced."""

from __future__ import annotations

from trainvitals.hooks.spool import Spool


def test_a_set_aside_batch_keeps_its_number(tmp_path) -> None:
    """The numbering counted `N.json` only: after the last pending batch was set aside, a
    new spool (the next run) reused its number and the next set-aside replaced it."""
    spool = Spool(tmp_path)
    spool.put(b"first")
    aside = spool.set_aside(spool.pending()[0])
    later = Spool(tmp_path)  # a restart of the training run
    later.put(b"second")
    assert later.pending()[0].name != aside.name.replace(".failed", "")
    later.set_aside(later.pending()[0])
    assert sorted(p.read_bytes() for p in tmp_path.iterdir()) == [b"first", b"second"]


def test_two_spools_in_one_folder_never_replace_each_other(tmp_path) -> None:
    a, b = Spool(tmp_path), Spool(tmp_path)  # both start at number 0
    a.put(b"from a")
    b.put(b"from b")
    a.put(b"from a again")
    assert sorted(p.read_bytes() for p in tmp_path.glob("*.json")) == [
        b"from a",
        b"from a again",
        b"from b",
    ]
    assert not list(tmp_path.glob("*.tmp"))
