"""Hand-written: PyMySQL calls and the connection pool (twin: ``async_io.py``).

The pool's common path is one ``list.pop`` and one ``list.append`` (atomic under the GIL),
plus a zero-timeout poll of the idle socket: a connection the server closed (a restart, a
``KILL``, ``wait_timeout``) is dropped there instead of failing the next call.
"""

from __future__ import annotations

import contextlib
import os
import select
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeAlias

import pymysql  # type: ignore[import-untyped]

from oncely.stores.mysql.errors import MySQLSettings

__all__ = ["Connection", "Pool", "close", "connect", "execute", "fetchall", "sleep"]

Connection: TypeAlias = Any
"""A ``pymysql.connections.Connection`` (PyMySQL ships no type information)."""


def connect(settings: MySQLSettings) -> Connection:
    return pymysql.connect(database=settings.database, **settings.connect_kwargs())


def execute(
    conn: Connection, sql: str, params: Mapping[str, object] | None = None
) -> tuple[int, int]:
    """Run one statement; its affected (with ``CLIENT_FOUND_ROWS``: matched) row count and
    the insert id of its OK packet."""
    with conn.cursor() as cursor:
        affected = cursor.execute(sql, params)
        return int(affected), int(cursor.lastrowid or 0)


def fetchall(conn: Connection, sql: str, params: Mapping[str, object] | None = None) -> list[Any]:
    """Run one statement and return its rows."""
    with conn.cursor() as cursor:
        cursor.execute(sql, params)
        return list(cursor.fetchall())


def close(conn: Connection) -> None:
    with contextlib.suppress(Exception):
        conn.close()


def alive(conn: Connection) -> bool:
    """False when an idle connection's socket is gone or readable: an idle connection has
    nothing to read unless the server closed it (end of file: a restart, a ``KILL``,
    ``wait_timeout``) or sent a goodbye packet. A zero-timeout poll, no round trip."""
    sock = getattr(conn, "_sock", None)
    if sock is None:
        return False
    try:
        if hasattr(select, "poll"):  # select() refuses descriptors above 1023
            poller = select.poll()
            poller.register(sock, select.POLLIN | select.POLLPRI)
            return not poller.poll(0)
        return not select.select([sock], [], [], 0)[0]
    except (OSError, ValueError):
        return False


def sleep(seconds: float) -> None:
    time.sleep(seconds)


class Pool:
    """At most ``size`` connections in use at once; idle ones are reused, newest first.

    After a fork the child starts with an empty pool: a connection's socket must never be
    shared by two processes.
    """

    __slots__ = ("_closed", "_cond", "_connect", "_idle", "_opened", "_pid", "_size")

    def __init__(self, connect: Callable[[], Connection], size: int) -> None:
        self._connect = connect
        self._size = size
        self._idle: list[Connection] = []
        self._opened = 0
        self._cond = threading.Condition(threading.Lock())
        self._pid = os.getpid()
        self._closed = False

    def acquire(self) -> Connection:
        if self._pid != os.getpid():
            self._idle, self._opened, self._pid = [], 0, os.getpid()
            self._cond = threading.Condition(threading.Lock())
        while True:
            try:
                conn = self._idle.pop()
            except IndexError:
                return self._acquire_slowly()
            if alive(conn):
                return conn
            self.release(conn, discard=True)

    def _acquire_slowly(self) -> Connection:
        with self._cond:
            while True:
                if self._idle:
                    conn = self._idle.pop()
                    if alive(conn):
                        return conn
                    close(conn)
                    self._opened -= 1
                    continue
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

    def release(self, conn: Connection, *, discard: bool = False) -> None:
        if discard or self._closed:
            close(conn)
            with self._cond:
                self._opened -= 1
            return
        self._idle.append(conn)

    def close(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            close(conn)
