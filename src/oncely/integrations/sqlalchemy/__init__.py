"""The transactional inbox inside a SQLAlchemy 2 session (R7): ORM writes and oncely's dedup
marker commit together, in the session you already have::

    from oncely.integrations.sqlalchemy import handle_in_session

    def book(session: Session, order: dict[str, int]) -> int:
        session.add(Booking(order_id=order["id"], amount=order["amount"]))
        return order["amount"]

    with Session(engine) as session, session.begin():
        handled = handle_in_session(inbox, session, message_id, order, book)
    handled.outcome   # processed | duplicate | key_conflict | failed | rejected
    handled.action    # ack | ack | dead_letter | retry | dead_letter

:func:`handle_in_session_async` does the same on an ``AsyncSession`` (or ``AsyncConnection``)
with an :class:`oncely.AsyncInbox`. A Core ``Connection`` works in place of a ``Session``.
*You* commit: until then ``processed`` is tentative, and a rollback leaves neither the marker
nor the handler's rows. Outcomes are those of :meth:`oncely.Inbox.handle_in_transaction`:
``duplicate`` returns the first result without calling the handler; ``failed`` means the handler
raised and its writes and the marker were rolled back (a redelivery retries) while the session
stays usable; a handler raising :class:`oncely.Reject` is ``rejected`` and the key is recorded
as poison in your transaction.

**What is joined.** The store writes its marker on the DB-API connection behind the session's
default bind (``session.connection().connection.driver_connection``), inside the session's
transaction. So
the store must be a SQL store on the same database, reached through the driver it speaks:
:class:`~oncely.PostgresStore` with psycopg 3 (``postgresql+psycopg://``; asyncpg, psycopg2 and
pg8000 are not supported), :class:`~oncely.MySQLStore` with PyMySQL (``mysql+pymysql://``, or
``mariadb+``), :class:`~oncely.SQLiteStore` with sqlite3, and for the asyncio functions
:class:`~oncely.AsyncPostgresStore` with psycopg 3, :class:`~oncely.AsyncMySQLStore` with
aiomysql, :class:`~oncely.AsyncSQLiteStore` with aiosqlite. Any other store, or a mismatched
driver, raises :class:`oncely.TransactionsUnsupported` saying what to use. A session on another
database than the store raises :class:`oncely.ConfigurationError`: the server's identity and
the database name are compared (PostgreSQL: ``current_database()`` and the postmaster's start
time; MariaDB/MySQL: ``DATABASE()``, host name, port, data directory and server id; SQLite: the
file). The store's side is read once per store, the session's once per DB-API connection (kept
in SQLAlchemy's ``connection.info``): a MySQL session that switches databases with ``USE``
after its first message is not seen. A session without an open transaction (an engine in
``AUTOCOMMIT`` mode) raises :class:`oncely.TransactionRequired`. A session with ``binds`` that
wrote through another connection than the marker's by the time the handler returns (another
engine, even on the same database: a transaction of its own, committed apart) raises
:class:`oncely.ConfigurationError` before anything commits, unless it commits in two phases
(``twophase=True``).

**Why SQLAlchemy's savepoint, not oncely's.** A savepoint lets a failing handler be rolled back
alone. If oncely set it on the driver connection, SQLAlchemy would not know: after a rollback
to it, objects the handler added would stay in the session as persistent rows that no longer
exist, and objects it changed would keep their new values. So the savepoint is the session's
own ``begin_nested()``, which on a rollback expunges what the handler added and expires what
it changed, and oncely joins with ``savepoint=False``. The order is: flush your pending
changes (so they stay outside the savepoint and survive a failing handler), open the nested
transaction (its SAVEPOINT is forced out at once: a ``Session`` emits it lazily, which would
leave the claim outside it), claim the key, run ``handler(session, payload)``, flush its
changes *inside* the savepoint (a failing flush, such as an ``IntegrityError``, is a failing
handler), store the result, release the savepoint. One savepoint per message, as with
``handle_in_transaction``.

When the handler raises, the nested transaction is rolled back (marker, rows and the session's
view of them together) and the failure is then recorded through the inbox once more, inside
oncely's own savepoint on the driver connection with a handler that re-raises the same
exception: the claim is made again, so the ``failed`` or ``rejected`` outcome, the poison
marker of a rejection and the inbox's hooks and logs are exactly those of
``handle_in_transaction``, and nothing in that second savepoint touches the session. (If a
concurrent delivery committed the key in between, that second claim reports its
``duplicate``, which is the truth.) A :class:`oncely.StoreError`, a failing rollback (MariaDB
rolls the whole transaction back on a deadlock) and ``BaseException`` propagate unchanged:
roll your transaction back, as a ``with session.begin()`` block does.

With ``savepoint=False`` no savepoint is set at all (the fastest path): a handler's exception,
:class:`~oncely.Reject` included, propagates unchanged and your transaction must roll back,
which also resets the session.

**SQLite.** Python's sqlite3 (and aiosqlite) by default does not BEGIN until the first
INSERT/UPDATE/DELETE, so a SAVEPOINT or oncely's claim could run outside any transaction and
commit at once, surviving your rollback. When the session's connection has no real transaction
yet, ``BEGIN IMMEDIATE`` is issued through it (it takes the write lock a claim needs anyway, so
concurrent deliveries wait on the busy timeout instead of failing to upgrade a read lock).
SQLAlchemy's documented recipes (``connect_args={"autocommit": False}`` on Python 3.12+, or
``isolation_level=None`` with a ``begin`` event that emits ``BEGIN``) open the transaction
themselves and are left alone. The store's own tables are created, if needed, before that
BEGIN; if your transaction already wrote before the first message, create them beforehand
(``store.migrate()`` or ``oncely migrate``), or the creation waits for your write lock.

Since 0.1.
"""

from __future__ import annotations

try:
    import sqlalchemy as _sqlalchemy  # noqa: F401 - the guard: say which extra is missing
except ImportError as exc:  # pragma: no cover - depends on the installed extras
    raise ImportError(
        "oncely.integrations.sqlalchemy needs SQLAlchemy 2 (and greenlet for the async "
        "function): pip install 'oncely[sqlalchemy]'"
    ) from exc

from oncely.integrations.sqlalchemy.async_session import handle_in_session_async
from oncely.integrations.sqlalchemy.sync_session import handle_in_session

__all__ = ["handle_in_session", "handle_in_session_async"]
