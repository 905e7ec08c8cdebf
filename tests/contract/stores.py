"""The stores every contract test runs against. A new store joins by adding one entry here
(and, when it has a transactional mode, a ledger for its connections)."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import oncely
from oncely import FakeClock

# name -> (sync factory, async factory); each factory gets a fresh directory and the clock.
SyncFactory = Callable[[Path, FakeClock], oncely.Store]
AsyncFactory = Callable[[Path, FakeClock], oncely.AsyncStore]

STORES: dict[str, tuple[SyncFactory, AsyncFactory]] = {
    "memory": (
        lambda tmp, clock: oncely.MemoryStore(clock=clock),
        lambda tmp, clock: oncely.AsyncMemoryStore(clock=clock),
    ),
    "sqlite": (
        lambda tmp, clock: oncely.SQLiteStore(tmp / "oncely.db", clock=clock),
        lambda tmp, clock: oncely.AsyncSQLiteStore(tmp / "oncely.db", clock=clock),
    ),
}


class SQLiteLedger:
    """Business writes for SQLite: a ledger without unique keys in the store's own file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with sqlite3.connect(path) as conn:
            conn.execute("CREATE TABLE IF NOT EXISTS ledger (key TEXT NOT NULL, amount INT)")

    def count(self, key: str) -> int:
        with sqlite3.connect(self.path) as conn:
            return int(
                conn.execute("SELECT count(*) FROM ledger WHERE key = ?", (key,)).fetchone()[0]
            )


class SyncSQLiteLedger(SQLiteLedger):
    def write(self, tx: Any, key: str, amount: int) -> None:
        tx.execute("INSERT INTO ledger (key, amount) VALUES (?, ?)", (key, amount))


class AsyncSQLiteLedger(SQLiteLedger):
    async def write(self, tx: Any, key: str, amount: int) -> None:
        await tx.execute("INSERT INTO ledger (key, amount) VALUES (?, ?)", (key, amount))

    async def count(self, key: str) -> int:  # type: ignore[override]
        return super().count(key)


LEDGERS: dict[str, tuple[type[SyncSQLiteLedger], type[AsyncSQLiteLedger]] | None] = {
    "memory": None,
    "sqlite": (SyncSQLiteLedger, AsyncSQLiteLedger),
}
