"""The SQLite store's construction, connections, schema and maintenance.

:class:`SQLiteStoreBase`: opening connections (busy timeout, pragmas, WAL), the schema, the
purge, closing. How the store's modules divide the work is told in ``sql_base``.

First use is safe under concurrency. ``PRAGMA journal_mode = WAL`` answers "database is
locked" at once, without calling the busy handler, while another connection holds a write lock
on a file still in a rollback journal (a fleet starting together on a file the application
made): each step of the setup is tried again, with a jittered backoff, until the busy timeout
(:meth:`SQLiteStoreBase._patiently`); a file another process switched meanwhile is simply in
WAL when the pragma runs again, and the schema statements tolerate a concurrent creator
(``IF NOT EXISTS``, ``ON CONFLICT DO NOTHING``). The first use inside a caller's own
transaction checks the schema on the caller's connection instead
(:meth:`SQLiteStoreBase._prepare_in`): a connection of oncely's own would wait for the lock
that very transaction holds.
"""

from __future__ import annotations

from oncely._twin import ASYNC

if ASYNC:
    from asyncio import sleep
else:
    from time import sleep

import os
import random
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager, suppress
from time import monotonic
from typing import Any, Final, Self, TypeVar

import aiosqlite

from oncely._core.clock import Clock, SystemClock
from oncely.errors import SchemaMissing
from oncely.stores.async_sql import Position, SQLStoreBase
from oncely.stores.sqlite.async_io import AsyncPool, close, connect, fetchall
from oncely.stores.sqlite.dialect import OLD_STATUS_CHECK, SCHEMA_VERSION, SQLiteDialect
from oncely.stores.sqlite.errors import SQLiteSettings, is_busy, parse_url, translate

__all__ = ["SQLiteStoreBase"]

T = TypeVar("T")

_FIRST_BACKOFF_S: Final = 0.001
_MAX_BACKOFF_S: Final = 0.05


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
        # The tables were seen from inside a caller's transaction on a file not (yet) in WAL:
        # claims there go ahead; the store's own first connection still switches the file.
        self._schema_seen = False

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
        # one: the database lives and dies with it). Each step waits out other connections'
        # locks, all of them together up to the busy timeout.
        conn = await self._open()
        try:
            deadline = monotonic() + self._settings.busy_timeout.total_seconds()
            if not self._memory:
                await self._patiently("switching to WAL", self._wal, conn, deadline)
            version = await self._patiently(
                "reading the schema version", self._version, conn, deadline
            )
            # migrate runs the CREATE ... IF NOT EXISTS again whatever the version: the
            # version row says nothing of the inbox table itself.
            if self._tables_needed(version, migrating=migrating) or migrating:
                await self._patiently("creating the schema", self._create, conn, deadline)
        finally:
            self._pool.adopt(conn)

    async def _patiently(
        self,
        doing: str,
        step: Callable[[aiosqlite.Connection], Awaitable[T]],
        conn: aiosqlite.Connection,
        deadline: float,
    ) -> T:
        """``step(conn)``, tried again while SQLite answers "locked" and ``deadline`` (a
        ``monotonic`` time) is ahead, after a jittered, growing pause (processes started
        together do not retry in step); any other error, or "locked" past the deadline, is
        translated (:class:`~oncely.StoreUnavailable` for the lock)."""
        pause = _FIRST_BACKOFF_S
        while True:
            try:
                return await step(conn)
            except sqlite3.Error as exc:
                left = deadline - monotonic()
                if not is_busy(exc) or left <= 0:
                    raise translate(exc, doing) from exc
            await sleep(min(left, pause * random.uniform(0.5, 1.5)))
            pause = min(pause * 2, _MAX_BACKOFF_S)

    async def _wal(self, conn: aiosqlite.Connection) -> None:
        # Answers the journal mode the file is in afterwards: "wal", also when another process
        # switched it first (the pragma then only reads the file's header). A database that
        # cannot be in WAL (one in memory) answers its own mode instead, without an error.
        await fetchall(conn, "PRAGMA journal_mode = WAL")

    async def _version(self, conn: aiosqlite.Connection) -> int | None:
        try:
            rows = await fetchall(conn, self._dialect.read_version)
        except sqlite3.OperationalError as exc:
            if "no such table" in str(exc).lower():
                return None
            raise
        return int(rows[0][0]) if rows else None

    async def _create(self, conn: aiosqlite.Connection) -> None:
        # Safe beside a concurrent creator (another process's first use): BEGIN IMMEDIATE
        # takes turns with it, and every statement is a no-op once its work is done.
        await fetchall(conn, "BEGIN IMMEDIATE")
        try:
            for statement in self._dialect.create:
                await fetchall(conn, statement)
            await self._upgrade_check(conn)
            await fetchall(conn, "COMMIT")
        except BaseException:
            # (A failed COMMIT leaves the transaction open, some errors do not; a failing
            # ROLLBACK is not the error to report.)
            if conn.in_transaction:
                with suppress(sqlite3.Error):
                    await fetchall(conn, "ROLLBACK")
            raise

    async def _prepare_in(self, tx: aiosqlite.Connection) -> None:
        """The first use of the store inside a caller's open transaction, on the caller's
        connection ``tx`` (``handle_in_transaction(tx=...)``).

        The setup cannot run on a connection of oncely's own there: the caller's transaction
        holds (or may take) the file's write lock, which that connection would wait for until
        the busy timeout, and the journal mode cannot change inside a transaction at all. So
        the schema is read through ``tx``, which waits on nobody's lock but other processes':

        * tables there, file in WAL: the setup has nothing left to do; the store is ready;
        * tables there, file in a rollback journal: the claim joins the transaction all the
          same (SQLite's lock arbitrates claims alike in both journals); the store's first
          connection of its own, outside this transaction, switches the file to WAL;
        * no tables: :class:`~oncely.SchemaMissing` at once. They are not created inside the
          caller's transaction (the caller's rollback would drop them with the marker, behind
          the store's back); ``oncely migrate`` or :meth:`migrate` creates them, and switches
          the file to WAL, before the first message.

        No lock of the store's is taken either: a thread setting the store up meanwhile may be
        the one waiting for this transaction's lock."""
        if self._schema_seen:
            return
        try:
            version = await self._version(tx)
            ((mode,),) = await fetchall(tx, "PRAGMA journal_mode")
        except sqlite3.Error as exc:
            raise translate(exc, "reading the schema version") from exc
        if self._tables_needed(version, migrating=False):  # (raises for a newer schema)
            raise SchemaMissing(
                f"no oncely {self._place}, and oncely does not create it inside your open "
                "transaction (its own connection would wait for the lock your transaction "
                "holds): run `oncely migrate --store URL`, or the store's migrate(), once "
                "before the first handle_in_transaction(tx=...)"
            )
        if self._memory or str(mode).lower() == "wal":
            self._ready = True
        else:
            self._schema_seen = True

    async def _upgrade_check(self, conn: aiosqlite.Connection) -> None:
        """Rewrite the status constraint of a table created by an earlier oncely into its
        cheaper, equivalent form (:data:`~oncely.stores.sqlite.dialect.STATUS_CHECK`), in the
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
            deadline = monotonic() + self._settings.busy_timeout.total_seconds()
            return await self._patiently(
                "reading the schema version", self._version, conn, deadline
            )
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
