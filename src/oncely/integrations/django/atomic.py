"""The transactional inbox inside Django's ``transaction.atomic()`` (R7): the handler's ORM
writes and oncely's dedup marker commit together, on Django's own connection.

The contract is in :mod:`oncely.integrations.django`; this module is the mechanism:

1. the store must be a sync SQL store on the same database as the connection ``using``
   (checked once per store and once per DB-API connection), reached through the driver it
   speaks (psycopg 3, PyMySQL, sqlite3);
2. the claim, the handler and the result run inside a nested ``atomic`` (Django's own
   savepoint, so a rollback also resets what Django knows of the block) in which oncely joins
   with ``savepoint=False``;
3. when the handler raises, that savepoint is rolled back (its rows and the marker together)
   and the failure is recorded once more inside oncely's own savepoint with a handler that
   re-raises it, so the ``failed``/``rejected`` outcome, a rejection's poison marker, hooks
   and logs are those of :meth:`oncely.Inbox.handle_in_transaction`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, TypeVar, cast

from django.db import DEFAULT_DB_ALIAS, IntegrityError, connections, transaction

from oncely._core.keys import Envelope, KeySource
from oncely._core.outcomes import Handled
from oncely._core.typed import ANNOTATED, typed_repeat
from oncely.errors import StoreError, TransactionsUnsupported
from oncely.inbox.sync_inbox import Inbox
from oncely.integrations._joined.kinds import SYNC_KINDS, Kind, handler_failed, kind_of
from oncely.integrations._joined.sync_identity import store_identity
from oncely.integrations.django.databases import alias_of
from oncely.stores._identity import (
    SQL,
    Identity,
    identity_of,
    mismatch,
    same_database,
)
from oncely.stores.sync_protocols import TransactionalStore

__all__ = ["handle_in_atomic", "handle_message_in_atomic"]

P = TypeVar("P")
R = TypeVar("R")

_NAME = "handle_in_atomic"
_JOINS = "a Django transaction.atomic() block"
_FIX = {
    "postgresql": "install psycopg 3 (pip install 'psycopg[binary]'): Django's PostgreSQL "
    "backend uses it instead of psycopg2 when both are installed",
    "mysql": "run Django's MySQL backend on PyMySQL: import pymysql; "
    "pymysql.install_as_MySQLdb() at the top of settings.py (mysqlclient connections cannot "
    "be joined yet)",
    "sqlite": "use Django's sqlite3 backend",
}
_IDENTITY = "_oncely_database"  # (DB-API connection, its Identity) on Django's wrapper


def handle_in_atomic(
    inbox: Inbox,
    key: str,
    payload: P,
    handler: Callable[[P], R],
    *,
    using: str | None = None,
    correlation_id: str | None = None,
    returns: Any = ANNOTATED,
) -> Handled[R]:
    """Run ``handler(payload)`` and record ``key`` in the transaction of Django's connection
    ``using`` (R7). A ``duplicate``'s value is the first result as the type ``handler``
    returns (or ``returns=``), as :meth:`oncely.Inbox.handle` gives it.

    Inside a ``transaction.atomic()`` block the outcome is tentative until that block commits;
    outside one, the call opens its own block and commits it. ``using`` defaults to the
    database the inbox's store was opened for by :func:`get_store`, else ``"default"``.
    """

    def through(run: Callable[[Any, P], R], tx: Any, savepoint: bool) -> Handled[R]:
        return inbox.handle_in_transaction(
            key, payload, run, tx=tx, savepoint=savepoint, correlation_id=correlation_id,
            returns=None,
        )  # fmt: skip

    return typed_repeat(_joined(inbox, handler, using, through), handler, returns)


def handle_message_in_atomic(
    inbox: Inbox,
    envelope: Envelope,
    handler: Callable[[Any], R],
    *,
    key: KeySource | None = None,
    using: str | None = None,
) -> Handled[R]:
    """:func:`handle_in_atomic` for a broker message: the key read as
    :meth:`oncely.Inbox.handle_message` reads it (a message without a usable key is
    ``rejected``), ``handler`` called with the decoded body."""

    def through(run: Callable[[Any, Any], R], tx: Any, savepoint: bool) -> Handled[R]:
        return inbox.handle_message_in_transaction(
            envelope, run, key=key, tx=tx, savepoint=savepoint
        )

    return _joined(inbox, handler, using, through)


def _joined(
    inbox: Inbox,
    handler: Callable[[Any], R],
    using: str | None,
    through: Callable[[Callable[[Any, Any], R], Any, bool], Handled[R]],
) -> Handled[R]:
    if not isinstance(inbox, Inbox):
        raise TypeError(
            f"{_NAME} takes an oncely.Inbox (Django's ORM is synchronous), not "
            f"{type(inbox).__name__}"
        )
    store = inbox.store
    alias = using or alias_of(store) or DEFAULT_DB_ALIAS
    connection = connections[alias]
    own = not connection.in_atomic_block
    failures: list[Exception] = []

    def run(_tx: object, body: Any) -> R:
        try:
            return handler(body)
        except Exception as exc:
            failures.append(exc)
            raise

    done: Handled[R] | None = None
    try:
        if own:
            # The block is oncely's: a failing handler rolls all of it back, so the claim
            # needs no savepoint of its own (two round trips fewer per message).
            with transaction.atomic(using=alias):
                done = through(run, _driver(inbox, connection, alias), False)
            return done
        # The caller's block: Django's savepoint around the claim and the handler, so a
        # failure rolls back only them and the block stays usable.
        driver = _driver(inbox, connection, alias)
        with transaction.atomic(using=alias):
            return through(run, driver, False)
    except StoreError:
        raise
    except Exception as exc:
        # An IntegrityError out of the block's end, once the handler returned: its COMMIT
        # refused a row the handler wrote (a foreign key, which Django defers to COMMIT on
        # PostgreSQL and SQLite). Nothing committed: the handler's failure, not the store's.
        refused = done is not None and isinstance(exc, IntegrityError)
        if not (refused or handler_failed(exc, failures)):
            raise
        error = exc

    def again(_tx: object, _body: Any) -> R:
        raise error

    if own:
        with transaction.atomic(using=alias):
            return through(again, _driver(inbox, connection, alias), True)
    return through(again, _driver(inbox, connection, alias), True)


def _driver(inbox: Inbox, connection: Any, alias: str) -> object:
    """The DB-API connection behind Django's ``connection``, inside an atomic block, once
    the store is checked to be of a kind that joins it, on its database."""
    store = inbox.store
    kind = kind_of(store, SYNC_KINDS, _NAME, _JOINS)
    joined = cast("TransactionalStore[object]", store)
    connection.ensure_connection()
    driver = connection.connection
    _check_driver(kind, driver, str(connection.vendor), alias)
    expected = store_identity(joined, kind, inbox.consumer, driver)
    joined.check_transaction(driver)
    if not _on_database(expected, connection, driver):
        # The store's side may be stale (the server restarted or failed over since it was
        # read: PostgreSQL's start time changed); read it again before refusing.
        expected = store_identity(joined, kind, inbox.consumer, driver, again=True)
        if not _on_database(expected, connection, driver):
            raise mismatch(
                store.url,
                expected,
                getattr(connection, _IDENTITY)[1],
                side=f"Django's connection {alias!r}",
                fix=(
                    f"Use an inbox on that database, get_inbox(consumer, using={alias!r}). An "
                    "inbox made at import time is on the database the settings named then "
                    "(under the test runner, not the test database): call get_inbox where "
                    "the inbox is used (its store is opened once per database)"
                ),
            )
    return driver


def _check_driver(kind: Kind, driver: object, vendor: str, alias: str) -> None:
    cls = getattr(importlib.import_module(kind.driver_module), kind.driver_class)
    if isinstance(driver, cls):
        return
    if vendor != kind.family:
        raise TransactionsUnsupported(
            f"database {alias!r} is on {vendor}, the inbox's store ({kind.store}) on "
            f"{kind.family}: open the store on that database "
            f"(oncely.integrations.django.get_store({alias!r}))"
        )
    raise TransactionsUnsupported(
        f"{kind.store} joins {kind.driver_name} connections and Django's connection "
        f"{alias!r} is a {type(driver).__module__}.{type(driver).__name__}: "
        f"{_FIX.get(vendor, 'use a driver oncely can join')}"
    )


def _on_database(expected: Identity, connection: Any, driver: object) -> bool:
    """Whether Django's connection is on the store's database (its side read once per DB-API
    connection, kept on Django's connection wrapper). The DB-API connection itself is kept
    with its answer, not its ``id()``: one opened after it was closed (on another database,
    say) may be at its freed address, and would be taken for it."""
    seen: tuple[object, Identity] | None = getattr(connection, _IDENTITY, None)
    if seen is None or seen[0] is not driver:
        family = str(expected[0])
        with connection.cursor() as cursor:
            cursor.execute(SQL[family])
            rows = [tuple(row) for row in cursor.fetchall()]
        seen = (driver, identity_of(family, rows))
        setattr(connection, _IDENTITY, seen)
    return same_database(expected, seen[1])
