"""Hand-written: aiosqlite calls whose shape differs from sqlite3's (twin: ``_sync``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import aiosqlite

__all__ = ["close", "connect", "fetchall"]

Params = Mapping[str, object] | Sequence[object]


async def connect(path: str, *, timeout: float, uri: bool) -> aiosqlite.Connection:
    return await aiosqlite.connect(
        path, isolation_level=None, timeout=timeout, check_same_thread=False, uri=uri
    )


async def fetchall(conn: aiosqlite.Connection, sql: str, params: Params = ()) -> list[Any]:
    """Run one statement and return its rows (one hop to the connection's thread)."""
    return list(await conn.execute_fetchall(sql, params))


async def close(conn: aiosqlite.Connection) -> None:
    await conn.close()
