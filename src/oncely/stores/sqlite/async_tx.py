"""The SQLite store's transaction block, a class of its own.

:class:`_Transaction` is the block of :meth:`AsyncSQLiteStore.transaction
<oncely.stores.sqlite.async_store.AsyncSQLiteStore.transaction>`: ``BEGIN IMMEDIATE`` on a
pooled connection (so a reader never has to upgrade to a writer and deadlock); ``COMMIT`` when
the block ends, ``ROLLBACK`` when it raises. The store, in
:mod:`oncely.stores.sqlite.async_store`, holds the rest of the transactional mode.
"""

from __future__ import annotations

import sqlite3
from types import TracebackType
from typing import TYPE_CHECKING

import aiosqlite

from oncely.errors import CommitRefused
from oncely.stores.sqlite.errors import translate

if TYPE_CHECKING:
    from oncely.stores.sqlite.async_store import AsyncSQLiteStore

__all__: list[str] = []  # _Transaction is the store's own


class _Transaction:
    """``async with store.transaction() as tx``: BEGIN IMMEDIATE on a pooled connection;
    COMMIT when the block ends, ROLLBACK when it raises. A class, not a generator: it is on
    the hot path of every transactional message.

    Each SQL store has its own, alike in shape: one shared class with per-driver hooks would
    add a call to every BEGIN and COMMIT."""

    __slots__ = ("_claim_first", "_conn", "_store")

    def __init__(self, store: AsyncSQLiteStore, claim_first: bool = False) -> None:
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
                if isinstance(error, sqlite3.IntegrityError):
                    # A deferred foreign key the block's writes broke (the only constraint
                    # SQLite checks at COMMIT; the inbox's tables have none): the handler's.
                    raise CommitRefused(str(translate(error, "commit"))) from error
                if isinstance(error, sqlite3.Error):
                    raise translate(error, "commit") from error
                raise
            if not conn.in_transaction:  # committed: nothing to roll back (the common case)
                await store._pool.release(conn)
                return
        await store._release(conn)  # rolls back whatever is still open
