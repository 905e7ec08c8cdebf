from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import oncely

from . import Backend, Scope


def _path(scope: Scope) -> Path:
    return scope.tmp_path / "oncely.db"


class SQLiteLedger:
    """A ledger without unique keys in the store's own file: a double application shows."""

    def __init__(self, scope: Scope, store: object) -> None:
        self.path = _path(scope)
        with sqlite3.connect(self.path) as conn:
            conn.execute("CREATE TABLE IF NOT EXISTS ledger (key TEXT NOT NULL, amount INT)")

    def count(self, key: str) -> int:
        with sqlite3.connect(self.path) as conn:
            row = conn.execute("SELECT count(*) FROM ledger WHERE key = ?", (key,)).fetchone()
        return int(row[0])


class SyncSQLiteLedger(SQLiteLedger):
    def write(self, tx: Any, key: str, amount: int) -> None:
        tx.execute("INSERT INTO ledger (key, amount) VALUES (?, ?)", (key, amount))


class AsyncSQLiteLedger(SQLiteLedger):
    async def write(self, tx: Any, key: str, amount: int) -> None:
        await tx.execute("INSERT INTO ledger (key, amount) VALUES (?, ?)", (key, amount))

    async def count(self, key: str) -> int:  # type: ignore[override]
        return super().count(key)


BACKEND = Backend(
    name="sqlite",
    make_sync=lambda scope, clock: oncely.SQLiteStore(_path(scope), clock=clock),
    make_async=lambda scope, clock: oncely.AsyncSQLiteStore(_path(scope), clock=clock),
    sync_ledger=SyncSQLiteLedger,
    async_ledger=AsyncSQLiteLedger,
)
