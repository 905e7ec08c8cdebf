"""Hand-written: sqlite3 calls and the connection pool (twin: ``async_io.py``).

The pool's common path is one ``list.pop`` and one ``list.append`` (atomic under the GIL): a
semaphore round trip costs as much as a small SQLite statement. Only an exhausted pool takes
the lock and waits. A forked child empties every pool in a fork hook, so the common path does
not ask the OS for its process id either. The pool keeps one cursor per connection for
oncely's own statements (:meth:`Pool.execute`): ``Connection.execute`` builds a new cursor
for every statement, which costs more than running a small statement.
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from oncely._core.forking import forget_parent_in_children

__all__ = ["Params", "Pool", "close", "connect", "execute", "fetchall"]

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


def execute(conn: sqlite3.Connection, sql: str, params: Params = ()) -> None:
    """Run one statement whose rows do not matter."""
    conn.execute(sql, params).close()


def close(conn: sqlite3.Connection) -> None:
    with contextlib.suppress(sqlite3.Error):
        conn.close()


class Pool:
    """At most ``size`` connections in use at once; idle ones are reused, newest first.

    After a fork the child starts with an empty pool: it must never touch the parent's
    connections (SQLite forbids carrying a connection across ``fork``).
    """

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

    def __init__(self, connect: Callable[[], sqlite3.Connection], size: int) -> None:
        self._connect = connect
        self._size = size
        self._idle: list[sqlite3.Connection] = []
        self._cursors: dict[sqlite3.Connection, sqlite3.Cursor] = {}
        self._opened = 0
        self._cond = threading.Condition(threading.Lock())
        self._closed = False
        forget_parent_in_children(self)

    def _forget_parent(self) -> None:
        # In a forked child: the parent's connections are never used here.
        self._idle, self._cursors, self._opened = [], {}, 0
        self._cond = threading.Condition(threading.Lock())

    def execute(self, conn: sqlite3.Connection, sql: str, params: Params = ()) -> None:
        """:func:`execute` on the pool's cursor for ``conn`` (any connection is accepted:
        one the pool did not open runs the statement on a cursor of its own)."""
        cursor = self._cursors.get(conn)
        if cursor is None:
            conn.execute(sql, params).close()
        else:
            cursor.execute(sql, params)

    def begin(self, conn: sqlite3.Connection, claim_first: bool = False) -> None:
        """``BEGIN IMMEDIATE`` on ``conn``. (The asyncio twin folds it into the claim's hop
        when ``claim_first`` says the claim comes next; here a statement is no hop, and
        sqlite3's implicit BEGIN measured no faster, so it is always sent.)"""
        self.execute(conn, "BEGIN IMMEDIATE")

    def fetchall(self, conn: sqlite3.Connection, sql: str, params: Params = ()) -> list[Any]:
        """:func:`fetchall` on the pool's cursor for ``conn``, like :meth:`execute`."""
        cursor = self._cursors.get(conn)
        if cursor is None:
            return fetchall(conn, sql, params)
        return cursor.execute(sql, params).fetchall()

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

    def release(self, conn: sqlite3.Connection, discard: bool = False) -> None:
        if discard or self._closed:
            self._cursors.pop(conn, None)
            close(conn)
            with self._cond:
                self._opened -= 1
            return
        self._idle.append(conn)

    def abandon(self, conn: sqlite3.Connection) -> None:
        """Settle ``conn`` after a transaction on it was interrupted by a ``BaseException``
        (the asyncio twin's case is cancellation while a statement still waits on the
        connection's thread; here a statement has always ended when the exception surfaces):
        roll back whatever is open and give it back, or drop it if that fails."""
        discard = False
        if conn.in_transaction:
            try:
                self.execute(conn, "ROLLBACK")
            except sqlite3.Error:
                discard = True
        self.release(conn, discard or conn.in_transaction)

    def adopt(self, conn: sqlite3.Connection) -> None:
        """Keep a connection opened outside :meth:`acquire` for later use."""
        with self._cond:
            self._opened += 1
        self._cursors[conn] = conn.cursor()
        self._idle.append(conn)

    def close(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            self._cursors.pop(conn, None)
            close(conn)
