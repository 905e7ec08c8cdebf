"""The PostgreSQL store: any number of processes and hosts, both modes, on psycopg 3.

A pool (psycopg_pool) of autocommit connections: outside a transaction each operation is one
statement that commits on its own. A claim is one ``INSERT ... ON CONFLICT DO NOTHING`` that
returns the winner's row in the same statement (:mod:`oncely.stores.postgres.dialect` explains
the statement and the READ COMMITTED snapshot trap it avoids). Lease times come from the
server's ``clock_timestamp()``, never the worker's, unless the store is given a clock.
Joined to a caller's transaction, the savepoint around a message costs no round trip of its
own: its ``SAVEPOINT`` is pipelined with the claim, and it is not released (see
:meth:`AsyncPostgresStore.savepoint`). In the store's own transaction of the inbox's
transactional mode, ``BEGIN`` is pipelined with the claim and a stored result's ``UPDATE``
with the ``COMMIT`` (see :meth:`AsyncPostgresStore.transaction`): the mode adds no round trip
to the handler's.

:class:`AsyncPostgresStore` is one class, in four sections: construction and connections (the
pool, its own or a caller's whose connections it switches to autocommit while it holds them,
and the connections it keeps between operations); schema and maintenance (schema work on a
direct connection whose errors say why the server refused, the purge); the message path (the
claim, the fenced writes); the transactional mode (transactions opened for the caller,
oncely's savepoints in a caller's transaction, checks and writes on a caller's connection,
and ``claim_in``, which shares the claim's code). The reads, ``forget``, the schema check and
the purge's loop are :class:`~oncely.stores.async_sql.SQLStoreBase`'s; the transaction block
and the savepoints' bookkeeping are classes of their own, in
:mod:`oncely.stores.postgres.async_tx`.
"""

from __future__ import annotations

from oncely._twin import ASYNC

if ASYNC:
    from asyncio import sleep
else:
    from time import sleep

import contextlib
import os
import random
import threading
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from contextvars import ContextVar
from datetime import timedelta
from time import monotonic
from typing import Any, Self

import psycopg
from psycopg import pq

from oncely._core.clock import Clock
from oncely._core.records import (
    Claim,
    ClaimRequest,
    ClaimStatus,
    Completion,
    Record,
    Status,
    StoreStats,
)
from oncely._core.state import Lost, claimable
from oncely._core.table import lease_lost, unfenced
from oncely.errors import (
    ConfigurationError,
    LeaseLost,
    StoreError,
    StoreUnavailable,
    TransactionRequired,
)
from oncely.stores._offsets import OffsetSQL, check_position
from oncely.stores._sql import (
    LOGGER,
    SMALL,
    STATUS,
    Estimate,
    durability_warning,
    marker_missing,
    parse_versions,
    plan_rows,
    status_shares,
)
from oncely.stores.async_sql import Position, SQLStoreBase, server_time
from oncely.stores.postgres.async_io import (
    Connection,
    ConnPool,
    close_pool,
    connect,
    disown,
    execute,
    fetchall,
    fetchall_after,
    fetchall_begun,
    fetchall_unbounded,
    is_connection,
    is_pool,
    make_pool,
    open_pool,
    own,
    recheck_soon,
)
from oncely.stores.postgres.async_tx import (
    JOINED,
    OPEN_SAVEPOINTS,
    Joined,
    Savepoint,
    _Transaction,
    joined_on,
)
from oncely.stores.postgres.dialect import (
    SCHEMA_REVISION,
    SCHEMA_VERSION,
    PostgresDialect,
    parse_record,
    text_array,
)
from oncely.stores.postgres.errors import (
    describe,
    is_disconnect,
    is_read_only,
    parse_url,
    translate,
)

__all__ = ["AsyncPostgresStore"]

_TX = pq.TransactionStatus

_DURABILITY = ("synchronous_commit", "fsync")
_READ_DURABILITY = b"SELECT current_setting('synchronous_commit'), current_setting('fsync')"
"""The settings that decide whether a commit the server confirmed survives its crash, read
once when the store is set up (see :func:`~oncely.stores._sql.durability_warning`)."""

# How long the store keeps connections out of its pool before it hands them back (_release).
_KEEP_SECONDS = 60.0

# The operations whose statements are not cut at read_timeout: they may take long by nature
# (an exact count of the table, a page of a scan).
_UNBOUNDED = frozenset({"stats", "scan"})
# How often one claim looks again after a concurrent writer changed the record under it.
_ATTEMPTS = 5

