"""Whether a SQLAlchemy session and an oncely store are on the same database.

Each side is read as an :data:`Identity`: PostgreSQL ``current_database()`` and the
postmaster's start time (which tells servers apart whatever host name reached them);
MariaDB/MySQL ``DATABASE()``, host name, port, data directory and server id (the store's table
name is not qualified: it lives in the connection's current database); SQLite the main file.
The store's side is read once per store (on one of its own connections, which also opens the
store); the session's once per DB-API connection, kept in SQLAlchemy's
``PoolProxiedConnection.info`` (which lives as long as the DB-API connection).
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import weakref
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import parse_qs, unquote, urlsplit

from oncely.errors import ConfigurationError, OncelyError, StoreError, StoreUnavailable
from oncely.integrations._sqlalchemy_join import Kind

if TYPE_CHECKING:
    from sqlalchemy import Connection
    from sqlalchemy.ext.asyncio import AsyncConnection
    from sqlalchemy.pool import PoolProxiedConnection

    from oncely.stores.async_protocols import AsyncTransactionalStore
    from oncely.stores.sync_protocols import TransactionalStore

__all__ = [
    "Identity",
    "check_session",
    "check_session_async",
    "same_database",
    "sqlite_identity",
    "store_identity",
    "store_identity_async",
    "store_path",
]

Identity = tuple[object, ...]
"""A database as one side sees it: ``(family, ...)``; equal tuples are the same database."""

INFO_KEY = "oncely.sqlalchemy.database"
"""Where a DB-API connection's identity is kept in SQLAlchemy's ``PoolProxiedConnection.info``
(which lives as long as the DB-API connection, across pool check-outs)."""

_SQL = {
    "postgresql": "SELECT current_database(), pg_postmaster_start_time()",
    "mysql": "SELECT DATABASE(), @@hostname, @@port, @@datadir, @@server_id",
    "sqlite": "PRAGMA database_list",
}
_PROBE = "oncely.integrations.sqlalchemy"  # a key read once to open a SQLite store's tables


def store_identity(
    store: TransactionalStore[object], kind: Kind, consumer: str, driver: object
) -> Identity:
    """The identity of ``store``'s database (read once per store). Call it before the session's
    transaction writes on SQLite: opening the store may need SQLite's write lock."""
    known = _remembered(store)
    if known is not None:
        return known
    if kind.family == "sqlite":
        # Opens the store (creating its tables unless migrate=False) before the session's
        # transaction holds SQLite's write lock, which the creation would wait for. When the
        # lock is taken already (the session has written), the store reads its schema through
        # the session's own connection instead (missing tables: SchemaMissing at once, never
        # a wait on the session's own lock).
        if _may_open(store, driver):
            try:
                store.get(consumer, _PROBE)
            except StoreUnavailable as exc:
                raise _locked_out(exc, driver) from exc
        return _remember(store, ("sqlite", store_path(store.url) or ""))
    try:
        with store.transaction() as tx:
            conn: Any = tx
            if kind.family == "postgresql":
                row = conn.execute(_SQL[kind.family]).fetchone()
            else:
                with conn.cursor() as cursor:
                    cursor.execute(_SQL[kind.family])
                    row = cursor.fetchone()
    except OncelyError:
        raise
    except Exception as exc:
        raise StoreError(f"{store.url}: cannot read which database it is in: {exc}") from exc
    return _remember(store, (kind.family, *row))


async def store_identity_async(
    store: AsyncTransactionalStore[object], kind: Kind, consumer: str, driver: object
) -> Identity:
    """:func:`store_identity` for an asyncio store."""
    known = _remembered(store)
    if known is not None:
        return known
    if kind.family == "sqlite":
        if _may_open(store, driver):  # see store_identity
            try:
                await store.get(consumer, _PROBE)
            except StoreUnavailable as exc:
                raise _locked_out(exc, driver) from exc
        return _remember(store, ("sqlite", store_path(store.url) or ""))
    try:
        async with store.transaction() as tx:
            conn: Any = tx
            if kind.family == "postgresql":
                row = await (await conn.execute(_SQL[kind.family])).fetchone()
            else:
                cursor = await conn.cursor()
                try:
                    await cursor.execute(_SQL[kind.family])
                    row = await cursor.fetchone()
                finally:
                    await cursor.close()
    except OncelyError:
        raise
    except Exception as exc:
        raise StoreError(f"{store.url}: cannot read which database it is in: {exc}") from exc
    return _remember(store, (kind.family, *row))


def check_session(
    store_url: str, expected: Identity, connection: Connection, fairy: PoolProxiedConnection
) -> None:
    """Raise :class:`~oncely.ConfigurationError` unless the session's connection is on the
    database ``expected`` identifies."""
    found = cast("Identity | None", fairy.info.get(INFO_KEY))
    if found is None:
        result = connection.exec_driver_sql(_SQL[str(expected[0])])
        found = fairy.info[INFO_KEY] = _identity(str(expected[0]), [tuple(r) for r in result])
    if not same_database(expected, found):
        raise mismatch(store_url, expected, found)


