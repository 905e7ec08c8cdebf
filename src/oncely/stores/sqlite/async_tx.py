"""The SQLite store's transactional mode (R7), but for its claim (``claim_in``).

:class:`SQLiteTransactions`: transactions opened for the caller (``BEGIN IMMEDIATE``, so a
reader never has to upgrade to a writer and deadlock), savepoints, checks and writes on a
caller's connection. How the store's modules divide the work is told in ``sql_base``.
"""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import TracebackType

import aiosqlite

from oncely.errors import TransactionRequired
from oncely.stores.sqlite.async_base import SQLiteStoreBase
from oncely.stores.sqlite.async_io import Params
from oncely.stores.sqlite.errors import translate

__all__ = ["SQLiteTransactions"]


class SQLiteTransactions(SQLiteStoreBase):
    """The transactional mode of :class:`~oncely.AsyncSQLiteStore` (see
    there)."""

    def transaction(self, *, claim_first: bool = False) -> _Transaction:
        """``BEGIN IMMEDIATE`` on a pooled connection. With ``claim_first`` (the block's first
        statement is :meth:`claim_in`), the asyncio store lets that claim's INSERT begin the
        transaction, in the claim's own hop to the connection's thread."""
        return _Transaction(self, claim_first)

    @asynccontextmanager
    async def savepoint(self, tx: aiosqlite.Connection) -> AsyncIterator[None]:
        await self._run(tx, "SAVEPOINT oncely", (), "savepoint")
        try:
            yield
        except BaseException:
            await self._run(tx, "ROLLBACK TO oncely", (), "rollback to savepoint")
            await self._run(tx, "RELEASE oncely", (), "release savepoint")
            raise
        await self._run(tx, "RELEASE oncely", (), "release savepoint")

    async def _run(self, conn: aiosqlite.Connection, sql: str, params: Params, op: str) -> None:
        try:
            await self._pool.execute(conn, sql, params)
        except sqlite3.Error as exc:
            raise translate(exc, op) from exc

    def check_transaction(self, tx: aiosqlite.Connection) -> None:
        if not tx.in_transaction:
            raise TransactionRequired(
                "the connection has no open transaction: run BEGIN (or BEGIN IMMEDIATE) first, "
                "or call without tx= to let oncely open and commit one"
            )

    async def set_result_in(
        self, tx: aiosqlite.Connection, consumer: str, key: str, *, token: str, result: bytes | None
    ) -> None:
        params = {"consumer": consumer, "key": key, "token": token, "result": result}
        await self._run(tx, self._dialect.set_result, params, "storing the result")


class _Transaction:
    """``async with store.transaction() as tx``: BEGIN IMMEDIATE on a pooled connection;
    COMMIT when the block ends, ROLLBACK when it raises. A class, not a generator: it is on
    the hot path of every transactional message.

    Each SQL store has its own, alike in shape: one shared class with per-driver hooks would
    add a call to every BEGIN and COMMIT."""

    __slots__ = ("_claim_first", "_conn", "_store")

    def __init__(self, store: SQLiteStoreBase, claim_first: bool = False) -> None:
        self._store = store
        self._claim_first = claim_first
        self._conn: aiosqlite.Connection | None = None

    async def __aenter__(self) -> aiosqlite.Connection:
        store = self._store
        # _acquire's checks written inline for the common case (a ready, open store).
        ready = store._ready and not store._closed
        conn = await (store._pool.acquire() if ready else store._acquire())
        try:
            await store._pool.begin(conn, self._claim_first)
        except BaseException as exc:
            if not isinstance(exc, Exception):  # cancelled: the BEGIN may still be queued
                store._pool.abandon(conn)
                raise
            await store._release(conn)
            if isinstance(exc, sqlite3.Error):
                raise translate(exc, "begin") from exc
            raise
        self._conn = conn
        return conn

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        conn = self._conn
        assert conn is not None
        self._conn = None
        store = self._store
        if exc_type is not None and not issubclass(exc_type, Exception):
            # Cancelled (or interrupted): a statement of the block may still be queued.
            store._pool.abandon(conn)
            return
        if exc_type is None:
            try:
                await store._pool.execute(conn, "COMMIT")
            except BaseException as error:
                if not isinstance(error, Exception):  # cancelled: COMMIT may still run
                    store._pool.abandon(conn)
                    raise
                await store._release(conn)  # rolls back whatever is still open
                if isinstance(error, sqlite3.Error):
                    raise translate(error, "commit") from error
                raise
            if not conn.in_transaction:  # committed: nothing to roll back (the common case)
                await store._pool.release(conn)
                return
        await store._release(conn)  # rolls back whatever is still open
