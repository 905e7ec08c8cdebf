"""The MySQL calls and the connection pool: aiomysql in the asyncio module, PyMySQL in its
generated sync twin (``sync_io.py``).

aiomysql mirrors PyMySQL (``await conn.cursor()``, ``await cursor.execute()``) and raises
PyMySQL's exceptions; what differs is marked ``if ASYNC``: how a connection is opened, how a
statement is sent, how an idle connection is seen to be dead (asyncio: its stream reader is at
end of file; threads: a zero-timeout poll of its socket, no round trip) and the pool. The
asyncio pool waits on a semaphore. The threaded pool's common path is one ``list.pop`` and one
``list.append`` (atomic under the GIL), plus that poll: a connection the server closed (a
restart, a ``KILL``, ``wait_timeout``) is dropped there instead of failing the next call.

A statement on a connection the store holds alone (:func:`own`), outside a transaction, gets
its answer within the store's ``read_timeout``, and a connection attempt its server's within
``connect_timeout``, or the connection is cut by the process's watchdog
(:mod:`oncely.stores._watchdog`): aiomysql has no timeout on a read, nor on the handshake
after the TCP connect, and PyMySQL's ``read_timeout`` is the socket's, for every read, so it
would also cut a transaction's statement waiting on another transaction's row lock (up to
``innodb_lock_wait_timeout``, legitimately). A server gone silent behind a dead route (no
reset, no refusal) would otherwise hold the caller, a sync one above all, until the kernel's
TCP timeouts give up (many minutes; never, when something on the way still acknowledges).
The connections also get TCP keepalives (:data:`_KEEPALIVES`) for real partitions on the
statements not watched.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import weakref
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeAlias, TypeVar

import pymysql  # type: ignore[import-untyped]

from oncely._twin import ASYNC
from oncely.stores._watchdog import WATCHDOG, cuts
from oncely.stores.mysql.errors import DRIVER_ERRORS, MySQLSettings, joinable

if ASYNC:
    import aiomysql  # type: ignore[import-untyped]
    from pymysql.converters import escape_bytes  # type: ignore[import-untyped]
else:
    import select
    import threading
    import time

__all__ = [
    "Connection",
    "close",
    "closed",
    "connect",
    "disown",
    "execute",
    "fetchall",
    "fetchall_unbounded",
    "own",
    "sleep",
    "undoubted",
]
__all__ += ["AsyncPool"]  # apart: sorted, AsyncPool and Pool take different places

Connection: TypeAlias = Any
"""An ``aiomysql.Connection``; in the sync twin a ``pymysql.connections.Connection`` (neither
library ships type information)."""

Params: TypeAlias = Mapping[str, object] | None
T = TypeVar("T")

_BOUND: weakref.WeakKeyDictionary[Connection, float] = weakref.WeakKeyDictionary()
"""The seconds a statement waits for its answer (the store's ``read_timeout``) on each
connection a store has taken from its pool for itself (:func:`own`). Never a caller's
connection (``tx=``), nor one a store uses for its schema or its purge's lead."""


_ENDINGS = ("rollback", "commit", "begin", "start", "set", "xa")
"""The first words of statements that may end a transaction or change how one ends (``SET
autocommit``; any other ``SET`` only costs the look this leads to)."""


def _may_end(sql: object) -> bool:
    head = sql[:24] if isinstance(sql, str | bytes) else b""
    text = head.decode("latin-1") if isinstance(head, bytes) else head
    return text.lstrip().lower().startswith(_ENDINGS)


_WATCHED_DOC = """The store's own connections: they count what may have ended the transaction a
block of the transactional mode opened on them (``doubts``, set to 0 when the block begins): an
error the server answered (a deadlock victim's whole transaction is rolled back, and a handler
may catch the error and go on), and a COMMIT, ROLLBACK, BEGIN or ``SET``. While it stays 0
nothing can have ended it, and the claim need not be looked for before the commit (one round
trip saved on every message)."""

if ASYNC:

    class _Watched(aiomysql.Connection):  # type: ignore[misc]
        __doc__ = _WATCHED_DOC
        doubts = 0

        async def query(self, sql: Any, unbuffered: bool = False) -> Any:
            if _may_end(sql):
                self.doubts += 1
            try:
                return await super().query(sql, unbuffered)
            except pymysql.MySQLError:
                self.doubts += 1
                raise

        async def begin(self) -> None:
            self.doubts += 1
            await super().begin()

        async def commit(self) -> None:
            self.doubts += 1
            await super().commit()

        async def rollback(self) -> None:
            self.doubts += 1
            await super().rollback()

        async def autocommit(self, value: Any) -> None:
            self.doubts += 1
            await super().autocommit(value)

else:

    class _Watched(pymysql.connections.Connection):  # type: ignore[misc]
        __doc__ = _WATCHED_DOC
        doubts = 0

        def query(self, sql: Any, unbuffered: bool = False) -> Any:
            if _may_end(sql):
                self.doubts += 1
            try:
                return super().query(sql, unbuffered)
            except pymysql.MySQLError:
                self.doubts += 1
                raise

        def begin(self) -> None:
            self.doubts += 1
            super().begin()

        def commit(self) -> None:
            self.doubts += 1
            super().commit()

        def rollback(self) -> None:
            self.doubts += 1
            super().rollback()

        def autocommit(self, value: Any) -> None:
            self.doubts += 1
            super().autocommit(value)


def undoubted(conn: Connection) -> bool:
    """Whether ``conn`` is one of the store's own connections on which nothing that may have
    ended a transaction happened since its ``doubts`` were last set to 0."""
    return isinstance(conn, _Watched) and conn.doubts == 0


def own(conn: Connection, read_timeout: float | None) -> None:
    """Bound the wait for the answers to the statements a store runs on ``conn`` (just taken
    from its pool, used by it alone) outside a transaction: ``read_timeout`` seconds (None:
    as long as it takes)."""
    if read_timeout is not None:
        _BOUND[conn] = read_timeout


def disown(conn: Connection) -> None:
    """Stop bounding ``conn``'s statements (it goes back to the pool)."""
    _BOUND.pop(conn, None)


if ASYNC:

    def _socket(conn: Connection) -> Any:
        return conn._writer.transport.get_extra_info("socket")

    cuts(aiomysql.Connection, lambda conn: _socket(conn).fileno())
else:

    def _socket(conn: Connection) -> Any:
        return conn._sock

    cuts(pymysql.connections.Connection, lambda conn: _socket(conn).fileno())


_KEEPALIVES = tuple(
    (getattr(socket, name), value)
    for name, value in (
        ("TCP_KEEPIDLE", 15),
        ("TCP_KEEPINTVL", 5),
        ("TCP_KEEPCNT", 3),
        ("TCP_USER_TIMEOUT", 30_000),
    )
    if hasattr(socket, name)
)
"""The TCP settings of the connections oncely opens (both drivers turn ``SO_KEEPALIVE`` on):
a connection whose server is cut off by the network (a dead route: no reset) is found dead
after about 30 s (a keepalive probe unanswered 15 s after the last traffic, then every 5 s;
data unacknowledged for 30 s) instead of the operating system's defaults (two hours before
the first probe, and about 15 minutes of retransmissions), also where no watch bounds the wait
(a transaction's statements, ``stats()``, ``scan()``). As the PostgreSQL store's. Left out
where the system lacks them; not on a Unix socket."""


def _cut(seconds: float, bound: str, what: str) -> pymysql.OperationalError:
    """The error of a wait the watchdog cut at ``bound`` (2013, lost connection: the store
    says StoreUnavailable, and the pool drops the connection)."""
    return pymysql.OperationalError(
        2013,
        f"no answer from the server within {seconds:g}s ({bound}): the {what} (the server or "
        "the network to it may be down)",
    )


async def connect(settings: MySQLSettings) -> Connection:
    """A new connection, its handshake included within ``connect_timeout`` (both drivers
    bound only the TCP connect by it; the handshake's reads are not bounded at all)."""
    seconds = settings.connect_timeout.total_seconds()
    if ASYNC:
        conn = _Watched(db=settings.database, **settings.connect_kwargs())
    else:
        conn = _Watched(database=settings.database, defer_connect=True, **settings.connect_kwargs())
    WATCHDOG.start(conn, seconds)
    try:
        if ASYNC:
            await conn._connect()  # what aiomysql.connect() awaits
        else:
            conn.connect()
    except BaseException as exc:
        if ASYNC:
            conn.close()  # aiomysql leaves the transport open when the attempt is cancelled
        if WATCHDOG.stop(conn) and isinstance(exc, DRIVER_ERRORS):
            raise _cut(seconds, "connect_timeout", "connection attempt was cut") from exc
        raise
    WATCHDOG.stop(conn)
    if settings.unix_socket is None:
        _keepalive(conn)
    return conn


def _keepalive(conn: Connection) -> None:
    with contextlib.suppress(Exception):  # a system that refuses one: its default stays
        sock = _socket(conn)
        for option, value in _KEEPALIVES:
            sock.setsockopt(socket.IPPROTO_TCP, option, value)


_TUPLES = pymysql.cursors.Cursor
"""The cursor every statement runs on: rows as tuples, whatever cursor class a caller's
connection was made with (``cursorclass=DictCursor``)."""

if ASYNC:

    class _Cursor(aiomysql.Cursor):  # type: ignore[misc]
        """aiomysql's cursor without its reaction to server warnings: a ``SHOW WARNINGS`` round
        trip and a Python ``Warning`` per note (PyMySQL's cursor does neither). oncely's only
        expected notes are "table already exists" from ``CREATE TABLE IF NOT EXISTS``; its
        sessions are strict, so what would truncate data is an error, not a warning."""

        async def _show_warnings(self, conn: Connection) -> None:
            return None

    def _query(conn: Connection, sql: str, params: Params) -> str:
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


async def execute(conn: Connection, sql: str, params: Params = None) -> tuple[int, int]:
    """Run one statement; its affected (with ``CLIENT_FOUND_ROWS``: matched) row count and
    the insert id of its OK packet. On a connection the store holds alone (:func:`own`),
    outside a transaction (and with autocommit on), the wait for the answer lasts at most the
    store's ``read_timeout``: past it the connection is cut and the error (2013) says so."""
    seconds = _BOUND.get(conn)
    if seconds is None or joinable(conn):  # in a transaction: may wait on a row lock
        return await _execute(conn, sql, params)
    return await _watched(conn, seconds, _execute, sql, params)


async def fetchall(conn: Connection, sql: str, params: Params = None) -> list[Any]:
    """Run one statement and return its rows; bounded as :func:`execute`."""
    seconds = _BOUND.get(conn)
    if seconds is None or joinable(conn):  # in a transaction: may wait on a row lock
        return await _fetchall(conn, sql, params)
    return await _watched(conn, seconds, _fetchall, sql, params)


async def fetchall_unbounded(conn: Connection, sql: str, params: Params = None) -> list[Any]:
    """:func:`fetchall` whose wait for the answer is never cut (a statement that may take
    long by nature)."""
    return await _fetchall(conn, sql, params)


async def _watched(
    conn: Connection,
    seconds: float,
    run: Callable[[Connection, str, Params], Awaitable[T]],
    sql: str,
    params: Params,
) -> T:
    # Statements inside a transaction are not watched (the callers see to it): one may wait
    # on another transaction's row lock for as long as innodb_lock_wait_timeout (a repeat
    # in the transactional mode waits so for the first claimer's commit).
    WATCHDOG.start(conn, seconds)
    try:
        done = await run(conn, sql, params)
    except BaseException as exc:
        if WATCHDOG.stop(conn) and isinstance(exc, DRIVER_ERRORS):
            raise _cut(seconds, "read_timeout", "connection was closed") from exc
        raise
    WATCHDOG.stop(conn)
    return done


async def _execute(conn: Connection, sql: str, params: Params) -> tuple[int, int]:
    if ASYNC:
        cursor = await conn.cursor(_Cursor)
        try:
            affected = await cursor.execute(_query(conn, sql, params))
            return int(affected), int(cursor.lastrowid or 0)
        finally:
            await cursor.close()
    else:
        with conn.cursor(_TUPLES) as cursor:
            affected = cursor.execute(sql, params)
            return int(affected), int(cursor.lastrowid or 0)


async def _fetchall(conn: Connection, sql: str, params: Params) -> list[Any]:
    if ASYNC:
        cursor = await conn.cursor(_Cursor)
        try:
            await cursor.execute(_query(conn, sql, params))
            return list(await cursor.fetchall())
        finally:
            await cursor.close()
    else:
        with conn.cursor(_TUPLES) as cursor:
            cursor.execute(sql, params)
            return list(cursor.fetchall())


async def close(conn: Connection) -> None:
    """Say goodbye to a live server (it would log an aborted connection otherwise), then
    drop the transport (PyMySQL's ``close`` does both)."""
    if ASYNC:
        with contextlib.suppress(Exception):
            if alive(conn):
                await conn.ensure_closed()
    with contextlib.suppress(Exception):
        conn.close()


if ASYNC:

    def closed(conn: Connection) -> bool:
        """Whether ``conn`` was closed on this side (by :func:`close`, or by the driver on a
        lost connection)."""
        return bool(conn.closed)

else:

    def closed(conn: Connection) -> bool:
        """Whether ``conn`` was closed on this side (by :func:`close`, or by the driver on a
        lost connection)."""
        return not conn.open


if ASYNC:

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

else:

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


async def sleep(seconds: float) -> None:
    if ASYNC:
        await asyncio.sleep(seconds)
    else:
        time.sleep(seconds)


class AsyncPool:
    """At most ``size`` connections in use at once; idle ones are reused, newest first.

    After a fork the child starts with an empty pool: a connection's socket must never be
    shared by two processes.
    """

    if ASYNC:
        __slots__ = ("_closed", "_connect", "_idle", "_pid", "_size", "_slots")
    else:
        __slots__ = ("_closed", "_cond", "_connect", "_idle", "_opened", "_pid", "_size")

    def __init__(self, connect: Callable[[], Awaitable[Connection]], size: int) -> None:
        self._connect = connect
        self._size = size
        self._idle: list[Connection] = []
        if ASYNC:
            self._slots: asyncio.Semaphore | None = None
        else:
            self._opened = 0
            self._cond = threading.Condition(threading.Lock())
        self._pid = os.getpid()
        self._closed = False

    if ASYNC:

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

    else:

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

    async def release(self, conn: Connection, *, discard: bool = False) -> None:
        if ASYNC:
            try:
                if discard or self._closed:
                    await close(conn)
                else:
                    self._idle.append(conn)
            finally:
                if self._slots is not None:
                    self._slots.release()
        else:
            if discard or self._closed:
                close(conn)
                with self._cond:
                    self._opened -= 1
                return
            self._idle.append(conn)

    async def close(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            await close(conn)