# The purge lead held in this context (task or thread): its store and the connection that
# holds the session lock, on which the run's batches go (purge_leader, _purge_batch).
_LEAD: ContextVar[tuple[object, Connection] | None] = ContextVar("oncely_pg_lead", default=None)
# A B-tree entry holds at most 2704 bytes: (consumer, key) beyond about this many UTF-8 bytes
# cannot be indexed. Refused before the statement, so a caller's transaction is not aborted.
_MAX_IDENTITY_BYTES = 2600
# How often, about, a migrator waiting for another's upgrade tries its lock again (_upgrade).
_LOCK_POLL_S = 0.2
# stats(exact=False) on a table never analyzed reads about this many pages (8 KiB each) of it.
_SAMPLE_PAGES = 2000
# PostgreSQL allocates no value, message or row of more than 1 GB (MaxAllocSize), and the
# store reads rows as text, where a bytea is hex: two characters a byte. A result is kept up to
# half of that, less room for the row's other values; and the results of one complete_many
# statement (an array, one value) are sent in statements of at most _MANY_BYTES together.
_MAX_ALLOC = (1 << 30) - 1
_ROW_ROOM = 64 * 1024
_RESULT_ROOM = (_MAX_ALLOC - _ROW_ROOM) // 2
_ROOM = (
    _RESULT_ROOM,
    "PostgreSQL allocates at most 1 GB for a value, and a result is read back as hex, "
    "twice its size",
)
_MANY_BYTES = 256 * 1024 * 1024


def _check_size(consumer: str, key: str) -> None:
    if len(consumer.encode()) + len(key.encode()) > _MAX_IDENTITY_BYTES:
        raise StoreError(
            f"consumer and key take over {_MAX_IDENTITY_BYTES} bytes, more than a PostgreSQL "
            "index entry holds; lower Limits(max_key_bytes=...) or set hash_long_keys=True"
        )


