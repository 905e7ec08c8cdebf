"""The PostgreSQL store's construction, connections, schema and maintenance.

:class:`PostgresStoreBase`: the pool (its own, or a caller's whose connections it switches to
autocommit while it holds them), schema work on a direct connection whose errors say why the
server refused, the purge, closing. How the store's modules divide the work is told in
``sql_base``.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from datetime import timedelta
from time import monotonic
from typing import Any, Self

import psycopg
from psycopg import pq

from oncely._core.clock import Clock
from oncely.errors import ConfigurationError, StoreError
from oncely.stores.async_sql import Position, SQLStoreBase, server_time
from oncely.stores.postgres.async_io import (
    Connection,
    ConnPool,
    close_pool,
    connect,
    disown,
    execute,
    fetchall,
    is_pool,
    make_pool,
    open_pool,
    own,
    recheck_soon,
)
from oncely.stores.postgres.dialect import SCHEMA_VERSION, PostgresDialect
from oncely.stores.postgres.errors import describe, is_disconnect, parse_url, translate

__all__ = ["PostgresStoreBase"]

_TX = pq.TransactionStatus

# How long the store keeps connections out of its pool before it hands them back (_release).
_KEEP_SECONDS = 60.0


class PostgresStoreBase(SQLStoreBase[bytes]):
    """Construction and plumbing of :class:`~oncely.AsyncPostgresStore` (see there)."""

    _SCHEMA_VERSION = SCHEMA_VERSION
    _dialect: PostgresDialect

    def __init__(
        self,
        conninfo: str | ConnPool,
        *,
        schema: str = "public",
        table: str = "oncely_inbox",
        pool_min: int = 1,
        pool_max: int = 10,
        connect_timeout: timedelta = timedelta(seconds=10),
        clock: Clock | None = None,
        migrate: bool = True,
    ) -> None:
        super().__init__(migrate=migrate)
        self._dialect = PostgresDialect(schema, table)
        if isinstance(conninfo, str):
            self._conninfo = conninfo
            self._given_pool: ConnPool | None = None
            where = describe(conninfo)
        elif is_pool(conninfo):
            self._conninfo = ""
            self._given_pool = conninfo
            where = describe(conninfo.conninfo) if isinstance(conninfo.conninfo, str) else ""
        else:
            raise ConfigurationError(
                f"{type(self).__name__} takes a connection string or a psycopg_pool "
                f"pool of its kind, not {type(conninfo).__name__}"
            )
        if pool_min < 0 or pool_max < 1 or pool_min > pool_max:
            raise ConfigurationError("need 0 <= pool_min <= pool_max and pool_max >= 1")
        self._where = where or "PostgreSQL"
        self._url = where
        self._pool_min = pool_min
        self._pool_max = pool_max
        self._connect_timeout = connect_timeout
        self._now = clock.now_ms if clock is not None else server_time
        self._pool: ConnPool | None = self._given_pool
        self._pid = os.getpid()
        # Connections of a caller's pool in autocommit=False mode, switched for oncely's use.
        self._restore: set[int] = set()
        # The store's own pool only: connections it finished with, kept out of the pool and
        # reused last-in first-out (see _release).
        self._idle: list[Connection] = []
        self._idle_since = monotonic()
        self._stale = False  # a disconnect was seen: the kept connections may be dead
        # Callers waiting for the pool: while any is, a released connection goes to the pool,
        # never to _idle, where none of them would see it. The lock makes "look at _idle,
        # else count myself waiting" and "look at the count, else keep" atomic between
        # threads; it is never held across an await.
        self._waiting = 0
        self._keep_lock = threading.Lock()

    def _forget_parent(self) -> None:
        super()._forget_parent()
        self._keep_lock = threading.Lock()
        self._waiting = 0

    @classmethod
    def from_url(cls, url: str, *, clock: Clock | None = None) -> Self:
        """A store for a ``postgresql://`` or ``postgres://`` URL (see :func:`oncely.open`)."""
        options = parse_url(url)
        store = cls(
            options.conninfo,
            schema=options.schema,
            table=options.table,
            pool_min=options.pool_min,
            pool_max=options.pool_max,
            connect_timeout=options.connect_timeout,
            clock=clock,
            migrate=options.migrate,
        )
        store._url = describe(url)  # with oncely's options, as given
        return store

    @property
    def url(self) -> str:
        return self._url

    @property
    def table(self) -> str:
        """The inbox table as ``schema.table``."""
        return f"{self._dialect.schema}.{self._dialect.table}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._url!r}, table={self.table!r})"

    @property
    def _place(self) -> str:
        return f"table {self.table} in {self._where}"

    # ------------------------------------------------------------------ connections

    def _error(self, exc: psycopg.Error, doing: str) -> StoreError:
        if is_disconnect(exc) and self._pool is not None:
            self._stale = True  # the kept connections may be dead too (a server restart)
            recheck_soon(self._pool)
        return translate(exc, doing, self._where)

    @asynccontextmanager
    async def _admin(self) -> AsyncIterator[Connection]:
        """A connection for schema work: the caller's pool, or a direct connection whose
        errors say why the server refused (a pool would only time out)."""
        if self._given_pool is not None:
            conn = await self._checkout(self._given_pool)
            try:
                yield conn
            finally:
                await self._checkin(self._given_pool, conn)
            return
        conn = await connect(self._conninfo, connect_timeout=self._connect_timeout)
        try:
            yield conn
        finally:
            await conn.close()

    async def _prepare(self) -> None:
        # SQLStoreBase._prepare, and the pool: made on first use, and again in a forked child.
        async with self._ready_lock:
            if self._closed:
                raise self._closed_error()
            if not self._ready:
                await self._setup(migrating=False)
                self._ready = True
            forked, self._pid = self._pid != os.getpid(), os.getpid()
            if forked:
                self._idle = []  # the parent's: never used, never closed, by a child
            if self._given_pool is None and (self._pool is None or forked):
                # A forked child never touches its parent's connections (they share sockets
                # with the parent); psycopg does not close them when they are collected.
                self._pool = make_pool(
                    self._conninfo,
                    min_size=self._pool_min,
                    max_size=self._pool_max,
                    connect_timeout=self._connect_timeout,
                )
                await open_pool(self._pool)

    async def _setup(self, *, migrating: bool) -> None:
        try:
            async with self._admin() as conn:
                if self._tables_needed(await self._version(conn), migrating=migrating):
                    await self._create(conn)
        except psycopg.Error as exc:
            raise self._error(exc, "migrate" if migrating else "opening the store") from exc

    async def _version(self, conn: Connection) -> int | None:
        d = self._dialect
        table, meta, _ = (await fetchall(conn, d.regclass, d.names))[0]
        rows = await fetchall(conn, d.read_version) if meta else []
        return int(rows[0][0]) if rows and table else None

    async def _create(self, conn: Connection) -> None:
        """Create the tables under an advisory lock, so that processes migrating at the same
        moment take turns; the second finds the work done."""
        d = self._dialect
        async with conn.transaction():
            await execute(conn, b"SELECT pg_advisory_xact_lock(%(key)s)", {"key": d.lock_key})
            schema_exists = (await fetchall(conn, d.regclass, d.names))[0][2]
            # CREATE SCHEMA IF NOT EXISTS needs the CREATE privilege on the database even when
            # the schema exists: only ask for it when the schema is really missing.
            for statement in d.create[1:] if schema_exists else d.create:
                await execute(conn, statement)

    async def _acquire(self, doing: str) -> Connection:
        if not self._ready or self._pool is None or self._pid != os.getpid():
            await self._prepare()
        pool = self._pool
        assert pool is not None
        if self._stale and self._idle:
            await self._return_idle(pool, close=True)
        with self._keep_lock:
            if self._idle and not self._stale:
                return self._idle.pop()
            self._waiting += 1
        try:
            return await self._checkout(pool)
        except psycopg.Error as exc:
            raise self._error(exc, doing) from exc
        finally:
            with self._keep_lock:
                self._waiting -= 1

    async def _release(self, conn: Connection) -> None:
        """Give ``conn`` back. A connection of the store's own pool that is idle and sound is
        kept for the next operation instead: taking one from psycopg_pool and returning it
        (locks, a status check, statistics, logging) costs about 14 µs of CPU per operation
        right after a round trip, as much as a sixth of a duplicate's claim, and a list pop
        costs nearly nothing. Kept connections stay checked out of the pool (they count
        towards ``pool_max``, and an operation that finds none kept takes one from the pool
        as before); while an operation waits for the pool, released connections go to the
        pool, so nobody waits for a connection kept idle. Every minute they go back to it all
        at once, so its checks and its ``max_lifetime`` still reach them, as they do on a
        disconnect error and on close."""
        pool = self._pool
        if pool is None:
            return
        if self._stale:
            await self._checkin(pool, conn)
            await self._return_idle(pool, close=True)
            return
        expired = monotonic() - self._idle_since >= _KEEP_SECONDS
        if (
            not expired
            and self._given_pool is None
            and not conn.closed
            and conn.info.transaction_status == _TX.IDLE
        ):
            with self._keep_lock:
                if not self._waiting:
                    self._idle.append(conn)
                    return
        await self._checkin(pool, conn)
        if expired:  # kept for a minute: back to the pool, for its checks and lifetime
            await self._return_idle(pool)

    async def _return_idle(self, pool: ConnPool, *, close: bool = False) -> None:
        """Hand every kept connection back to the pool; with ``close`` (after a disconnect)
        closed first, so the pool replaces them instead of lending out a dead one. One pop at
        a time, under the lock: threads doing this at once never hand back the same
        connection twice."""
        self._idle_since = monotonic()
        if close:
            self._stale = False
        while True:
            with self._keep_lock:  # _acquire's look-then-pop must not lose a race to this
                if not self._idle:
                    return
                conn = self._idle.pop()
            disown(conn)
            if close:
                with contextlib.suppress(psycopg.Error):
                    await conn.close()
            await pool.putconn(conn)

    async def _checkout(self, pool: ConnPool) -> Connection:
        conn: Connection = await pool.getconn()
        if not conn.autocommit:  # a caller's pool: oncely's statements commit on their own
            try:
                await conn.set_autocommit(True)
            except BaseException:
                await pool.putconn(conn)
                raise
            self._restore.add(id(conn))
        own(conn)
        return conn

    async def _checkin(self, pool: ConnPool, conn: Connection) -> None:
        disown(conn)
        if self._restore and id(conn) in self._restore:
            self._restore.discard(id(conn))
            if conn.info.transaction_status == _TX.IDLE:
                # A broken connection cannot switch back: the pool discards it anyway.
                with contextlib.suppress(psycopg.Error):
                    await conn.set_autocommit(False)
        await pool.putconn(conn)  # rolls back anything left open, drops it if broken

    @asynccontextmanager
    async def _connection(self, doing: str) -> AsyncIterator[Connection]:
        conn = await self._acquire(doing)
        try:
            yield conn
        finally:
            await self._release(conn)

    async def _rows(self, doing: str, sql: bytes, params: Mapping[str, object]) -> list[Any]:
        """One statement on a pooled connection (one round trip)."""
        async with self._connection(doing) as conn:
            try:
                return await fetchall(conn, sql, params)
            except psycopg.Error as exc:
                raise self._error(exc, doing) from exc

    async def _purge_batch(
        self, after: Position | None, limit: int
    ) -> tuple[int, int, Position | None]:
        # One statement deletes the batch and says how many and the last key it deleted.
        start = after if after is not None else ("", "")
        params = {
            "now": self._now(),
            "limit": limit,
            "after_consumer": start[0],
            "after_key": start[1],
        }
        rows = await self._rows("purge", self._dialect.purge, params)
        if not rows:
            return 0, 0, after
        count, last_consumer, last_key = rows[0]
        return count, count, (last_consumer, last_key)

    async def schema_version(self) -> int | None:
        """The schema version in the database, or None when there are no tables yet."""
        try:
            async with self._admin() as conn:
                return await self._version(conn)
        except psycopg.Error as exc:
            raise self._error(exc, "reading the schema version") from exc

    async def aclose(self) -> None:
        self._closed = True
        pool, self._pool = self._pool, None
        if pool is not None and self._given_pool is None and self._pid == os.getpid():
            await self._return_idle(pool)
            await close_pool(pool)
