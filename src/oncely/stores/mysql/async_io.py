"""Hand-written: aiomysql calls and the connection pool (twin: ``sync_io.py``).

aiomysql mirrors PyMySQL (``await conn.cursor()``, ``await cursor.execute()``) and raises
PyMySQL's exceptions; what differs is here: how a connection is opened, how an idle one is
seen to be dead (its stream reader is at end of file), and a pool that waits on an asyncio
semaphore.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeAlias

import aiomysql  # type: ignore[import-untyped]
from pymysql.converters import escape_bytes  # type: ignore[import-untyped]

from oncely.stores.mysql.errors import MySQLSettings

__all__ = ["AsyncPool", "Connection", "close", "connect", "execute", "fetchall", "sleep"]

Connection: TypeAlias = Any
"""An ``aiomysql.Connection`` (aiomysql ships no type information)."""


async def connect(settings: MySQLSettings) -> Connection:
    return await aiomysql.connect(db=settings.database, **settings.connect_kwargs())


class _Cursor(aiomysql.Cursor):  # type: ignore[misc]
    """aiomysql's cursor without its reaction to server warnings: a ``SHOW WARNINGS`` round
    trip and a Python ``Warning`` per note (PyMySQL's cursor does neither). oncely's only
    expected notes are "table already exists" from ``CREATE TABLE IF NOT EXISTS``; its
    sessions are strict, so what would truncate data is an error, not a warning."""

    async def _show_warnings(self, conn: Connection) -> None:
        return None


def _query(conn: Connection, sql: str, params: Mapping[str, object] | None) -> str:
    # aiomysql 0.3 escapes bytes with a PyMySQL helper that PyMySQL 1.2 replaced by a
    # placeholder string ("TypeError: 'str' object is not callable"), so the statement is
    # formatted here, bytes as PyMySQL 1.2 writes them (_binary X'..'), anything else by the
    # connection (which honours NO_BACKSLASH_ESCAPES).
    if params is None:
        return sql
    return sql % {
        name: escape_bytes(value) if isinstance(value, bytes) else conn.escape(value)
        for name, value in params.items()
    }


async def execute(
    conn: Connection, sql: str, params: Mapping[str, object] | None = None
) -> tuple[int, int]:
    """Run one statement; its affected (with ``CLIENT_FOUND_ROWS``: matched) row count and
    the insert id of its OK packet."""
    cursor = await conn.cursor(_Cursor)
    try:
        affected = await cursor.execute(_query(conn, sql, params))
        return int(affected), int(cursor.lastrowid or 0)
    finally:
        await cursor.close()


async def fetchall(
    conn: Connection, sql: str, params: Mapping[str, object] | None = None
) -> list[Any]:
    """Run one statement and return its rows."""
    cursor = await conn.cursor(_Cursor)
    try:
        await cursor.execute(_query(conn, sql, params))
        return list(await cursor.fetchall())
    finally:
        await cursor.close()


async def close(conn: Connection) -> None:
    """Say goodbye to a live server (it would log an aborted connection otherwise), then
    drop the transport."""
    with contextlib.suppress(Exception):
        if alive(conn):
            await conn.ensure_closed()
    with contextlib.suppress(Exception):
        conn.close()


def alive(conn: Connection) -> bool:
    """False when an idle connection was closed by the server: the event loop has already
    fed its stream reader the end of file (or a goodbye packet)."""
    if conn.closed:
        return False
    reader = getattr(conn, "_reader", None)
    writer = getattr(conn, "_writer", None)
    if reader is None or writer is None or writer.transport.is_closing():
        return False
    return not reader.at_eof() and reader.exception() is None and not len(reader._buffer)


async def sleep(seconds: float) -> None:
    await asyncio.sleep(seconds)


class AsyncPool:
    """At most ``size`` connections in use at once; idle ones are reused, newest first.

    After a fork the child starts with an empty pool: a connection's socket must never be
    shared by two processes.
    """

    __slots__ = ("_closed", "_connect", "_idle", "_pid", "_size", "_slots")

    def __init__(self, connect: Callable[[], Awaitable[Connection]], size: int) -> None:
        self._connect = connect
        self._size = size
        self._idle: list[Connection] = []
        self._slots: asyncio.Semaphore | None = None
        self._pid = os.getpid()
        self._closed = False

    async def acquire(self) -> Connection:
        if self._pid != os.getpid():
            self._idle, self._slots, self._pid = [], None, os.getpid()
        if self._slots is None:
            self._slots = asyncio.Semaphore(self._size)
        await self._slots.acquire()
        try:
            while self._idle:
                conn = self._idle.pop()
                if alive(conn):
                    return conn
                await close(conn)
            return await self._connect()
        except BaseException:
            self._slots.release()
            raise

    async def release(self, conn: Connection, *, discard: bool = False) -> None:
        try:
            if discard or self._closed:
                await close(conn)
            else:
                self._idle.append(conn)
        finally:
            if self._slots is not None:
                self._slots.release()

    async def close(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            await close(conn)
