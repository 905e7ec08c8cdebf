"""The largest result SQLite keeps (R1, R10): a blob, and a row, are bounded by the library's
length limit (SQLITE_MAX_LENGTH, 1e9 bytes by default). ``Limits(max_result_bytes=...)`` may be
set above it: a result over it is completed without it, as one over ``max_result_bytes`` is,
instead of a completion SQLite refuses ("string or blob too big") after the handler ran.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

import oncely
import oncely.stores.sqlite.sync_store as sync_module
from oncely import Outcome
from oncely.errors import ResultUnavailable


def test_r10_the_room_is_the_librarys_length_limit(tmp_path: Path) -> None:
    limit = sqlite3.connect(":memory:").getlimit(sqlite3.SQLITE_LIMIT_LENGTH)
    store = oncely.SQLiteStore(str(tmp_path / "inbox.db"))
    try:
        room, why = store.result_room()
        assert room == limit - 64 * 1024
        assert str(limit) in why
    finally:
        store.close()


def test_r10_a_result_over_the_room_is_not_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A library built with a smaller SQLITE_MAX_LENGTH (a 1 GB result is too much for a test).
    monkeypatch.setattr(sync_module, "_length_limit", lambda: 64 * 1024 + 1000)
    sync_module._result_room.cache_clear()
    store = oncely.SQLiteStore(str(tmp_path / "inbox.db"))
    try:
        inbox = oncely.Inbox(store, consumer="c", limits=oncely.Limits(max_result_bytes=10_000_000))
        runs: list[int] = []

        @inbox.idempotent(key=lambda n: "k")
        def work(n: int) -> str:
            runs.append(n)
            return "x" * n

        assert work(2000) == "x" * 2000
        with pytest.raises(ResultUnavailable, match="length limit"):
            work(2000)
        kept = inbox.handle("small", None, lambda p: "y" * 900)
        assert kept.outcome is Outcome.PROCESSED and kept.reason is None
        assert runs == [2000]
    finally:
        store.close()
        sync_module._result_room.cache_clear()  # the library's own limit again
