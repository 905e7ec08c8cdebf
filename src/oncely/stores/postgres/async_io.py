"""psycopg's classes and calls: the part of the PostgreSQL store where asyncio and sync differ.

psycopg's sync and asyncio APIs have the same method names, so the store itself is written once;
only the class names, opening and closing a pool, and a background pool check differ. They are
marked ``if ASYNC:`` in ``async_io.py``, from which ``sync_io.py`` is generated like the rest.

A statement on a connection the store holds alone, outside a transaction, gets its answer
within the store's ``read_timeout`` or its connection is cut (by the process's watchdog,
:mod:`oncely.stores._watchdog`): psycopg has no client-side timeout of its own, and a server
gone silent behind a dead route (no reset, no refusal: the kernel's TCP timeouts take many
minutes, or never come when something on the way still acknowledges) would hold the caller, a
sync one above all, for as long.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import AsyncIterator, Callable, Mapping
from datetime import timedelta
from functools import cache
from typing import Any, TypeAlias

import psycopg
from psycopg import pq
from psycopg.conninfo import conninfo_to_dict
from psycopg.rows import tuple_row

from oncely._twin import ASYNC
from oncely.stores._watchdog import WATCHDOG, cuts

if ASYNC:
    import asyncio

    from psycopg import AsyncConnection as _Connection
    from psycopg import AsyncCursor as _Cursor
    from psycopg import AsyncPipeline as _Pipeline
    from psycopg_pool import AsyncConnectionPool as _ConnectionPool
else:
    import threading

    from psycopg import Connection as _Connection
    from psycopg import Cursor as _Cursor
    from psycopg import Pipeline as _Pipeline
    from psycopg_pool import ConnectionPool as _ConnectionPool

__all__ = [
    "ConnPool",
    "Connection",
    "Params",
    "close_pool",
    "commit_after",
    "connect",
    "disown",
    "execute",
    "fetchall",
    "fetchall_after",
    "fetchall_begun",
    "fetchall_unbounded",
    "is_connection",
    "is_pool",
    "make_pool",
    "open_pool",
    "own",
    "recheck_soon",
    "tcp_defaults",
]

Connection: TypeAlias = _Connection[Any]
ConnPool: TypeAlias = _ConnectionPool[Any]
Params = Mapping[str, object] | None

_PIPELINE = _Pipeline.is_supported()

TupleCursor: TypeAlias = _Cursor[tuple[Any, ...]]
_OWN: weakref.WeakKeyDictionary[Connection, tuple[TupleCursor, float | None]] = (
    weakref.WeakKeyDictionary()
)
"""For each connection a store has checked out of its pool (:func:`own`), a cursor reused by
every statement the store runs on it (creating a psycopg cursor, its adapters map included,
costs about 8 µs of CPU, a sixth of a duplicate's claim), and the seconds its statements wait
for an answer (the store's ``read_timeout``; None: as long as it takes). Only connections a
store holds alone are here, never a caller's (``tx=``), which other threads may share: two
statements on one cursor at once would read each other's rows."""

_IDLE = pq.TransactionStatus.IDLE


def own(conn: Connection, read_timeout: float | None = None) -> None:
    """Give ``conn`` (just checked out by a store, used by it alone) a cursor to reuse, and
    the bound on the wait for its statements' answers (see :mod:`oncely.stores._watchdog`)."""
    _OWN[conn] = (conn.cursor(row_factory=tuple_row), read_timeout)


def disown(conn: Connection) -> None:
    """Forget ``conn``'s reused cursor before the connection goes back to a pool."""
    _OWN.pop(conn, None)


def _cursor(conn: Connection) -> TupleCursor:
    owned = _OWN.get(conn)
    return conn.cursor(row_factory=tuple_row) if owned is None else owned[0]


def _socket_of(conn: Connection) -> int:
    return conn.pgconn.socket


cuts(_Connection, _socket_of)


async def _execute(conn: Connection, sql: bytes, params: Params) -> TupleCursor:
    """Run one statement on ``conn``; the cursor that holds its rows. On a connection the
    store holds alone (:func:`own`) outside a transaction, the wait for the answer lasts at
    most the store's ``read_timeout``: past it the connection is cut and the
    ``OperationalError`` says so. Statements inside a transaction are not watched: one may
    wait on another transaction's row lock for as long as that one runs (the transactional
    mode's repeat waits so for the first request's commit)."""
    owned = _OWN.get(conn)
    if owned is None:
        cursor = conn.cursor(row_factory=tuple_row)
        await cursor.execute(sql, params)
        return cursor
    cursor, seconds = owned
    if seconds is None or conn.pgconn.transaction_status != _IDLE:
        await cursor.execute(sql, params)
        return cursor
    WATCHDOG.start(conn, seconds)
    try:
        await cursor.execute(sql, params)
    except BaseException as exc:
        if WATCHDOG.stop(conn) and isinstance(exc, psycopg.OperationalError):
            raise psycopg.OperationalError(
                f"no answer from the server within {seconds:g}s (read_timeout): the "
                "connection was closed (the server or the network to it may be down)"
            ) from exc
        raise
    WATCHDOG.stop(conn)
    return cursor


_KEEPALIVES = {
    "keepalives": "1",
    "keepalives_idle": "15",
    "keepalives_interval": "5",
    "keepalives_count": "3",
    "tcp_user_timeout": "30000",
}
"""libpq's TCP settings on the connections oncely opens itself, where the connection string
does not say otherwise: a connection whose server is cut off by the network (a dead route: no
reset) is found dead after about 30 s (a keepalive probe unanswered 15 s after the last
traffic, then every 5 s; data unacknowledged for 30 s), instead of the operating system's
defaults (two hours before the first probe, and about 15 minutes of retransmissions). libpq
ignores them where the system lacks them, and on a Unix socket."""


def tcp_defaults(conninfo: str) -> dict[str, Any]:
    """The settings of :data:`_KEEPALIVES` that ``conninfo`` leaves unsaid (and this libpq
    knows), as keyword arguments for psycopg's ``connect``."""
    try:
        given = conninfo_to_dict(conninfo)
    except psycopg.Error:
        return {}  # the connection attempt says what is wrong with it
    known = _libpq_keywords()
    return {k: v for k, v in _KEEPALIVES.items() if k not in given and k in known}


@cache
def _libpq_keywords() -> frozenset[str]:
    return frozenset(opt.keyword.decode() for opt in pq.Conninfo.get_defaults())


def make_pool(
    conninfo: str, *, min_size: int, max_size: int, connect_timeout: timedelta
) -> ConnPool:
    """A closed pool of autocommit connections: each statement oncely runs outside a
    transaction of the caller's commits on its own (one round trip, no BEGIN/COMMIT)."""
    seconds = connect_timeout.total_seconds()
    kwargs: dict[str, Any] = {"autocommit": True, "connect_timeout": max(1, round(seconds))}
    return _ConnectionPool(
        conninfo,
        min_size=min_size,
        max_size=max_size,
        timeout=seconds,
        open=False,
        kwargs={**tcp_defaults(conninfo), **kwargs},
        name="oncely",
    )


if ASYNC:

    async def open_pool(pool: ConnPool) -> None:
        """Open ``pool`` without waiting for its connections, and watch the event loop's end.

        psycopg_pool's workers swallow a cancellation that lands while they open a connection
        (3.3 counts ``CancelledError`` among the errors a connection attempt retries on): the
        worker goes back to waiting for work. ``asyncio.run`` cancels every task when the main
        coroutine returns and waits for them all, so a store nobody closed, whose pool was still
        connecting at that moment, would keep the process alive forever. The watch is a task of
        its own that only the loop's end (or :func:`close_pool`) cancels; it then closes the
        pool, which stops every worker, the one that swallowed its cancellation included.
        """
        await pool.open(wait=False)
        watch = asyncio.get_running_loop().create_task(_close_on_cancel(pool), name="oncely-pool")
        _WATCHES[pool] = watch
        watch.add_done_callback(lambda _task: _WATCHES.pop(pool, None))

    async def close_pool(pool: ConnPool) -> None:
        """Close a pool :func:`open_pool` opened, and its watch."""
        watch = _WATCHES.pop(pool, None)
        if watch is not None:
            watch.cancel()
        await pool.close()

    async def _close_on_cancel(pool: ConnPool) -> None:
        try:
            await asyncio.get_running_loop().create_future()  # never set: only a cancel ends it
        except asyncio.CancelledError:
            if not pool.closed:
                await pool.close(timeout=_CLOSE_TIMEOUT)
            raise

    # Each watch task by its pool (a running task needs a strong reference somewhere).
    _WATCHES: dict[ConnPool, asyncio.Task[None]] = {}
    _CLOSE_TIMEOUT = 5.0  # seconds a closing pool waits for its workers
else:

    def open_pool(pool: ConnPool) -> None:
        """Open ``pool`` without waiting for its connections (its workers are daemon threads:
        a store nobody closed never keeps the process alive)."""
        pool.open(wait=False)

    def close_pool(pool: ConnPool) -> None:
        """Close a pool :func:`open_pool` opened."""
        pool.close()


async def connect(conninfo: str, *, connect_timeout: timedelta) -> Connection:
    """One autocommit connection outside the pool (schema checks: its errors say exactly
    why the server refused, where a pool would only time out)."""
    return await _Connection.connect(
        conninfo,
        autocommit=True,
        connect_timeout=max(1, round(connect_timeout.total_seconds())),
        **tcp_defaults(conninfo),
    )


async def fetchall(conn: Connection, sql: bytes, params: Params = None) -> list[tuple[Any, ...]]:
    """Run one statement and return its rows as tuples (whatever the connection's row
    factory: a caller's connection may have another)."""
    cursor = await _execute(conn, sql, params)
    return await cursor.fetchall()


@contextlib.asynccontextmanager
async def _pipeline(conn: Connection) -> AsyncIterator[None]:
    """``conn.pipeline()``, raising a failed statement's own error. psycopg usually raises it
    from the block; but when its result arrives while the block is still sending (a loaded
    host), the pipeline's exit raises ``PipelineAborted``, an ``OperationalError`` that would
    read as a lost connection, with the statement's error only as its context."""
    try:
        async with conn.pipeline():
            yield
    except psycopg.errors.PipelineAborted as aborted:
        cause = aborted.__context__
        if isinstance(cause, psycopg.Error) and not isinstance(
            cause, psycopg.errors.PipelineAborted
        ):
            raise cause from None
        raise


async def fetchall_unbounded(
    conn: Connection, sql: bytes, params: Params = None
) -> list[tuple[Any, ...]]:
    """:func:`fetchall` whose wait for the answer is never cut (a statement that may take
    long by nature)."""
    cursor = _cursor(conn)
    await cursor.execute(sql, params)
    return await cursor.fetchall()


async def fetchall_after(
    conn: Connection, first: bytes, sql: bytes, params: Params, done: Callable[[], object]
) -> list[tuple[Any, ...]]:
    """Run ``first`` (no parameters, no rows: a ``SAVEPOINT``) and then ``sql`` in one round
    trip, in libpq's pipeline mode, and return ``sql``'s rows. ``done()`` is called as soon as
    ``first`` is known to have succeeded, also when ``sql`` then fails. The pipeline is left
    before the rows are read: one Sync, one wait (reading inside it would add a flush and a
    second wait). Without pipeline support (libpq before 14) the two go one after the other."""
    head = conn.cursor(row_factory=tuple_row)
    if not _PIPELINE:
        await head.execute(first)
        done()
        return await fetchall(conn, sql, params)
    cursor = conn.cursor(row_factory=tuple_row)
    try:
        async with _pipeline(conn):
            await head.execute(first)
            await cursor.execute(sql, params)
    finally:
        result = head.pgresult
        if result is not None and result.status == pq.ExecStatus.COMMAND_OK:
            done()
    return await cursor.fetchall()


async def fetchall_begun(
    conn: Connection, block: Any, sql: bytes, params: Params
) -> list[tuple[Any, ...]]:
    """Enter ``block`` (a psycopg ``Transaction`` of ``conn``, not yet entered: its ``BEGIN``)
    and run ``sql`` in one round trip, in libpq's pipeline mode, and return ``sql``'s rows.
    The block is entered even when the round trip then fails (its ``status`` is no longer
    ``NOT_STARTED``), so the caller ends it as usual: a failed claim rolls the transaction
    back. psycopg lets a block entered inside a pipeline outlive it, and still forbids
    ``conn.commit()`` inside it. Without pipeline support the two go one after the other."""
    if not _PIPELINE:
        await block.__aenter__()
        return await fetchall(conn, sql, params)
    cursor = _cursor(conn)
    async with _pipeline(conn):
        await block.__aenter__()
        await cursor.execute(sql, params)
    return await cursor.fetchall()


async def commit_after(conn: Connection, block: Any, sql: bytes, params: Params) -> None:
    """Run ``sql`` (no rows) and end ``block`` (an entered ``psycopg`` transaction block: its
    ``COMMIT``) in one round trip, in libpq's pipeline mode. When ``sql`` fails the server
    skips the ``COMMIT`` and the transaction is left failed, for the caller to roll back.
    Without pipeline support the two go one after the other."""
    cursor = _cursor(conn)
    if not _PIPELINE:
        await cursor.execute(sql, params)
        await block.__aexit__(None, None, None)
        return
    async with _pipeline(conn):
        await cursor.execute(sql, params)
        await block.__aexit__(None, None, None)


async def execute(conn: Connection, sql: bytes, params: Params = None) -> None:
    """Run one statement (or, without parameters, several) whose rows do not matter."""
    await _execute(conn, sql, params)


def is_connection(obj: object) -> bool:
    return isinstance(obj, _Connection)


def is_pool(obj: object) -> bool:
    return isinstance(obj, _ConnectionPool)


if ASYNC:
    _checking: dict[int, asyncio.Task[None]] = {}
else:
    _checking: set[int] = set()
    _lock = threading.Lock()


def recheck_soon(pool: ConnPool, *, renew: bool = False) -> None:
    """Test the pool's idle connections in the background and replace the dead ones (after
    a server restart every idle connection is dead; without this each would fail one call);
    with ``renew``, replace every connection, idle ones now and lent ones when they come
    back (psycopg_pool 3.3's ``drain``; a plain check before it). At most one check per
    pool at a time; never raises."""
    if ASYNC:
        if id(pool) in _checking:
            return
        try:
            task = asyncio.get_running_loop().create_task(_check(pool, renew))
        except RuntimeError:
            return
        _checking[id(pool)] = task
        task.add_done_callback(lambda _: _checking.pop(id(pool), None))
    else:
        with _lock:
            if id(pool) in _checking:
                return
            _checking.add(id(pool))
        threading.Thread(
            target=_check, args=(pool, renew), name="oncely-pool-check", daemon=True
        ).start()


async def _check(pool: ConnPool, renew: bool) -> None:
    drain = getattr(pool, "drain", None) if renew else None
    if ASYNC:
        with contextlib.suppress(Exception):
            await (drain() if drain is not None else pool.check())
    else:
        try:
            with contextlib.suppress(Exception):
                drain() if drain is not None else pool.check()
        finally:
            with _lock:
                _checking.discard(id(pool))
