"""The MariaDB / MySQL store's construction, connections, schema and maintenance.

:class:`MySQLStoreBase`: the pool, running work on an autocommit connection with a bounded
retry of deadlock victims (:meth:`MySQLStoreBase._run`, which every operation runs through),
the schema, the purge, closing. How the store's modules divide the work is told in
``sql_base``.
"""

from __future__ import annotations

import itertools
import random
import weakref
from collections.abc import Awaitable, Callable, Mapping
from datetime import timedelta
from functools import partial
from typing import Any, Self, TypeVar

from oncely._core.clock import Clock
from oncely.stores.async_sql import Position, SQLStoreBase, server_time
from oncely.stores.mysql.async_io import (
    AsyncPool,
    Connection,
    close,
    connect,
    execute,
    fetchall,
    sleep,
)
from oncely.stores.mysql.dialect import SCHEMA_VERSION, MySQLDialect, who
from oncely.stores.mysql.errors import (
    DRIVER_ERRORS,
    NO_SUCH_TABLE,
    MySQLSettings,
    autocommits,
    code_of,
    disconnected,
    in_transaction,
    parse_url,
    retries_for,
    translate,
)

__all__ = ["MySQLStoreBase"]

T = TypeVar("T")

_BACKOFF_S = 0.005  # doubled per retry of a deadlock victim, jittered
# Numbers the stores of the process: each names its savepoints apart from the others'.
_STORES = itertools.count(1)


