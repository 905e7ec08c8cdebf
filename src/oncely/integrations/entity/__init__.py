"""The business entity as the dedup marker (R6, R20-R22), on SQLAlchemy 2.

No inbox table: the entity's unique key IS the dedup key. An order stored under its order id is
created once, whatever number of copies of the order message arrive::

    from oncely.integrations.entity import EntityOutcome, create_once

    with Session(engine) as session, session.begin():
        result = create_once(
            session, Order,
            key={"order_id": message_id},                 # R20 step 1: the MessageId
            values={"customer_id": c, "amount": a},
            fingerprint_column="request_fingerprint", payload=body,   # or compare=(...)
        )
    result.outcome   # created | duplicate | key_conflict
    result.action    # ack | ack | dead_letter  (result.handled(consumer) for adapters)

**Inbox table or entity?** (R6) The inbox (:class:`oncely.Inbox`) is one table shared by every
message type and consumer, keeps results, leases and retention, and suits effects outside the
database (two-phase mode, R10). The entity marker needs no extra table and no cleanup (the row
*is* the business data, kept as long as the business keeps it), but it is tied to one entity
type with a natural unique key, and the effect must be the creation of that row (plus, with
:func:`create_batch_once`, rows written with it). Prefer it when a message creates one business
record under the producer's id; prefer the inbox when messages update, call out, or are many
types.

**Steps** (R20): (2) try to *create* the row; the create is the check and the write in one
statement, so of two concurrent copies exactly one creates (R21); (4) on a conflict on the key,
read the stored row; (5) equal stored fingerprint / immutable fields: ``duplicate``; (6)
different: ``key_conflict``, which the caller dead-letters and alerts on, never drops (it is
also logged at ERROR on the ``oncely.entity`` logger, as the inbox logs its own).

**Why no exception escapes on a conflict, and why the caller's transaction survives it.**
PostgreSQL aborts a whole transaction on a unique violation, so the insert must not raise there:
on PostgreSQL and SQLite it is ``INSERT ... ON CONFLICT (key) DO NOTHING RETURNING ...``. That
absorbs a conflict on exactly the key's unique index and nothing else (NOT NULL, CHECK, foreign
keys and other unique constraints still raise), and costs no subtransaction (PostgreSQL's
savepoints are subtransactions, with known costs under load). MySQL/MariaDB have no targeted
equivalent (``INSERT IGNORE`` turns NOT NULL and foreign-key errors into warnings,
``ON DUPLICATE KEY UPDATE`` absorbs every unique key), but InnoDB rolls back only the failed
statement, so a plain INSERT is used and a duplicate-key error is caught. In every case the row
is then re-read *by key*: no row means the conflict was on something else, and the original
error propagates; a row means the outcome is about it (even if the new row would also have
broken another constraint). The key must match the primary key or a unique constraint/index
exactly, as PostgreSQL's ON CONFLICT inference requires; a partial (``WHERE``) or expression
unique index is not one. The multi-row
:func:`create_batch_once` adds one SAVEPOINT (``begin_nested``), because undoing the rows
written before a failing one needs it (R22).

**Concurrency.** A second creator of the same key waits on the unique index until the first
commits, then reads the winner's row: on PostgreSQL ON CONFLICT returns only once that row is
committed; on MySQL/MariaDB REPEATABLE READ the read is a locking read (``LOCK IN SHARE MODE``),
which sees the latest committed row rather than the transaction's snapshot. SQLite serialises
writers with its database lock; a transaction that *read* before this call may get "database is
locked" instead of waiting (start it with ``BEGIN IMMEDIATE``). Under PostgreSQL REPEATABLE
READ or SERIALIZABLE a concurrent winner raises a serialization failure: retry the message.

**Comparison.** The fingerprint (:func:`oncely.fingerprint`, or a
:meth:`oncely.Fingerprint.fields` fingerprinter that leaves volatile fields out) is stored in a
column of the entity and compared as text, which is exact. ``compare`` fields are compared with
Python equality on the values as the database returns them (numbers by decimal value), so pass
values of the column's type: a string for a numeric, date, time or UUID column, a number for a
text column, a number with more decimal places than its ``Numeric`` column keeps, a float
that its column keeps in single precision (MySQL/MariaDB's ``FLOAT``, PostgreSQL's ``REAL``)
changes, and a
datetime or time whose time zone or fraction of a second its column drops (only PostgreSQL's
``timezone=True`` columns keep a zone, and give one back even for a naive value; MySQL/MariaDB
keep fractions only to the column's ``fsp``) are refused before anything is written (every
copy would otherwise be a key_conflict, or, for a key read back by a changed value, fail).
CHAR(n) text is compared without trailing spaces on PostgreSQL and MySQL/MariaDB, as those
compare it (they give it back padded, or stripped). Another value the database alters reports
a key_conflict, loud rather than silently dropped. The key columns are always compared too.

An ORM class of a polymorphic hierarchy in one table gets its identity in the discriminator
column, as a flush would give it, and that column is compared (a copy as another class is a
key_conflict); a class whose rows span tables (joined-table inheritance) is refused.

Every function raises :class:`oncely.ConfigurationError` for a call that cannot work (a key that
is not the primary key or a unique constraint/index of the table, nothing to compare, unknown
names) and :class:`oncely.InvalidKey` for a key value that is ``None``; database errors other
than the conflict on the key propagate as SQLAlchemy raised them. Since 0.1.
"""

from __future__ import annotations

try:
    import sqlalchemy as _sqlalchemy  # noqa: F401 - the guard: say which extra is missing
except ImportError as exc:  # pragma: no cover - depends on the installed extras
    raise ImportError(
        "oncely.integrations.entity needs SQLAlchemy 2 (and greenlet for the async functions): "
        "pip install 'oncely[sqlalchemy]'"
    ) from exc

from oncely.integrations.entity._flow import Entity, Rows
from oncely.integrations.entity._result import EntityOutcome, EntityResult
from oncely.integrations.entity.async_create import create_batch_once_async, create_once_async
from oncely.integrations.entity.sync_create import create_batch_once, create_once

__all__ = [
    "Entity",
    "EntityOutcome",
    "EntityResult",
    "Rows",
    "create_batch_once",
    "create_batch_once_async",
    "create_once",
    "create_once_async",
]
