"""Which stores a transaction of the caller's (SQLAlchemy's session, Django's ``atomic``) can
join on which DB-API driver, and when pysqlite's legacy transaction control left a session
without a real transaction.

Pure decisions shared by the sync and asyncio shells; no I/O.
"""

from __future__ import annotations

import importlib
import sqlite3
import sys
from dataclasses import dataclass

from oncely.errors import PayloadError, TransactionsUnsupported

__all__ = [
    "ASYNC_KINDS",
    "SYNC_KINDS",
    "Kind",
    "check_driver",
    "handler_failed",
    "kind_of",
    "needs_begin",
]

_LEGACY = getattr(sqlite3, "LEGACY_TRANSACTION_CONTROL", -1)


@dataclass(frozen=True, slots=True)
class Kind:
    """One store class and the driver connection it can join."""

    module: str  # where the store class lives (imported by whoever made the store)
    store: str
    family: str  # "postgresql" | "mysql" | "sqlite"
    dialects: frozenset[str]  # SQLAlchemy dialect names of that family
    driver_module: str
    driver_class: str
    driver_name: str  # as a user would name it
    url: str  # how to create a matching engine


_PG = frozenset({"postgresql"})
_MY = frozenset({"mysql", "mariadb"})
_LITE = frozenset({"sqlite"})

SYNC_KINDS = (
    Kind(
        "oncely.stores.postgres.sync_store",
        "PostgresStore",
        "postgresql",
        _PG,
        "psycopg",
        "Connection",
        "psycopg 3",
        "create_engine('postgresql+psycopg://...')",
    ),
    Kind(
        "oncely.stores.mysql.sync_store",
        "MySQLStore",
        "mysql",
        _MY,
        "pymysql.connections",
        "Connection",
        "PyMySQL",
        "create_engine('mysql+pymysql://...') (or 'mariadb+pymysql://...')",
    ),
    Kind(
        "oncely.stores.sqlite.sync_store",
        "SQLiteStore",
        "sqlite",
        _LITE,
        "sqlite3",
        "Connection",
        "sqlite3 (pysqlite)",
        "create_engine('sqlite:///path/to/the/store.db')",
    ),
)

ASYNC_KINDS = (
    Kind(
        "oncely.stores.postgres.async_store",
        "AsyncPostgresStore",
        "postgresql",
        _PG,
        "psycopg",
        "AsyncConnection",
        "psycopg 3 (asyncio)",
        "create_async_engine('postgresql+psycopg://...')",
    ),
    Kind(
        "oncely.stores.mysql.async_store",
        "AsyncMySQLStore",
        "mysql",
        _MY,
        "aiomysql",
        "Connection",
        "aiomysql",
        "create_async_engine('mysql+aiomysql://...') (or 'mariadb+aiomysql://...')",
    ),
    Kind(
        "oncely.stores.sqlite.async_store",
        "AsyncSQLiteStore",
        "sqlite",
        _LITE,
        "aiosqlite",
        "Connection",
        "aiosqlite",
        "create_async_engine('sqlite+aiosqlite:///path/to/the/store.db')",
    ),
)


def kind_of(
    store: object,
    kinds: tuple[Kind, ...],
    function: str,
    joins: str = "a SQLAlchemy session's transaction",
) -> Kind:
    """The kind of ``store``, or :class:`~oncely.TransactionsUnsupported` naming the stores
    ``function`` (which joins ``joins``) works with. A store class is looked up only if its
    module was imported: an instance of it could not exist otherwise, and the optional
    drivers stay unimported."""
    for kind in kinds:
        module = sys.modules.get(kind.module)
        cls = getattr(module, kind.store, None) if module is not None else None
        if isinstance(cls, type) and isinstance(store, cls):
            return kind
    names = ", ".join(kind.store for kind in kinds)
    raise TransactionsUnsupported(
        f"{function} joins {joins} with a SQL store ({names}); "
        f"{type(store).__name__} cannot join one. Use a SQL store for the transactional mode, "
        "or Inbox.handle (two-phase mode) with this store"
    )


def check_driver(kind: Kind, driver: object, dialect: str, driver_name: str) -> None:
    """Raise :class:`~oncely.TransactionsUnsupported` unless ``driver`` (the session's DB-API
    connection) is one ``kind``'s store can write its marker on."""
    cls = getattr(importlib.import_module(kind.driver_module), kind.driver_class)
    if isinstance(driver, cls):
        return
    if dialect not in kind.dialects:
        problem = f"the session is on {dialect} ({driver_name}), the store on {kind.family}"
        fix = f"bind the session to the store's database: {kind.url}"
    else:
        problem = (
            f"{kind.store} joins {kind.driver_name} connections and this session's engine "
            f"uses {dialect}+{driver_name}, which oncely cannot join (yet)"
        )
        fix = f"create the session's engine with {kind.url}"
    raise TransactionsUnsupported(f"{problem}: {fix}")


def needs_begin(driver: object) -> bool:
    """Whether a sqlite3 / aiosqlite connection under legacy transaction control (the default
    before Python 3.16) holds no transaction although SQLAlchemy believes one is open: the
    driver BEGINs only before INSERT/UPDATE/DELETE, so a SAVEPOINT or oncely's claim would run
    on its own and commit at once. A connection in autocommit mode (``isolation_level=None``,
    or ``autocommit=True`` on Python 3.12+) is left alone: it has no transaction to join, and
    oncely refuses it with :class:`~oncely.TransactionRequired`."""
    if getattr(driver, "in_transaction", True):
        return False
    if getattr(driver, "autocommit", _LEGACY) != _LEGACY:
        return False
    return getattr(driver, "isolation_level", None) is not None


def handler_failed(error: Exception, failures: list[Exception]) -> bool:
    """Whether ``error``, out of the rolled-back savepoint, is the handler's own (or oncely's
    refusal of its result). Anything else, such as a rollback that itself failed, is not an
    outcome: it propagates."""
    return any(error is failure for failure in failures) or isinstance(error, PayloadError)
