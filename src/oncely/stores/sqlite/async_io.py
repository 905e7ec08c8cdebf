"""The SQLite calls and the connection pool: aiosqlite in the asyncio module, sqlite3 in its
generated sync twin (``sync_io.py``).

The shapes differ (``execute_fetchall`` is one hop to the connection's thread; the asyncio
pool waits on a semaphore), and what differs is marked ``if ASYNC``. The threaded pool's
common path is one ``list.pop`` and one ``list.append`` (atomic under the GIL): a semaphore
round trip costs as much as a small SQLite statement. Only an exhausted pool takes the lock and
waits. A forked child empties every pool in a fork hook, so acquiring a connection does not ask
the OS for the process id. The threaded pool keeps one cursor per connection for oncely's own
statements (:meth:`AsyncPool.execute`): ``Connection.execute`` builds a new cursor for every
statement, which costs more than running a small statement.
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
from oncely._twin import ASYNC

__all__ = ["Params", "close", "connect", "execute", "fetchall"]
__all__ += ["AsyncPool"]  # apart: sorted, AsyncPool and Pool take different places

Params = Mapping[str, object] | Sequence[object]


async def connect(path: str, *, timeout: float, uri: bool) -> aiosqlite.Connection:
    pending = aiosqlite.connect(
        path, isolation_level=None, timeout=timeout, check_same_thread=False, uri=uri
    )
    if ASYNC:
        # aiosqlite runs each connection on a non-daemon thread, so a store nobody closed would
        # keep the process from exiting. Dying mid-write is safe for SQLite (the WAL rolls the
        # transaction back), so the worker may be a daemon.
        worker = getattr(pending, "_thread", None)
        if isinstance(worker, threading.Thread) and not worker.is_alive():
            worker.daemon = True
        try:
            return await pending
        except Exception:
            # A failed connect stops the worker, which then reports to this loop: wait for
            # it, or a loop closed meanwhile (asyncio.run ending on the error) gets a
            # traceback printed from the thread after the error's one line.
            if isinstance(worker, threading.Thread):
                await asyncio.to_thread(worker.join, 5.0)
            raise
    else:
        return pending


async def fetchall(conn: aiosqlite.Connection, sql: str, params: Params = ()) -> list[Any]:
    """Run one statement and return its rows (asyncio: one hop to the connection's thread)."""
    if ASYNC:
        return list(await conn.execute_fetchall(sql, params))
    else:
        cursor = conn.execute(sql, params)
        try:
            return cursor.fetchall()
        finally:
            cursor.close()


async def execute(conn: aiosqlite.Connection, sql: str, params: Params = ()) -> None:
    """Run one statement whose rows do not matter."""
    if ASYNC:
        await conn.execute_fetchall(sql, params)
    else:
        conn.execute(sql, params).close()


async def close(conn: aiosqlite.Connection) -> None:
    if ASYNC:
        with contextlib.suppress(sqlite3.Error, ValueError):
            await conn.close()
    else:
        with contextlib.suppress(sqlite3.Error):
            conn.close()


class AsyncPool:
    """At most ``size`` connections in use at once; idle ones are reused, newest first.

    After a fork the child starts with an empty pool: it must never touch the parent's
    connections (SQLite forbids carrying a connection across ``fork``).
    """

    if ASYNC:
        __slots__ = (
            "__weakref__",
            "_closed",
            "_connect",
            "_idle",
            "_settling",
            "_size",
            "_slots",
        )
    else:
        __slots__ = (
            "__weakref__",
            "_closed",
            "_cond",
            "_connect",
            "_cursors",
            "_idle",
            "_opened",
            "_size",
        )

    def __init__(self, connect: Callable[[], Awaitable[aiosqlite.Connection]], size: int) -> None:
        self._connect = connect
        self._size = size
        self._idle: list[aiosqlite.Connection] = []
        if ASYNC:
            self._slots: asyncio.Semaphore | None = None
            self._settling: set[asyncio.Task[None]] = set()  # (strong references: see abandon)
        else:
            self._cursors: dict[sqlite3.Connection, sqlite3.Cursor] = {}
            self._opened = 0
            self._cond = threading.Condition(threading.Lock())
        self._closed = False
        forget_parent_in_children(self)

    def _forget_parent(self) -> None:
        # In a forked child: the parent's connections (and tasks) are never used here.
        if ASYNC:
            self._idle, self._slots, self._settling = [], None, set()
        else:
            self._idle, self._cursors, self._opened = [], {}, 0
            self._cond = threading.Condition(threading.Lock())

    async def execute(self, conn: aiosqlite.Connection, sql: str, params: Params = ()) -> None:
        """:func:`execute`. asyncio: aiosqlite has no cheaper path than one hop to the
        connection's thread. Threads: on the pool's cursor for ``conn`` (any connection is
        accepted: one the pool did not open runs the statement on a cursor of its own)."""
        if ASYNC:
            await conn.execute_fetchall(sql, params)
        else:
            cursor = self._cursors.get(conn)
            if cursor is None:
                conn.execute(sql, params).close()
            else:
                cursor.execute(sql, params)

    async def begin(self, conn: aiosqlite.Connection, claim_first: bool = False) -> None:
        """``BEGIN IMMEDIATE`` on ``conn``.

        asyncio: one hop to its thread. With ``claim_first`` (the next statement is the
        claim's INSERT) nothing is sent: the connection's ``isolation_level`` is set to
        ``IMMEDIATE``, so sqlite3 itself runs ``BEGIN IMMEDIATE`` just before that INSERT, in
        the claim's own hop (one hop fewer per transaction). :meth:`release` turns autocommit
        back on. Threads: a statement is no hop, and sqlite3's implicit BEGIN measured no
        faster, so it is always sent."""
        if ASYNC:
            if claim_first:
                conn.isolation_level = "IMMEDIATE"
            else:
                await conn.execute_fetchall("BEGIN IMMEDIATE")
        else:
            self.execute(conn, "BEGIN IMMEDIATE")

    async def fetchall(
        self, conn: aiosqlite.Connection, sql: str, params: Params = ()
    ) -> list[Any]:
        """:func:`fetchall`, like :meth:`execute`."""
        if ASYNC:
            return list(await conn.execute_fetchall(sql, params))
        else:
            cursor = self._cursors.get(conn)
            if cursor is None:
                return fetchall(conn, sql, params)
            return cursor.execute(sql, params).fetchall()

    if ASYNC:

        async def acquire(self) -> aiosqlite.Connection:
            if self._slots is None:
                self._slots = asyncio.Semaphore(self._size)
            await self._slots.acquire()
            try:
                return self._idle.pop() if self._idle else await self._connect()
            except BaseException:
                self._slots.release()
                raise

    else:

        def acquire(self) -> sqlite3.Connection:
            try:
                return self._idle.pop()
            except IndexError:
                return self._acquire_slowly()

        def _acquire_slowly(self) -> sqlite3.Connection:
            with self._cond:
                while True:
                    if self._idle:
                        return self._idle.pop()
                    if self._opened < self._size:
                        self._opened += 1
                        break
                    # A short timed wait instead of relying on a notify: release() never takes
                    # the lock on its fast path, so a wake-up could be missed.
                    self._cond.wait(0.01)
            try:
                conn = self._connect()
            except BaseException:
                with self._cond:
                    self._opened -= 1
                raise
            self._cursors[conn] = conn.cursor()
            return conn

    async def release(self, conn: aiosqlite.Connection, discard: bool = False) -> None:
        if ASYNC:
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
        else:
            if discard or self._closed:
                self._cursors.pop(conn, None)
                close(conn)
                with self._cond:
                    self._opened -= 1
                return
            self._idle.append(conn)

    def abandon(self, conn: aiosqlite.Connection) -> None:
        """Settle ``conn`` after a transaction on it was interrupted by a ``BaseException``.

        asyncio: the interruption is a cancellation while one of its statements may still wait
        on the connection's thread. aiosqlite runs a queued statement even when its caller is
        gone, so the connection can be neither reused nor touched now: a BEGIN arriving late
        would leave a transaction open in the pool, and an INSERT arriving after autocommit
        was restored would commit a marker alone. A ``ROLLBACK`` is queued behind that
        statement instead, and the connection goes back to the pool (autocommit restored) only
        once it has run; it keeps its slot until then. It is not closed: a ``:memory:``
        store's only connection is its whole database.

        Threads: a statement has always ended when the exception surfaces: roll back whatever
        is open and give the connection back, or drop it if that fails."""
        if ASYNC:
            task = asyncio.get_running_loop().create_task(self._settle(conn))
            self._settling.add(task)
            task.add_done_callback(self._settling.discard)
        else:
            discard = False
            if conn.in_transaction:
                try:
                    self.execute(conn, "ROLLBACK")
                except sqlite3.Error:
                    discard = True
            self.release(conn, discard or conn.in_transaction)

    if ASYNC:

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
        if ASYNC:
            self._idle.append(conn)
        else:
            with self._cond:
                self._opened += 1
            self._cursors[conn] = conn.cursor()
            self._idle.append(conn)

    async def close(self) -> None:
        self._closed = True
        if ASYNC:  # noqa: SIM102 (a marker stands apart)
            if self._settling:  # connections still settling after a cancellation: let them end
                await asyncio.gather(*self._settling, return_exceptions=True)
        idle, self._idle = self._idle, []
        for conn in idle:
            if ASYNC:
                await close(conn)
            else:
                self._cursors.pop(conn, None)
                close(conn)
