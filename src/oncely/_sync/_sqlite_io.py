"""Hand-written: sqlite3 calls and the connection pool (twin: ``_async/_sqlite_io.py``).

The pool's common path is one ``list.pop`` and one ``list.append`` (atomic under the GIL): a
semaphore round trip costs as much as a small SQLite statement. Only an exhausted pool takes
the lock and waits.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

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

    __slots__ = ("_closed", "_cond", "_connect", "_idle", "_opened", "_pid", "_size")

    def __init__(self, connect: Callable[[], sqlite3.Connection], size: int) -> None:
        self._connect = connect
        self._size = size
        self._idle: list[sqlite3.Connection] = []
        self._opened = 0
        self._cond = threading.Condition(threading.Lock())
        self._pid = os.getpid()
        self._closed = False

    def acquire(self) -> sqlite3.Connection:
        if self._pid != os.getpid():
            self._idle, self._opened, self._pid = [], 0, os.getpid()
            self._cond = threading.Condition(threading.Lock())
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
            return self._connect()
        except BaseException:
            with self._cond:
                self._opened -= 1
            raise

    def release(self, conn: sqlite3.Connection, *, discard: bool = False) -> None:
        if discard or self._closed:
            close(conn)
            with self._cond:
                self._opened -= 1
            return
        self._idle.append(conn)

    def adopt(self, conn: sqlite3.Connection) -> None:
        """Keep a connection opened outside :meth:`acquire` for later use."""
        with self._cond:
            self._opened += 1
        self._idle.append(conn)

    def close(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            close(conn)
