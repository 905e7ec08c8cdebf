"""Whether a caller's connection (a SQLAlchemy session's, Django's, or one given as ``tx=``)
and an oncely store are on the same database.

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
from urllib.parse import parse_qs, unquote, urlsplit

from oncely.errors import ConfigurationError, StoreUnavailable

__all__ = [
    "INFO_KEY",
    "PROBE",
    "SQL",
    "Identity",
    "identity_of",
    "locked_out",
    "may_open",
    "remember",
    "remembered",
    "same_database",
    "sqlite_identity",
    "store_path",
]

Identity = tuple[object, ...]
"""A database as one side sees it: ``(family, ...)``; equal tuples are the same database."""

INFO_KEY = "oncely.sqlalchemy.database"
"""Where a DB-API connection's identity is kept in SQLAlchemy's ``PoolProxiedConnection.info``
(which lives as long as the DB-API connection, across pool check-outs)."""

SQL = {
    "postgresql": "SELECT current_database(), pg_postmaster_start_time()",
    "mysql": "SELECT DATABASE(), @@hostname, @@port, @@datadir, @@server_id",
    "sqlite": "PRAGMA database_list",
}
PROBE = "oncely.integrations.sqlalchemy"  # a key read once to open a SQLite store's tables


def identity_of(family: str, rows: list[tuple[object, ...]]) -> Identity:
    if family == "sqlite":
        return sqlite_identity(rows)
    return (family, *rows[0])


def may_open(store: object, driver: object) -> bool:
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


def locked_out(error: StoreUnavailable, driver: object) -> StoreUnavailable:
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
    if store[0] == session[0] == "sqlite" and not (store[1] and session[1]):
        return False  # an in-memory database is its connection's alone, never shared
    if store == session:
        return True
    if store[0] == session[0] == "sqlite":
        try:
            return os.path.samefile(str(store[1]), str(session[1]))
        except OSError:
            return False
    return False


def mismatch(
    store_url: str,
    store: Identity,
    session: Identity,
    *,
    side: str = "the session",
    fix: str = "Bind the session to the store's database, or open the store on the session's",
) -> ConfigurationError:
    """The error for a session (``side``) that is not on the store's database."""
    if store[0] == "sqlite" and (not store[1] or not session[1]):
        return ConfigurationError(
            f"an in-memory SQLite database cannot be shared between {side} and the store: "
            f"use one database file for both (the store is {store_url})"
        )
    return ConfigurationError(
        f"{side} is connected to {_describe(session)}, but the inbox's store "
        f"({store_url}) is in {_describe(store)}: the dedup marker must commit in the database "
        f"the handler writes in. {fix}"
    )


def _describe(identity: Identity) -> str:
    family = identity[0]
    if family == "sqlite":
        return f"the SQLite file {identity[1] or '(in memory)'}"
    if family == "postgresql":
        return f"PostgreSQL database {identity[1]!r} (server started {identity[2]})"
    return f"MySQL/MariaDB database {identity[1]!r} on {identity[2]}:{identity[3]}"


_STORES: weakref.WeakKeyDictionary[object, Identity] = weakref.WeakKeyDictionary()


def remembered(store: object) -> Identity | None:
    """The identity of ``store``'s database read before, if any."""
    try:
        return _STORES.get(store)
    except TypeError:  # a store that cannot be weakly referenced is checked every time
        return None


def remember(store: object, identity: Identity) -> Identity:
    """Keep the identity of ``store``'s database for the store's lifetime; return it."""
    with contextlib.suppress(TypeError):  # not weakly referable: checked every time
        _STORES[store] = identity
    return identity
