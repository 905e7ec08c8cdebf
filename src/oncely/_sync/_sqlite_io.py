"""Hand-written: sqlite3 calls whose shape differs from aiosqlite's (twin: ``_async``)."""

from __future__ import annotations

import sqlite3
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["close", "connect", "fetchall"]

Params = Mapping[str, object] | Sequence[object]


def connect(path: str, *, timeout: float, uri: bool) -> sqlite3.Connection:
    return sqlite3.connect(
        path, isolation_level=None, timeout=timeout, check_same_thread=False, uri=uri
    )


def fetchall(conn: sqlite3.Connection, sql: str, params: Params = ()) -> list[Any]:
    """Run one statement and return its rows."""
    cursor = conn.execute(sql, params)
    try:
        return cursor.fetchall()
    finally:
        cursor.close()


def close(conn: sqlite3.Connection) -> None:
    conn.close()