class MySQLStoreBase(SQLStoreBase[str]):
    """Construction and plumbing of :class:`~oncely.AsyncMySQLStore` (see there)."""

    _SCHEMA_VERSION = SCHEMA_VERSION
    _dialect: MySQLDialect

    def __init__(
        self,
        database: str,
        *,
        host: str = "localhost",
        port: int = 3306,
        user: str | None = None,
        password: str | None = None,
        unix_socket: str | None = None,
        table: str = "oncely_inbox",
        pool_size: int = 4,
        connect_timeout: timedelta = timedelta(seconds=10),
        lock_timeout: timedelta | None = None,
        clock: Clock | None = None,
        migrate: bool = True,
    ) -> None:
        super().__init__(migrate=migrate)
        if pool_size < 1:
            raise ValueError("pool_size must be at least 1")
        self._settings = MySQLSettings(
            database=database,
            host=host,
            port=port,
            user=user,
            password=password,
            unix_socket=unix_socket,
            connect_timeout=connect_timeout,
            lock_timeout=lock_timeout,
        )
        self._dialect = MySQLDialect(table, server_clock=clock is None)
        self._now = clock.now_ms if clock is not None else server_time
        self._pool = AsyncPool(self._open, pool_size)
        # The transactional mode's savepoints (mysql_tx): how many of this store's savepoint
        # blocks are open on each caller connection, and the prefix of their names.
        self._depth: weakref.WeakKeyDictionary[Connection, int] = weakref.WeakKeyDictionary()
        self._savepoint_prefix = f"oncely_{next(_STORES)}_"

    @classmethod
    def from_url(cls, url: str, *, clock: Clock | None = None) -> Self:
        """A store for a ``mysql://`` or ``mariadb://`` URL (see :func:`oncely.open`)."""
        options = parse_url(url)
        s = options.settings
        return cls(
            s.database,
            host=s.host,
            port=s.port,
            user=s.user,
            password=s.password,
            unix_socket=s.unix_socket,
            table=options.table,
            pool_size=options.pool_size,
            connect_timeout=s.connect_timeout,
            lock_timeout=s.lock_timeout,
            clock=clock,
            migrate=options.migrate,
        )

    @property
    def url(self) -> str:
        return self._settings.url(self._dialect.table)

    @property
    def table(self) -> str:
        return self._dialect.table

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    @property
    def _place(self) -> str:
        return f"table {self._dialect.table} in {self.url}"

    # ------------------------------------------------------------------ connections

    async def _open(self) -> Connection:
        try:
            return await connect(self._settings)
        except DRIVER_ERRORS as exc:
            raise translate(exc, f"connecting to {self.url}") from exc

    async def _setup(self, *, migrating: bool) -> None:
        conn = await self._pool.acquire()
        try:
            version = await self._version(conn)
            # migrate runs the CREATE ... IF NOT EXISTS again whatever the version: the
            # version row says nothing of the inbox table itself.
            if self._tables_needed(version, migrating=migrating) or migrating:
                await self._create(conn)
        finally:
            await self._release(conn)

    async def _version(self, conn: Connection) -> int | None:
        try:
            rows = await fetchall(conn, self._dialect.read_version)
        except DRIVER_ERRORS as exc:
            if code_of(exc) == NO_SUCH_TABLE:
                return None
            raise translate(exc, "reading the schema version") from exc
        return int(rows[0][0]) if rows else None

    async def _create(self, conn: Connection) -> None:
        # CREATE TABLE IF NOT EXISTS and the upsert of the version row are safe when several
        # processes migrate at once: the data dictionary lock orders them.
        try:
            for statement in self._dialect.create:
                await execute(conn, statement)
        except DRIVER_ERRORS as exc:
            raise translate(exc, "creating the tables") from exc

    async def _acquire(self) -> Connection:
        if self._closed:
            raise self._closed_error()
        if not self._ready:
            await self._prepare()
        return await self._pool.acquire()

    async def _release(self, conn: Connection, *, discard: bool = False) -> None:
        """Return a connection, rolling back anything an interrupted operation left open. One
        a handler turned autocommit off on is dropped: oncely's own writes on it would wait
        for a COMMIT that never comes."""
        if not autocommits(conn):
            discard = True
        if not discard and in_transaction(conn):
            try:
                await execute(conn, "ROLLBACK")
            except DRIVER_ERRORS:
                discard = True
        await self._pool.release(conn, discard=discard)

    async def _run(self, op: str, work: Callable[[Connection], Awaitable[T]]) -> T:
        """``work`` on a pooled autocommit connection. A deadlock victim or a lock wait
        timeout was rolled back whole by InnoDB, so the work is run again (a bounded number
        of times); any other driver error is translated at once."""
        conn = await self._acquire()
        discard = False
        try:
            tries = 0
            while True:
                try:
                    return await work(conn)
                except DRIVER_ERRORS as exc:
                    tries += 1
                    if tries <= retries_for(exc):
                        await sleep(_BACKOFF_S * 2**tries * random.random())
                        continue
                    discard = disconnected(exc)
                    raise translate(exc, op) from exc
        finally:
            await self._release(conn, discard=discard)

    async def _rows(self, op: str, sql: str, params: Mapping[str, object]) -> list[Any]:
        return await self._run(op, lambda conn: fetchall(conn, sql, params))

    async def aclose(self) -> None:
        self._closed = True
        await self._pool.close()

    async def schema_version(self) -> int | None:
        """The schema version in the database, or None when there are no tables yet."""
        conn = await self._open()
        try:
            return await self._version(conn)
        finally:
            await close(conn)

    # ------------------------------------------------------------------ maintenance

    async def forget(self, consumer: str, key: str) -> bool:
        # No DELETE ... RETURNING in MySQL: the affected row count tells.
        params = who(consumer, key)
        found = await self._run("forget", lambda conn: execute(conn, self._dialect.forget, params))
        return found[0] > 0

    async def _purge_batch(
        self, after: Position | None, limit: int
    ) -> tuple[int, int, Position | None]:
        found, count = await self._run("purge", partial(self._purge_keys, after=after, limit=limit))
        if not found:
            return 0, 0, after
        return len(found), count, (bytes(found[-1][0]), bytes(found[-1][1]))

    async def _purge_keys(
        self, conn: Connection, after: Position | None, limit: int
    ) -> tuple[list[Any], int]:
        # Sweep the primary key in order: the candidates are read without locks, then deleted
        # by key, still expired, in one short statement. There is deliberately no index on
        # expires_ms: it would cost every claim and completion a second B-tree write, to speed
        # up only the background purge.
        now = self._now()
        params: dict[str, Any] = {"now": now, "limit": limit}
        if after is not None:
            params["after_consumer"], params["after_key"] = after
        found = await fetchall(conn, self._dialect.purge_candidates(first=after is None), params)
        if not found:
            return found, 0
        doomed: dict[str, Any] = {"now": now}
        for i, (consumer, key) in enumerate(found):
            doomed[f"c{i}"], doomed[f"k{i}"] = consumer, key
        count = (await execute(conn, self._dialect.purge_delete(len(found)), doomed))[0]
        return found, count