class AsyncPostgresStore(SQLStoreBase[bytes]):
    """A dedup store in a PostgreSQL table (transactional and two-phase modes).

    ``conninfo`` is a libpq connection string (``postgresql://user:password@host/db`` or
    ``host=... dbname=...``) for a pool the store opens and closes itself, or a psycopg_pool
    pool of yours (the async store takes an ``AsyncConnectionPool``, the threaded one a
    ``ConnectionPool``), which the store uses but never closes (a purge service's run holds
    one of its connections, the lead's, for the whole run: its batches go on that one; give
    the pool a second for the claims meanwhile). The inbox table is
    ``schema.table``; both names are checked and used exactly as given (quoted).

    The schema is created on first use unless ``migrate=False``, in which case a missing
    schema raises :class:`~oncely.SchemaMissing`; a schema written by a newer oncely raises
    :class:`~oncely.SchemaTooNew`. Connection loss, a server restart, timeouts, deadlocks and
    serialization failures raise :class:`~oncely.StoreUnavailable` (retry later); the pool
    replaces broken connections by itself. ``connect_timeout`` bounds both a connection
    attempt and the wait for a free connection of the pool. ``read_timeout`` (10 s; None:
    no bound) bounds the wait for the answer to each statement the store runs on its own
    connections outside a transaction (the message path: claims, completions, renewals,
    releases, reads, the purge's batches; not ``stats()`` and ``scan()``, which may take long
    by nature): past it the connection is closed and the call raises
    :class:`~oncely.StoreUnavailable`, so a server gone silent (a dead route: no reset, no
    refusal) never holds a caller, a thread above all, for longer than ``read_timeout`` per
    statement plus ``connect_timeout`` per connection it waits for. Statements inside a
    transaction (the transactional mode, ``tx=``) are not cut: one may wait on another
    transaction's row lock for as long as that one runs. The connections the store opens
    itself also have libpq's TCP keepalives and ``tcp_user_timeout`` set (a dead peer found
    in about 30 s; see ``_KEEPALIVES`` in :mod:`oncely.stores.postgres.async_io`) where the
    connection string does not set them. With a pool of its own the store
    keeps the connections it has finished with and reuses them (they count towards
    ``pool_max``), handing them back to the pool every minute, when an operation waits for
    one, on a disconnect and on close.

    The asyncio variant belongs to the event loop that first uses it: open one store per loop.
    The threaded variant may be shared by any number of threads. After ``fork`` a child opens
    a pool of its own (never fork in the middle of a transaction).
    """

    _family = "postgresql"

    _SCHEMA_VERSION = SCHEMA_VERSION
    _SCHEMA_REVISION = SCHEMA_REVISION
    _dialect: PostgresDialect

    # ------------------------------------------------------------ construction and connections

    def __init__(
        self,
        conninfo: str | ConnPool,
        *,
        schema: str = "public",
        table: str = "oncely_inbox",
        pool_min: int = 1,
        pool_max: int = 10,
        connect_timeout: timedelta = timedelta(seconds=10),
        read_timeout: timedelta | None = timedelta(seconds=10),
        clock: Clock | None = None,
        migrate: bool = True,
    ) -> None:
        super().__init__(migrate=migrate)
        self._dialect = PostgresDialect(schema, table)
        self._offset_sql = OffsetSQL.postgres(schema, table)
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
        if read_timeout is not None and read_timeout <= timedelta(0):
            raise ConfigurationError("read_timeout must be positive (None: no bound)")
        self._where = where or "PostgreSQL"
        self._url = where
        self._pool_min = pool_min
        self._pool_max = pool_max
        self._connect_timeout = connect_timeout
        self._read_seconds = None if read_timeout is None else read_timeout.total_seconds()
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
            read_timeout=options.read_timeout,
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

    def _error(self, exc: psycopg.Error, doing: str) -> StoreError:
        if is_disconnect(exc) and self._pool is not None:
            self._stale = True  # the kept connections may be dead too (a server restart)
            recheck_soon(self._pool)
        elif is_read_only(exc) and self._pool is not None:
            # Opened while the server was read-only (a failover in progress, a standby),
            # the connections stay read-only once it is writable again: the kept ones are
            # closed and the store's own pool replaces all of its connections. A pool the
            # caller gave is theirs to renew.
            self._stale = True
            if self._given_pool is None:
                recheck_soon(self._pool, renew=True)
        return translate(exc, doing, self._where)

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
        own(conn, self._read_seconds)
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
        """One statement on a pooled connection (one round trip); for ``stats`` and ``scan``,
        which may take long by nature, as long as it takes (not cut at ``read_timeout``)."""
        async with self._connection(doing) as conn:
            try:
                if doing in _UNBOUNDED:
                    return await fetchall_unbounded(conn, sql, params)
                return await fetchall(conn, sql, params)
            except psycopg.Error as exc:
                raise self._error(exc, doing) from exc

    async def aclose(self) -> None:
        self._closed = True
        pool, self._pool = self._pool, None
        if pool is not None and self._given_pool is None and self._pid == os.getpid():
            await self._return_idle(pool)
            await close_pool(pool)

    # ------------------------------------------------------------ schema and maintenance

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

    async def _setup(self, *, migrating: bool) -> None:
        try:
            async with self._admin() as conn:
                version, revision = await self._versions(conn)
                found = (await fetchall(conn, _READ_DURABILITY))[0]
                durability_warning(self._where, dict(zip(_DURABILITY, found, strict=True)))
                if self._tables_needed(version, migrating=migrating):
                    await self._create(conn)
                elif self._upgrade_needed(revision, migrating=migrating):
                    await self._upgrade(conn)
        except psycopg.Error as exc:
            raise self._error(exc, "migrate" if migrating else "opening the store") from exc

    async def _versions(self, conn: Connection) -> tuple[int | None, int]:
        """The schema version (None: no tables) and revision (1 where none is written); an
        inbox table without its version row is a :class:`~oncely.SchemaError` (the tables are
        created in one transaction, with the row)."""
        d = self._dialect
        table, meta, _ = (await fetchall(conn, d.regclass, d.names))[0]
        if not table:
            return None, 1
        versions = (
            parse_versions(await fetchall(conn, d.read_version), self._place) if meta else (None, 1)
        )
        if versions[0] is None:
            meta_name = f"{d.schema}.{d.meta_table}"
            raise marker_missing(self._place, meta_name, self._SCHEMA_VERSION)
        return versions

    async def _version(self, conn: Connection) -> int | None:
        return (await self._versions(conn))[0]

    async def _upgrade(self, conn: Connection) -> None:
        """Bring the table to this revision, online (see the dialect's ``add_purge_column``),
        under a session advisory lock: a second migrator waits, then finds the work done.

        It waits by trying the lock again and again, each try a transaction of a moment:
        blocked in ``pg_advisory_lock`` it would hold a transaction open, which the first
        one's ``CREATE INDEX CONCURRENTLY`` waits for, while it waits for the lock (a
        deadlock, which the server breaks by failing the waiter)."""
        d = self._dialect
        lock = {"key": d.lock_key}
        autocommit = conn.autocommit
        if not autocommit:  # a connection of the caller's pool: CONCURRENTLY needs autocommit
            await conn.set_autocommit(True)
        while not (await fetchall(conn, b"SELECT pg_try_advisory_lock(%(key)s)", lock))[0][0]:
            await sleep(_LOCK_POLL_S * (0.5 + random.random()))
        try:
            async with conn.transaction():
                # ADD COLUMN waits for the table's lock behind running transactions, and
                # every claim would queue behind it: give up after a while instead.
                await execute(conn, b"SET LOCAL lock_timeout = '10s'")
                await execute(conn, d.add_purge_column)
                await execute(conn, d.set_autovacuum)
            index = {"schema": d.schema, "index": d.purge_index}
            valid = await fetchall(conn, d.purge_index_valid, index)
            if valid and not valid[0][0]:  # left invalid by a build that failed
                await execute(conn, d.drop_purge_index)
            await execute(conn, d.create_purge_index)
            await execute(conn, d.set_revision)
        finally:
            await self._unlock(conn, lock, "the migration's lock")
            if not autocommit and not conn.closed:
                await conn.set_autocommit(False)

    async def _unlock(self, conn: Connection, key: Mapping[str, object], what: str) -> None:
        """Let go of a session advisory lock. When the unlock fails the session may still
        hold it, and a pooled connection lent out again would keep it for as long as it lives
        (another process would never lead, or migrate): the connection is closed instead,
        which ends the session and the lock with it (a pool replaces it)."""
        try:
            await fetchall(conn, b"SELECT pg_advisory_unlock(%(key)s)", key)
        except BaseException as exc:
            with contextlib.suppress(psycopg.Error):
                await conn.close()
            if not isinstance(exc, psycopg.Error):
                raise
            LOGGER.warning(
                "oncely store %s: releasing %s failed, its connection was closed to let go "
                "of it: %s", self._where, what, exc,
            )  # fmt: skip

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

    async def _create_offsets(self) -> None:
        """The offsets table, under the migrations' advisory lock (two workers creating it at
        once would otherwise collide in the catalogue)."""
        try:
            async with self._admin() as conn, conn.transaction():
                lock = {"key": self._dialect.lock_key}
                await execute(conn, b"SELECT pg_advisory_xact_lock(%(key)s)", lock)
                await execute(conn, self._offset_sql.create)
        except psycopg.Error as exc:
            raise self._error(exc, "creating the offsets table") from exc

    async def schema_version(self) -> int | None:
        """The schema version in the database, or None when there are no tables yet."""
        return (await self._schema_versions())[0]

    async def schema_revision(self) -> int:
        """The schema revision in the database (1 where none is written, or no tables yet):
        what ``oncely migrate`` reports it upgraded within one schema version."""
        return (await self._schema_versions())[1]

    async def _schema_versions(self) -> tuple[int | None, int]:
        try:
            async with self._admin() as conn:
                return await self._versions(conn)
        except psycopg.Error as exc:
            raise self._error(exc, "reading the schema version") from exc

    @asynccontextmanager
    async def purge_leader(self) -> AsyncIterator[bool]:
        # A session-level advisory lock, on a connection held for the lead: if the process
        # dies, its session ends and the lock with it. The run's batches go on that same
        # connection (_purge_batch): a caller's pool may have no second one to give while
        # this one is held, and every claim would wait for it meanwhile.
        key = {"key": self._dialect.purge_lock_key}
        try:
            async with self._admin() as conn:
                (held,) = (await fetchall(conn, b"SELECT pg_try_advisory_lock(%(key)s)", key))[0]
                if not held:
                    yield False
                    return
                direct = self._given_pool is None  # not pooled: bound its statements here
                if direct:
                    own(conn, self._read_seconds)
                lead = _LEAD.set((self, conn))
                try:
                    yield True
                finally:
                    with contextlib.suppress(ValueError):  # ended in another context
                        _LEAD.reset(lead)
                    if direct:
                        disown(conn)
                    await self._unlock(conn, key, "the purge's lead")
        except psycopg.Error as exc:
            raise self._error(exc, "the purge's lead") from exc

    async def _purge_batch(
        self, after: Position | None, limit: int, pause: float
    ) -> tuple[int, int, Position | None]:
        # One statement takes a batch from the start of the purge_ms index, deletes what
        # expired and moves the rest forward: every batch starts from the start again.
        params = {"now": self._now(), "limit": limit}
        lead = _LEAD.get()
        if lead is None or lead[0] is not self:
            taken, gone, _moved = (await self._rows("purge", self._dialect.purge, params))[0]
            return taken, gone, None
        try:  # in the purge's lead: on the connection that holds it
            taken, gone, _moved = (await fetchall(lead[1], self._dialect.purge, params))[0]
        except psycopg.Error as exc:
            raise self._error(exc, "purge") from exc
        return taken, gone, None

    async def _estimate(self) -> StoreStats:
        # The table's row, then the consumers (skip scan and bounded counts), then the
        # planner's estimate for each larger consumer and, past SMALL, for the expired. A
        # table without statistics (never analyzed) is sampled instead: a few pages.
        d = self._dialect
        place = {"schema": d.schema, "table": d.table, "regclass": d.names["table"]}
        row = (await self._rows("stats", d.estimate_table, {"now": self._now(), **place}))[0]
        now, cur, analyzed, values, freqs, pages, expired = row
        times = {"now": now, "cur": cur}
        found = Estimate(expired=expired)
        for consumer, seen, live in await self._rows("stats", d.estimate_consumers, times):
            found.seen[consumer] = (seen, live)
        if not analyzed:
            percent = min(100.0, 100.0 * _SAMPLE_PAGES / max(pages, 1))
            await self._sample(found, times, percent)
            return found.stats()
        found.shares = status_shares(values, freqs)
        for consumer in found.seen:
            if not found.small(consumer):
                plan = await self._rows("stats", d.plan_consumer, {**times, "consumer": consumer})
                found.big[consumer] = plan_rows(plan[0][0])
        if expired > SMALL:
            plan = await self._rows("stats", d.plan_expired, times)
            found.expired = max(plan_rows(plan[0][0]), expired)
        return found.stats()

    async def _sample(self, found: Estimate, times: dict[str, object], percent: float) -> None:
        """Fill ``found`` from a sample of ``percent`` of the table's pages: the larger
        consumers, the statuses and, past SMALL, the expired."""
        rows = await self._rows("stats", self._dialect.sample, {**times, "percent": percent})
        scale = 100.0 / percent
        live_by: dict[str, float] = {}
        statuses: dict[Status, float] = {}
        dead = 0.0
        for consumer, status, live, n in rows:
            if not live:
                dead += n * scale
                continue
            live_by[consumer] = live_by.get(consumer, 0.0) + n * scale
            statuses[STATUS[status]] = statuses.get(STATUS[status], 0.0) + n
        for consumer in found.seen:
            if not found.small(consumer):
                found.big[consumer] = round(live_by.get(consumer, 0.0))
        if found.expired > SMALL:
            found.expired = max(round(dead), found.expired)
        whole = sum(statuses.values())
        found.shares = {s: n / whole for s, n in statuses.items()} if whole else {}
        found.note = (
            "the table has no statistics yet (never analyzed): a rough estimate from a "
            f"sample of {percent:.3g}% of its pages; ANALYZE (autovacuum runs it) or "
            "--exact for better"
        )

    # ------------------------------------------------------------ the message path

    async def claim(
        self,
        consumer: str,
        key: str,
        *,
        fingerprint: str | None,
        token: str,
        lease_ms: int,
        keep_ms: int,
        takeover: bool,
    ) -> Claim:
        async with self._connection("claim") as conn:
            return await self._claim(
                conn, consumer, key, fingerprint, token, lease_ms, keep_ms, takeover,
                Status.IN_PROGRESS, None,
            )  # fmt: skip

    async def claim_many(
        self,
        consumer: str,
        requests: Sequence[ClaimRequest],
        *,
        lease_ms: int,
        keep_ms: int,
        takeover: bool,
    ) -> list[Claim]:
        if not requests:
            return []
        keys = [r.key for r in requests]
        if 4 * (len(consumer) + max(map(len, keys))) > _MAX_IDENTITY_BYTES:
            for key in keys:  # a UTF-8 character is at most 4 bytes: only then count them
                _check_size(consumer, key)
        fingerprints = [r.fingerprint for r in requests]
        tokens = [r.token for r in requests]
        span = max(keep_ms, lease_ms)
        params = {
            "now": self._now(),
            "consumer": consumer,
            "keys": text_array(keys),
            "fingerprints": text_array(fingerprints),
            "tokens": text_array(tokens),
            "lease": lease_ms,
            "span": span,
        }
        claims: list[Claim] = []
        won: dict[str, Record] = {}  # keys a request of this batch won, and their records
        async with self._connection("claim_many") as conn:
            try:
                rows = await fetchall(conn, self._dialect.claim_many, params)
            except psycopg.Error as exc:
                raise self._error(exc, "claim_many") from exc
            # A row: now, whether the request's own row went in (true), another request's
            # (false) or none (NULL), and, for none, the row visible before the statement.
            for r, row in zip(requests, rows, strict=True):
                now: int = row[0]
                held = won.get(r.key)
                if held is not None:  # an earlier request of the batch holds a fresh lease
                    claims.append(Claim(ClaimStatus.EXISTING, held, now))
                    continue
                if row[1]:  # inserted as sent: the record is built here, not read back
                    record = Record(
                        consumer, r.key, Status.IN_PROGRESS, r.fingerprint, r.token, 1,
                        now, now, now + lease_ms, now + span,
                    )  # fmt: skip
                    claim = Claim(ClaimStatus.NEW, record, now)
                elif row[2] is not None and not claimable(
                    current := parse_record(consumer, r.key, row[2:12]), now, r.fingerprint,
                    takeover,
                ):  # fmt: skip
                    claim = Claim(ClaimStatus.EXISTING, current, now)
                else:
                    # Expired, stale, or inserted by a transaction that committed while this
                    # statement waited (invisible to its snapshot): the one-key path decides.
                    claim = await self._claim(
                        conn, consumer, r.key, r.fingerprint, r.token, lease_ms, keep_ms,
                        takeover, Status.IN_PROGRESS, None,
                    )  # fmt: skip
                if claim.won:
                    won[r.key] = claim.record
                claims.append(claim)
        return claims

    async def _claim(
        self,
        conn: Connection,
        consumer: str,
        key: str,
        fingerprint: str | None,
        token: str,
        lease_ms: int,
        keep_ms: int,
        takeover: bool,
        initial: Status,
        error: str | None,
        savepoint: Savepoint | None = None,
        begin: Any = None,
    ) -> Claim:
        """One claim on ``conn``. With ``savepoint`` (set by :meth:`savepoint`, not yet on
        the server), its ``SAVEPOINT`` goes out with the first statement, in one round trip;
        with ``begin`` (a transaction block of :meth:`transaction` that has sent nothing yet),
        its ``BEGIN`` does."""
        _check_size(consumer, key)
        dialect = self._dialect
        params: dict[str, Any] = {
            "consumer": consumer,
            "key": key,
            "status": initial.value,
            "fingerprint": fingerprint,
            "token": token,
            "lease": lease_ms if initial is Status.IN_PROGRESS else 0,
            "span": max(keep_ms, lease_ms),
            "error": error,
        }
        try:
            for _ in range(_ATTEMPTS):
                params["now"] = self._now()
                if savepoint is not None:
                    rows = await fetchall_after(
                        conn, savepoint.sql, dialect.claim_joined, params, savepoint.established
                    )
                    if rows:
                        savepoint.stamp = rows[0][12]
                    savepoint = None
                elif begin is not None:
                    rows = await fetchall_begun(conn, begin, dialect.claim, params)
                    begin = None
                else:
                    rows = await fetchall(conn, dialect.claim, params)
                if not rows:
                    # The key's row was inserted by a transaction that committed while this
                    # statement waited for it (invisible to the statement's snapshot), or it
                    # vanished: a new statement takes a new snapshot.
                    continue
                row = rows[0]
                now: int = row[11]
                current = parse_record(consumer, key, row[1:11])
                if row[0]:
                    return Claim(ClaimStatus.NEW, current, now)
                if not claimable(current, now, fingerprint, takeover):
                    return Claim(ClaimStatus.EXISTING, current, now)
                params["seen"] = current.token
                params["takeover"] = takeover
                rows = await fetchall(conn, dialect.replace, params)
                if rows:
                    record = parse_record(consumer, key, rows[0][:10])
                    won = ClaimStatus.NEW if record.attempt == 1 else ClaimStatus.TAKEN_OVER
                    return Claim(won, record, rows[0][10])
                # Another claim changed the record between the read and the write: look again.
        except psycopg.Error as exc:
            raise self._error(exc, "claim") from exc
        raise StoreUnavailable(f"claim of key {key!r} kept racing with other claims; retry later")

    async def takeover(
        self,
        consumer: str,
        key: str,
        *,
        expected_token: str,
        fingerprint: str | None,
        token: str,
        lease_ms: int,
        keep_ms: int,
    ) -> Claim:
        params = {
            "now": self._now(),
            "consumer": consumer,
            "key": key,
            "token": expected_token,
            "new_token": token,
            "fingerprint": fingerprint,
            "lease": lease_ms,
            "span": max(keep_ms, lease_ms),
        }
        async with self._connection("takeover") as conn:
            try:
                rows = await fetchall(conn, self._dialect.takeover, params)
            except psycopg.Error as exc:
                raise self._error(exc, "takeover") from exc
            if rows:
                record = parse_record(consumer, key, rows[0][:10])
                return Claim(ClaimStatus.TAKEN_OVER, record, rows[0][10])
            return await self._claim(
                conn, consumer, key, fingerprint, token, lease_ms, keep_ms, False,
                Status.IN_PROGRESS, None,
            )  # fmt: skip

    async def _fenced(
        self,
        op: str,
        sql: bytes,
        done: Status | None,
        consumer: str,
        key: str,
        token: str,
        values: dict[str, Any],
    ) -> Record:
        """Run a write that only applies while ``token`` owns the record; otherwise raise
        :class:`~oncely.LeaseLost` with the current record. A repeat of a write that already
        landed (same token, status ``done``) returns the record unchanged."""
        params = {"now": self._now(), "consumer": consumer, "key": key, "token": token, **values}
        async with self._connection(op) as conn:
            try:
                rows = await fetchall(conn, sql, params)
                if rows:
                    return parse_record(consumer, key, rows[0])
                params["now"] = self._now()
                rows = await fetchall(conn, self._dialect.get, params)
            except psycopg.Error as exc:
                raise self._error(exc, op) from exc
        return unfenced(
            op, consumer, key, token, done, parse_record(consumer, key, rows[0]) if rows else None
        )

    async def complete(
        self,
        consumer: str,
        key: str,
        *,
        token: str,
        result: bytes | None,
        keep_ms: int,
        note: str | None = None,
    ) -> Record:
        values = {"keep": keep_ms, "result": result, "note": note}
        return await self._fenced(
            "complete", self._dialect.complete, Status.COMPLETED, consumer, key, token, values
        )

    def result_room(self) -> tuple[int, str]:
        """The most bytes an encoded result may have for this store to keep it, and why (a
        larger one is completed without it, as one over ``Limits.max_result_bytes``)."""
        return _ROOM

    async def complete_many(
        self, consumer: str, completions: Sequence[Completion], *, keep_ms: int
    ) -> list[Record | LeaseLost]:
        """One statement for the batch; or, when its results together are over
        ``_MANY_BYTES``, one for each run of completions within it (their array is one value,
        which PostgreSQL bounds at 1 GB)."""
        done: list[Record | LeaseLost] = []
        start, size = 0, 0
        for i, c in enumerate(completions):
            more = len(c.result) if c.result is not None else 0
            if i > start and size + more > _MANY_BYTES:
                done += await self._complete_many(consumer, completions[start:i], keep_ms)
                start, size = i, 0
            size += more
        return done + await self._complete_many(consumer, completions[start:], keep_ms)

    async def _complete_many(
        self, consumer: str, completions: Sequence[Completion], keep_ms: int
    ) -> list[Record | LeaseLost]:
        if not completions:
            return []
        params = {
            "now": self._now(),
            "consumer": consumer,
            "keys": text_array([c.key for c in completions]),
            "tokens": text_array([c.token for c in completions]),
            "results": [c.result for c in completions],
            "notes": text_array([c.note for c in completions]),
            "keep": keep_ms,
        }
        async with self._connection("complete_many") as conn:
            try:
                rows = await fetchall(conn, self._dialect.complete_many, params)
            except psycopg.Error as exc:
                raise self._error(exc, "complete_many") from exc
        written = {(row[0], row[3]): parse_record(consumer, row[0], row[1:]) for row in rows}
        done: list[Record | LeaseLost] = []
        for c in completions:
            record = written.pop((c.key, c.token), None)
            if record is None:  # not this statement's write: a lone complete decides
                try:
                    record = await self.complete(
                        consumer, c.key, token=c.token, result=c.result, keep_ms=keep_ms,
                        note=c.note,
                    )  # fmt: skip
                except LeaseLost as lost:
                    done.append(lost)
                    continue
            done.append(record)
        return done

    async def fail(
        self, consumer: str, key: str, *, token: str, error: str, keep_ms: int
    ) -> Record:
        values = {"keep": keep_ms, "error": error}
        return await self._fenced(
            "fail", self._dialect.fail, Status.FAILED, consumer, key, token, values
        )

    async def renew(
        self, consumer: str, key: str, *, token: str, lease_ms: int, keep_ms: int
    ) -> Record:
        values = {"lease": lease_ms, "span": max(keep_ms, lease_ms)}
        return await self._fenced("renew", self._dialect.renew, None, consumer, key, token, values)

    async def release(self, consumer: str, key: str, *, token: str) -> bool:
        return await self._delete("release", self._dialect.release, consumer, key, token)

    async def forget_by_token(self, consumer: str, key: str, *, token: str) -> bool:
        return await self._delete("forget", self._dialect.forget_by_token, consumer, key, token)

    async def _delete(
        self, what: str, statement: bytes, consumer: str, key: str, token: str
    ) -> bool:
        """Run a fenced delete (``release`` or ``forget_by_token``): True when it deleted,
        False when there was no record, :class:`~oncely.LeaseLost` with the record that
        stays otherwise."""
        params = {"now": self._now(), "consumer": consumer, "key": key, "token": token}
        async with self._connection(what) as conn:
            try:
                if await fetchall(conn, statement, params):
                    return True
                params["now"] = self._now()
                rows = await fetchall(conn, self._dialect.get, params)
            except psycopg.Error as exc:
                raise self._error(exc, what) from exc
        if not rows:
            return False
        raise lease_lost(what, consumer, key, Lost(parse_record(consumer, key, rows[0])))

    # ------------------------------------------------------------ transactional mode (R7)

    def transaction(self, *, claim_first: bool = False) -> _Transaction:
        """A transaction on a pooled connection. With ``claim_first`` (the block's first
        statement is :meth:`claim_in`, as in :meth:`Inbox.handle_in_transaction
        <oncely.AsyncInbox.handle_in_transaction>`), its ``BEGIN`` is not sent on entry but
        with that claim, in one pipeline: the transaction costs no round trip of its own."""
        return _Transaction(self, claim_first)

    @asynccontextmanager
    async def savepoint(self, tx: Connection) -> AsyncIterator[None]:
        """A savepoint around the store's work in ``tx``, at no extra round trip when the
        block succeeds.

        Nothing is sent on entry: the ``SAVEPOINT`` goes out in one round trip with the
        first statement the store runs inside the block (the claim of :meth:`claim_in`,
        pipelined), so a block in which the store runs nothing sets none. When the block
        raises, the transaction is rolled back to it (one round trip). Either way it is then
        left open, not released: the enclosing transaction (or savepoint) takes its work over
        when it ends, exactly as a RELEASE would have, and no round trip is spent.

        ``ROLLBACK TO`` names the most recent savepoint of a name, and one left open may
        still be there: a savepoint is named after the number of oncely's blocks open on
        ``tx`` around it, so none created while it is open has its name, and a rollback to it
        (which also drops every savepoint opened inside it) finds it. The names being few,
        psycopg's statement cache does not churn (and it clears its prepared statements only
        the first time it sees a rollback text). At most ``OPEN_SAVEPOINTS`` are left open
        per caller transaction (told apart by their start time); past that each is released
        as its block ends.
        """
        joined = joined_on(tx)
        if joined.pending is not None:  # an enclosing block has sent nothing yet: set it first
            await self._establish(tx, joined)
        depth = joined.depth
        point = Savepoint(depth)
        joined.pending = point
        joined.depth = depth + 1
        try:
            yield
        except BaseException:
            if joined.pending is point:
                joined.pending = None  # never set: the store did nothing to undo
            elif point.set:
                await self._run(tx, b"ROLLBACK TO SAVEPOINT " + point.name, "rollback to savepoint")
                joined.kept = min(joined.kept, point.base)  # those opened inside it are gone
                await self._leave(tx, joined, point)
            raise
        else:
            if joined.pending is point:
                joined.pending = None
            elif point.set:
                await self._leave(tx, joined, point)
        finally:
            joined.depth = depth

    async def _leave(self, tx: Connection, joined: Joined, point: Savepoint) -> None:
        """Leave a savepoint open at the end of its block, or release it past the bound."""
        if joined.kept < OPEN_SAVEPOINTS:
            joined.kept += 1
        else:
            await self._run(tx, b"RELEASE SAVEPOINT " + point.name, "release savepoint")

    async def _establish(self, tx: Connection, joined: Joined) -> None:
        """Send the pending ``SAVEPOINT`` on its own (the store is about to run something
        other than a claim in its block)."""
        point = joined.pending
        assert point is not None
        joined.pending = None
        await self._run(tx, point.sql, "savepoint")
        point.established()
        point.base = joined.kept

    async def _run(self, tx: Connection, sql: bytes, op: str, params: Any = None) -> None:
        try:
            await execute(tx, sql, params)
        except psycopg.Error as exc:
            raise self._error(exc, op) from exc

    def in_transaction(self, tx: Connection) -> bool:
        """Whether ``tx`` is inside a transaction now (not merely able to start one)."""
        return tx.info.transaction_status in (_TX.INTRANS, _TX.INERROR)

    async def _fetch_on(self, conn: Connection, sql: str) -> list[Any]:
        try:
            return await fetchall(conn, sql.encode())
        except psycopg.Error as exc:
            raise self._error(exc, "reading which database the connection is on") from exc

    def check_transaction(self, tx: Connection) -> None:
        if not is_connection(tx):
            raise TransactionRequired(
                f"{type(self).__name__} joins a psycopg connection of its kind (sync or "
                f"asyncio), not {type(tx).__name__}"
            )
        status = tx.info.transaction_status
        if status == _TX.INTRANS or (status == _TX.IDLE and not tx.autocommit):
            return  # without autocommit, psycopg opens the transaction at the first statement
        if status == _TX.INERROR:
            raise TransactionRequired(
                "the connection's transaction failed earlier (a statement raised): roll it back"
            )
        if status == _TX.UNKNOWN or tx.closed:
            raise StoreUnavailable("the connection is closed or broken")
        if status == _TX.ACTIVE:
            raise TransactionRequired("a statement is still running on the connection")
        raise TransactionRequired(
            "the connection is in autocommit mode with no open transaction: open one with "
            "`conn.transaction()`, or call without tx= to let oncely open and commit one"
        )

    async def claim_in(
        self,
        tx: Connection,
        consumer: str,
        key: str,
        *,
        fingerprint: str | None,
        token: str,
        keep_ms: int,
        takeover: bool,
        initial: Status = Status.COMPLETED,
        error: str | None = None,
    ) -> Claim:
        if not self._ready:
            await self._prepare()
        joined = JOINED.get(tx)
        if joined is None:
            return await self._claim(
                tx, consumer, key, fingerprint, token, 0, keep_ms, takeover, initial, error
            )
        begin = joined.begin
        if begin is not None:  # oncely's own transaction, not begun yet: BEGIN goes with it
            joined.begin = None
            return await self._claim(
                tx, consumer, key, fingerprint, token, 0, keep_ms, takeover, initial, error,
                None, begin,
            )  # fmt: skip
        point = joined.pending
        if point is None:
            return await self._claim(
                tx, consumer, key, fingerprint, token, 0, keep_ms, takeover, initial, error
            )
        joined.pending = None
        try:
            return await self._claim(
                tx, consumer, key, fingerprint, token, 0, keep_ms, takeover, initial, error,
                point,
            )  # fmt: skip
        finally:
            if point.set:
                if point.stamp is not None and point.stamp != joined.stamp:
                    joined.stamp, joined.kept = point.stamp, 0  # a new transaction
                point.base = joined.kept

    async def set_result_in(
        self, tx: Connection, consumer: str, key: str, *, token: str, result: bytes | None
    ) -> None:
        params = {"consumer": consumer, "key": key, "token": token, "result": result}
        joined = JOINED.get(tx)
        if joined is not None:
            begin = joined.begin
            if begin is not None:  # a transaction whose claim never ran: begin it now
                joined.begin = None
                await begin.__aenter__()
            if joined.own and not joined.depth and joined.result is None:
                # The store's own transaction, outside any savepoint of a nested message:
                # the UPDATE goes out with its COMMIT.
                joined.result = params
                return
            if joined.pending is not None:
                await self._establish(tx, joined)
        await self._run(tx, self._dialect.set_result, "storing the result", params)

    async def save_offset_in(
        self, tx: Connection, consumer: str, stream: str, part: int, next_offset: int
    ) -> None:
        """Keep ``next_offset`` as the offset to read next of ``stream``'s partition ``part``,
        in ``tx`` (it never moves back). :meth:`offsets` reads it."""
        check_position(stream, part, next_offset, consumer=consumer)
        joined = JOINED.get(tx)
        if joined is not None:
            begin = joined.begin
            if begin is not None:
                joined.begin = None
                await begin.__aenter__()
            if joined.pending is not None:
                await self._establish(tx, joined)
        o = self._offset_sql
        params = o.params(consumer, stream, part=part, next=next_offset)
        await self._run(tx, o.save, "storing the offset", params)
