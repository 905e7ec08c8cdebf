"""Hand-written: aiosqlite calls and the connection pool (twin: ``sync_io.py``).

The shapes differ from sqlite3's (``execute_fetchall`` is one hop to the connection's thread;
the pool waits on an asyncio semaphore), so both halves are written by hand and kept small. A
forked child empties every pool in a fork hook, so acquiring a connection does not ask the OS
for the process id.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import aiosqlite

from oncely._core.forking import forget_parent_in_children

__all__ = ["AsyncPool", "Params", "close", "connect", "execute", "fetchall"]

Params = Mapping[str, object] | Sequence[object]


async def connect(path: str, *, timeout: float, uri: bool) -> aiosqlite.Connection:
    pending = aiosqlite.connect(
        path, isolation_level=None, timeout=timeout, check_same_thread=False, uri=uri
    )
    # aiosqlite runs each connection on a non-daemon thread, so a store nobody closed would
    # keep the process from exiting. Dying mid-write is safe for SQLite (the WAL rolls the
    # transaction back), so the worker may be a daemon.
    worker = getattr(pending, "_thread", None)
    if isinstance(worker, threading.Thread) and not worker.is_alive():
        worker.daemon = True
    return await pending


async def fetchall(conn: aiosqlite.Connection, sql: str, params: Params = ()) -> list[Any]:
    """Run one statement and return its rows (one hop to the connection's thread)."""
    return list(await conn.execute_fetchall(sql, params))


async def execute(conn: aiosqlite.Connection, sql: str, params: Params = ()) -> None:
    """Run one statement whose rows do not matter."""
    await conn.execute_fetchall(sql, params)


async def close(conn: aiosqlite.Connection) -> None:
    with contextlib.suppress(sqlite3.Error, ValueError):
        await conn.close()


class AsyncPool:
    """At most ``size`` connections in use at once; idle ones are reused, newest first.

    After a fork the child starts with an empty pool: it must never touch the parent's
    connections (SQLite forbids carrying a connection across ``fork``).
    """

    __slots__ = ("__weakref__", "_closed", "_connect", "_idle", "_settling", "_size", "_slots")

    def __init__(self, connect: Callable[[], Awaitable[aiosqlite.Connection]], size: int) -> None:
        self._connect = connect
        self._size = size
        self._idle: list[aiosqlite.Connection] = []
        self._slots: asyncio.Semaphore | None = None
        self._settling: set[asyncio.Task[None]] = set()  # (strong references: see abandon)
        self._closed = False
        forget_parent_in_children(self)

    def _forget_parent(self) -> None:
        # In a forked child: the parent's connections (and tasks) are never used here.
        self._idle, self._slots, self._settling = [], None, set()

    async def execute(self, conn: aiosqlite.Connection, sql: str, params: Params = ()) -> None:
        """:func:`execute` (the threaded twin runs it on a cursor the pool keeps per
        connection; aiosqlite has no cheaper path than one hop to the connection's thread)."""
        await conn.execute_fetchall(sql, params)

    async def begin(self, conn: aiosqlite.Connection, claim_first: bool = False) -> None:
        """``BEGIN IMMEDIATE`` on ``conn``, one hop to its thread. With ``claim_first`` (the
        next statement is the claim's INSERT) nothing is sent: the connection's
        ``isolation_level`` is set to ``IMMEDIATE``, so sqlite3 itself runs ``BEGIN
        IMMEDIATE`` just before that INSERT, in the claim's own hop (one hop fewer per
        transaction). :meth:`release` turns autocommit back on."""
        if claim_first:
            conn.isolation_level = "IMMEDIATE"
        else:
            await conn.execute_fetchall("BEGIN IMMEDIATE")

    async def fetchall(
        self, conn: aiosqlite.Connection, sql: str, params: Params = ()
    ) -> list[Any]:
        """:func:`fetchall`, like :meth:`execute`."""
        return list(await conn.execute_fetchall(sql, params))

    async def acquire(self) -> aiosqlite.Connection:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self._size)
        await self._slots.acquire()
        try:
            return self._idle.pop() if self._idle else await self._connect()
        except BaseException:
            self._slots.release()
            raise

    async def release(self, conn: aiosqlite.Connection, discard: bool = False) -> None:
        try:
            if conn.isolation_level is not None:  # left by begin(claim_first=True)
                if conn.in_transaction:
                    discard = True  # (the store rolls back first: never expected here)
                else:
                    conn.isolation_level = None  # no transaction open: sets, commits nothing
            if discard or self._closed:
                await close(conn)
            else:
                self._idle.append(conn)
        finally:
            if self._slots is not None:
                self._slots.release()

    def abandon(self, conn: aiosqlite.Connection) -> None:
        """Settle ``conn`` in the background after a transaction on it was interrupted
        (cancelled) while one of its statements may still wait on the connection's thread.
        aiosqlite runs a queued statement even when its caller is gone, so the connection can
        be neither reused nor touched now: a BEGIN arriving late would leave a transaction
        open in the pool, and an INSERT arriving after autocommit was restored would commit a
        marker alone. A ``ROLLBACK`` is queued behind that statement instead, and the
        connection goes back to the pool (autocommit restored) only once it has run; it
        keeps its slot until then. It is not closed: a ``:memory:`` store's only connection
        is its whole database."""
        task = asyncio.get_running_loop().create_task(self._settle(conn))
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    async def _settle(self, conn: aiosqlite.Connection) -> None:
        discard = False
        try:
            await conn.execute_fetchall("ROLLBACK")
        except sqlite3.OperationalError as exc:
            # The interrupted statement opened nothing (or its COMMIT ran): nothing to undo.
            discard = "no transaction is active" not in str(exc)
        except (sqlite3.Error, ValueError):
            discard = True
        finally:
            await self.release(conn, discard or conn.in_transaction)

    def adopt(self, conn: aiosqlite.Connection) -> None:
        """Keep a connection opened outside :meth:`acquire` for later use."""
        self._idle.append(conn)

    async def close(self) -> None:
        self._closed = True
        if self._settling:  # connections still settling after a cancellation: let them end
            await asyncio.gather(*self._settling, return_exceptions=True)
        idle, self._idle = self._idle, []
        for conn in idle:
            await close(conn)
