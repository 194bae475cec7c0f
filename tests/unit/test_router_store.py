"""The url output folder stays bounded: files past the age or past the count go, oldest first."""

from __future__ import annotations

import os
import time
from pathlib import Path

from dpserve.router.store import OutputStore, expired


def test_expired_takes_the_old_then_the_oldest_past_the_count() -> None:
    files = [("a", 100.0), ("b", 300.0), ("c", 200.0), ("d", 400.0), ("old", 1.0)]
    assert expired(files, now=450.0, max_files=2, max_age_s=400.0) == ["old", "a", "c"]
    assert expired(files, now=450.0, max_files=10, max_age_s=1000.0) == []
    assert expired(files, now=450.0, max_files=10, max_age_s=100.0) == ["old", "a", "c", "b"]


def _save(store: OutputStore, mtime: float) -> str:
    name = store.save(b"\x89PNG", "png").rsplit("/", 1)[1]
    os.utime(store.root / name, (mtime, mtime))
    return name


def test_saving_keeps_the_newest_max_files(tmp_path: Path) -> None:
    store = OutputStore(tmp_path / "out", "http://r:8000", max_files=3, max_age_s=3600)
    now = time.time()
    names = [_save(store, now - 100 + i) for i in range(6)]
    # Each save prunes before it returns; the last one pruned to 3 and then was aged.
    assert sorted(os.listdir(tmp_path / "out")) == sorted(names[3:])
    assert store.path(names[0]) is None and store.path(names[5]) is not None


def test_old_files_are_neither_served_nor_kept(tmp_path: Path) -> None:
    store = OutputStore(tmp_path, "http://r:8000", max_files=100, max_age_s=60)
    now = time.time()
    old = _save(store, now - 120)
    young = _save(store, now - 10)
    assert store.path(old) is None  # past its age: not served even before it is removed
    (tmp_path / "notes.txt").write_text("not ours")  # files it did not make are left alone
    _save(store, now)
    assert old not in os.listdir(tmp_path) and young in os.listdir(tmp_path)
    assert (tmp_path / "notes.txt").exists()
    assert store.path("../notes.txt") is None