async def check_session_async(
    store_url: str, expected: Identity, connection: AsyncConnection, fairy: PoolProxiedConnection
) -> None:
    """:func:`check_session` for an ``AsyncConnection``."""
    found = cast("Identity | None", fairy.info.get(INFO_KEY))
    if found is None:
        result = await connection.exec_driver_sql(_SQL[str(expected[0])])
        found = fairy.info[INFO_KEY] = _identity(str(expected[0]), [tuple(r) for r in result])
    if not same_database(expected, found):
        raise mismatch(store_url, expected, found)


def _identity(family: str, rows: list[tuple[object, ...]]) -> Identity:
    if family == "sqlite":
        return sqlite_identity(rows)
    return (family, *rows[0])


def _may_open(store: object, driver: object) -> bool:
    """Whether opening a SQLite store on its own connection cannot wait on a lock the
    session's transaction holds: the session has no transaction, or nobody holds the write
    lock now (tried without waiting: ``BEGIN IMMEDIATE`` with a zero timeout, rolled back)."""
    if not getattr(driver, "in_transaction", False):
        return True
    path = store_path(getattr(store, "url", ""))
    if path is None:
        return True
    try:
        with contextlib.closing(sqlite3.connect(path, timeout=0, isolation_level=None)) as probe:
            probe.execute("BEGIN IMMEDIATE")
            probe.execute("ROLLBACK")
    except sqlite3.Error:
        return False
    return True


def _locked_out(error: StoreUnavailable, driver: object) -> StoreUnavailable:
    if not getattr(driver, "in_transaction", False):
        return error
    return StoreUnavailable(
        f"{error}; the session's transaction has written already and holds SQLite's write "
        "lock, which opening the store for the first time (WAL mode, its tables) needs: "
        "call store.migrate() at start-up, before any session writes"
    )


def store_path(url: str) -> str | None:
    """The file behind a SQLite store's ``url`` (``sqlite:///<path>``), absolute and with links
    resolved; None for an in-memory database, which no other connection can share."""
    path = url.removeprefix("sqlite:///")
    if path.startswith("file:"):
        parts = urlsplit(path)
        if parse_qs(parts.query).get("mode") == ["memory"]:
            return None
        path = unquote(parts.path)
    if path in ("", ":memory:"):
        return None
    return os.path.realpath(path)


def sqlite_identity(rows: list[tuple[object, ...]]) -> Identity:
    """The identity of a SQLite connection from its ``PRAGMA database_list`` rows: the main
    database's file ("" for an in-memory or temporary one)."""
    for row in rows:
        if len(row) >= 3 and row[1] == "main":
            file = str(row[2] or "")
            return ("sqlite", os.path.realpath(file) if file else "")
    return ("sqlite", "")


def same_database(store: Identity, session: Identity) -> bool:
    """Whether the two sides are the same database. A SQLite file may be reached by two
    paths (a hard link): on a mismatch the files themselves are compared."""
    if store == session:
        return True
    if store[0] == session[0] == "sqlite" and store[1] and session[1]:
        try:
            return os.path.samefile(str(store[1]), str(session[1]))
        except OSError:
            return False
    return False


def mismatch(store_url: str, store: Identity, session: Identity) -> ConfigurationError:
    """The error for a session that is not on the store's database."""
    if store[0] == "sqlite" and (not store[1] or not session[1]):
        return ConfigurationError(
            "an in-memory SQLite database cannot be shared between the session and the store: "
            f"use one database file for both (the store is {store_url})"
        )
    return ConfigurationError(
        f"the session is connected to {_describe(session)}, but the inbox's store "
        f"({store_url}) is in {_describe(store)}: the dedup marker must commit in the database "
        "the handler writes in. Bind the session to the store's database, or open the store "
        "on the session's"
    )


def _describe(identity: Identity) -> str:
    family = identity[0]
    if family == "sqlite":
        return f"the SQLite file {identity[1] or '(in memory)'}"
    if family == "postgresql":
        return f"PostgreSQL database {identity[1]!r} (server started {identity[2]})"
    return f"MySQL/MariaDB database {identity[1]!r} on {identity[2]}:{identity[3]}"


_STORES: weakref.WeakKeyDictionary[object, Identity] = weakref.WeakKeyDictionary()


def _remembered(store: object) -> Identity | None:
    """The identity of ``store``'s database read before, if any."""
    try:
        return _STORES.get(store)
    except TypeError:  # a store that cannot be weakly referenced is checked every time
        return None


def _remember(store: object, identity: Identity) -> Identity:
    """Keep the identity of ``store``'s database for the store's lifetime; return it."""
    with contextlib.suppress(TypeError):  # not weakly referable: checked every time
        _STORES[store] = identity
    return identity
