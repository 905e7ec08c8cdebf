"""The SQLite store's construction, connections, schema and maintenance.

:class:`SQLiteStoreBase`: opening connections (busy timeout, pragmas, WAL), the schema, the
purge, closing. How the store's modules divide the work is told in ``sql_base``.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any, Self

import aiosqlite

from oncely._async._sqlite_io import AsyncPool, close, connect, fetchall
from oncely._async.sql_base import Position, SQLStoreBase
from oncely._core.clock import Clock, SystemClock
from oncely._dialects.sqlite import OLD_STATUS_CHECK, SCHEMA_VERSION, SQLiteDialect
from oncely._drivers.sqlite import SQLiteSettings, parse_url, translate

__all__ = ["SQLiteStoreBase"]


class SQLiteStoreBase(SQLStoreBase[str]):
    """Construction and plumbing of :class:`~oncely.AsyncSQLiteStore` (see
    there)."""

    _SCHEMA_VERSION = SCHEMA_VERSION
    _dialect: SQLiteDialect
    _now: Callable[[], int]  # SQLite has no clock of its own: always the store's

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        table: str = "oncely_inbox",
        settings: SQLiteSettings | None = None,
        pool_size: int = 4,
        clock: Clock | None = None,
        migrate: bool = True,
    ) -> None:
        super().__init__(migrate=migrate)
        self._path = os.fspath(path)
        self._uri = self._path.startswith("file:")
        self._memory = self._path == ":memory:"
        self._dialect = SQLiteDialect(table)
        self._settings = settings if settings is not None else SQLiteSettings()
        self._clock: Clock = clock if clock is not None else SystemClock()
        self._now = self._clock.now_ms
        size = 1 if self._memory else pool_size
        if size < 1:
            raise ValueError("pool_size must be at least 1")
        self._pool = AsyncPool(self._open, size)

    @classmethod
    def from_url(cls, url: str, *, clock: Clock | None = None) -> Self:
        """A store for a ``sqlite:///`` URL (see :func:`oncely.open`)."""
        options = parse_url(url)
        return cls(
            options.path,
            table=options.table,
            settings=options.settings,
            pool_size=options.pool_size,
            clock=clock,
            migrate=options.migrate,
        )

    @property
    def url(self) -> str:
        return f"sqlite:///{self._path}"

    @property
    def table(self) -> str:
        return self._dialect.table

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._path!r}, table={self._dialect.table!r})"

    @property
    def _place(self) -> str:
        return f"table {self._dialect.table} in {self._path}"

    # ------------------------------------------------------------------ connections

    async def _open(self) -> aiosqlite.Connection:
        try:
            conn = await connect(
                self._path, timeout=self._settings.busy_timeout.total_seconds(), uri=self._uri
            )
            for pragma in self._settings.pragmas():
                await fetchall(conn, pragma)
        except sqlite3.Error as exc:
            raise translate(exc, f"opening {self._path}") from exc
        return conn

    async def _acquire(self) -> aiosqlite.Connection:
        if self._closed:
            raise self._closed_error()
        if not self._ready:
            await self._prepare()
        return await self._pool.acquire()

    async def _release(self, conn: aiosqlite.Connection) -> None:
        """Return a connection, rolling back anything an interrupted operation left open."""
        if not conn.in_transaction:
            await self._pool.release(conn)
            return
        discard = False
        try:
            await self._pool.execute(conn, "ROLLBACK")
        except sqlite3.Error:
            discard = True
        await self._pool.release(conn, discard)

    @asynccontextmanager
    async def _connection(self) -> AsyncIterator[aiosqlite.Connection]:
        conn = await self._acquire()
        try:
            yield conn
        finally:
            await self._release(conn)

    async def _rows(self, op: str, sql: str, params: Mapping[str, object]) -> list[Any]:
        conn = await self._acquire()
        try:
            return await self._pool.fetchall(conn, sql, params)
        except sqlite3.Error as exc:
            raise translate(exc, op) from exc
        finally:
            await self._release(conn)

    async def aclose(self) -> None:
        self._closed = True
        await self._pool.close()

    # ------------------------------------------------------------------ schema

    async def _setup(self, *, migrating: bool) -> None:
        # On a connection of its own, kept for the pool afterwards (for ":memory:", the only
        # one: the database lives and dies with it).
        conn = await self._open()
        try:
            if not self._memory:
                await self._wal(conn)
            version = await self._version(conn)
            # migrate runs the CREATE ... IF NOT EXISTS again whatever the version: the
            # version row says nothing of the inbox table itself.
            if self._tables_needed(version, migrating=migrating) or migrating:
                await self._create(conn)
        finally:
            self._pool.adopt(conn)

    async def _wal(self, conn: aiosqlite.Connection) -> None:
        try:
            await fetchall(conn, "PRAGMA journal_mode = WAL")
        except sqlite3.Error as exc:
            raise translate(exc, "switching to WAL") from exc

    async def _version(self, conn: aiosqlite.Connection) -> int | None:
        try:
            rows = await fetchall(conn, self._dialect.read_version)
        except sqlite3.OperationalError as exc:
            if "no such table" in str(exc).lower():
                return None
            raise translate(exc, "reading the schema version") from exc
        except sqlite3.Error as exc:
            raise translate(exc, "reading the schema version") from exc
        return int(rows[0][0]) if rows else None

    async def _create(self, conn: aiosqlite.Connection) -> None:
        try:
            await fetchall(conn, "BEGIN IMMEDIATE")
            try:
                for statement in self._dialect.create:
                    await fetchall(conn, statement)
                await self._upgrade_check(conn)
                await fetchall(conn, "COMMIT")
            except BaseException:
                await fetchall(conn, "ROLLBACK")
                raise
        except sqlite3.Error as exc:
            raise translate(exc, "creating the schema") from exc

    async def _upgrade_check(self, conn: aiosqlite.Connection) -> None:
        """Rewrite the status constraint of a table created by an earlier oncely into its
        cheaper, equivalent form (:data:`~oncely._dialects.sqlite.STATUS_CHECK`), in the
        schema transaction. Where SQLite refuses to edit its schema (a build in defensive
        mode), the table keeps the old constraint: it accepts the same rows, only slower."""
        d = self._dialect
        rows = await fetchall(conn, d.table_sql)
        if not rows or OLD_STATUS_CHECK not in rows[0][0]:
            return
        ((version,),) = await fetchall(conn, "PRAGMA schema_version")
        await fetchall(conn, "PRAGMA writable_schema = ON")
        try:
            for sql, params in d.upgrade_check(version):
                await fetchall(conn, sql, params)
        except sqlite3.Error:
            pass  # left as it was: the UPDATE failed as a whole (a statement is atomic)
        finally:
            await fetchall(conn, "PRAGMA writable_schema = OFF")

    async def schema_version(self) -> int | None:
        """The schema version in the database, or None when there are no tables yet."""
        conn = await self._open()
        try:
            return await self._version(conn)
        finally:
            await close(conn)

    # ------------------------------------------------------------------ maintenance

    async def _purge_batch(
        self, after: Position | None, limit: int
    ) -> tuple[int, int, Position | None]:
        # Candidates are read first (WAL readers never block writers), then deleted by key,
        # still expired, in one short write.
        now = self._now()
        start = after if after is not None else ("", "")
        params = {"now": now, "limit": limit, "after_consumer": start[0], "after_key": start[1]}
        conn = await self._acquire()
        try:
            found = await self._pool.fetchall(conn, self._dialect.purge_candidates, params)
            if not found:
                return 0, 0, after
            flat: list[object] = [part for pair in found for part in pair]
            flat.append(now)
            rows = await self._pool.fetchall(conn, self._dialect.purge_delete(len(found)), flat)
        except sqlite3.Error as exc:
            raise translate(exc, "purge") from exc
        finally:
            await self._release(conn)
        return len(found), len(rows), (found[-1][0], found[-1][1])
