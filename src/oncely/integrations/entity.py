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
different: ``key_conflict``, which the caller dead-letters and alerts on, never drops.

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
exactly, as PostgreSQL's ON CONFLICT inference requires. The multi-row
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
values of the column's type; a value the database alters (a dropped time zone) reports a
key_conflict, loud rather than silently dropped. The key columns are always compared too.

Every function raises :class:`oncely.ConfigurationError` for a call that cannot work (a key that
is not the primary key or a unique constraint/index of the table, nothing to compare, unknown
names) and :class:`oncely.InvalidKey` for a key value that is ``None``; database errors other
than the conflict on the key propagate as SQLAlchemy raised them. Since 0.1.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

try:
    from sqlalchemy import Connection, CursorResult
    from sqlalchemy.engine import Dialect, Result
    from sqlalchemy.exc import IntegrityError
    from sqlalchemy.orm import Session
except ImportError as exc:  # pragma: no cover - depends on the installed extras
    raise ImportError(
        "oncely.integrations.entity needs SQLAlchemy 2 (and greenlet for the async functions): "
        "pip install 'oncely[sqlalchemy]'"
    ) from exc

from oncely._core.fingerprint import Fingerprinter, fingerprint
from oncely.integrations._entity_flow import (
    MISSING,
    Answer,
    Entity,
    Flow,
    Plan,
    Reply,
    Rows,
    RowsOrFactory,
    Step,
    flow,
    is_duplicate_key,
    make_plan,
    shape_of,
)
from oncely.integrations._entity_result import EntityOutcome, EntityResult

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

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


def create_once(
    conn: Session | Connection,
    entity: Entity,
    *,
    key: Mapping[str, object],
    values: Mapping[str, object] | None = None,
    compare: Sequence[str] = (),
    fingerprint_column: str | None = None,
    payload: object = MISSING,
    fingerprinter: Fingerprinter = fingerprint,
) -> EntityResult:
    """Create the row identified by ``key`` once, inside the caller's transaction (R20, R21).

    ``key`` maps the columns of the table's primary key or of one of its unique constraints to
    the message's key; ``values`` the other columns. A duplicate is told from a key conflict by
    ``compare`` (immutable business fields, which ``values`` must give) and/or by
    ``fingerprint_column``, where ``fingerprinter(payload)`` is stored. Names are column keys
    of a Table, or attribute names of an ORM class.

    Returns ``created`` with the inserted row, or ``duplicate`` / ``key_conflict`` with the
    stored row; the caller's transaction stays usable either way. Nothing is committed: the
    row commits (or not) with the caller's transaction, which is what makes it the marker.
    """
    dialect = _sync_dialect(conn, entity)
    plan = make_plan(
        entity, dialect, key, values, compare, fingerprint_column, payload, fingerprinter
    )
    return _drive(conn, flow(plan))


def create_batch_once(
    conn: Session | Connection,
    entity: Entity,
    *,
    key: Mapping[str, object],
    rows: RowsOrFactory,
    values: Mapping[str, object] | None = None,
    compare: Sequence[str] = (),
    fingerprint_column: str | None = None,
    payload: object = MISSING,
    fingerprinter: Fingerprinter = fingerprint,
) -> EntityResult:
    """Create the marker row and ``rows`` together, all or nothing, once (R22).

    ``rows`` is a sequence of ``(table_or_model, values)`` (order lines, an outbox row...), or
    a function of the created marker row that returns one (for a generated id). The marker is
    inserted first inside one SAVEPOINT: on a conflict on its key nothing else is written and
    the result is ``duplicate`` or ``key_conflict`` as for :func:`create_once`; if any row
    fails, the savepoint is rolled back (nothing of this call is written, the caller's earlier
    work stays) and the error propagates. On SQLite a transaction that has not written yet is
    begun first: Python's sqlite3 does not BEGIN before a SAVEPOINT, whose RELEASE would then
    commit the batch on its own, outside the caller's transaction.
    """
    dialect = _sync_dialect(conn, entity)
    plan = make_plan(
        entity, dialect, key, values, compare, fingerprint_column, payload, fingerprinter, rows
    )
    if plan.dialect == "sqlite":
        _begin_sqlite(conn, plan)
    with conn.begin_nested():
        return _drive(conn, flow(plan))


async def create_once_async(
    conn: AsyncSession | AsyncConnection,
    entity: Entity,
    *,
    key: Mapping[str, object],
    values: Mapping[str, object] | None = None,
    compare: Sequence[str] = (),
    fingerprint_column: str | None = None,
    payload: object = MISSING,
    fingerprinter: Fingerprinter = fingerprint,
) -> EntityResult:
    """:func:`create_once` on an ``AsyncSession`` or ``AsyncConnection``."""
    dialect = _async_dialect(conn, entity)
    plan = make_plan(
        entity, dialect, key, values, compare, fingerprint_column, payload, fingerprinter
    )
    return await _drive_async(conn, flow(plan))


async def create_batch_once_async(
    conn: AsyncSession | AsyncConnection,
    entity: Entity,
    *,
    key: Mapping[str, object],
    rows: RowsOrFactory,
    values: Mapping[str, object] | None = None,
    compare: Sequence[str] = (),
    fingerprint_column: str | None = None,
    payload: object = MISSING,
    fingerprinter: Fingerprinter = fingerprint,
) -> EntityResult:
    """:func:`create_batch_once` on an ``AsyncSession`` or ``AsyncConnection``."""
    dialect = _async_dialect(conn, entity)
    plan = make_plan(
        entity, dialect, key, values, compare, fingerprint_column, payload, fingerprinter, rows
    )
    if plan.dialect == "sqlite":
        await _begin_sqlite_async(conn, plan)
    async with conn.begin_nested():
        return await _drive_async(conn, flow(plan))


# --- the shells: everything above is decided in _entity_flow; these only execute ------------


def _sync_dialect(conn: Session | Connection, entity: Entity) -> Dialect:
    if isinstance(conn, Session):
        return conn.get_bind(clause=shape_of(entity).table).dialect
    return conn.dialect


def _async_dialect(conn: AsyncSession | AsyncConnection, entity: Entity) -> Dialect:
    from sqlalchemy.ext.asyncio import AsyncSession  # noqa: PLC0415 - needs greenlet

    if isinstance(conn, AsyncSession):
        return conn.get_bind(clause=shape_of(entity).table).dialect
    return conn.dialect


def _answer(step: Step, result: Result[tuple[object, ...]]) -> Answer:
    rows = [dict(mapping) for mapping in result.mappings()] if step.fetch else []
    return Answer(rows, result.rowcount if isinstance(result, CursorResult) else -1)


def _drive(conn: Session | Connection, steps: Flow) -> EntityResult:
    step = next(steps)
    try:
        while True:
            reply: Reply
            try:
                reply = _answer(step, conn.execute(step.statement, step.params))
            except IntegrityError as error:
                if not (step.duplicate_ok and is_duplicate_key(error)):
                    raise
                reply = error
            step = steps.send(reply)
    except StopIteration as done:
        result: EntityResult = done.value
        return result
    finally:
        steps.close()


async def _drive_async(conn: AsyncSession | AsyncConnection, steps: Flow) -> EntityResult:
    step = next(steps)
    try:
        while True:
            reply: Reply
            try:
                reply = _answer(step, await conn.execute(step.statement, step.params))
            except IntegrityError as error:
                if not (step.duplicate_ok and is_duplicate_key(error)):
                    raise
                reply = error
            step = steps.send(reply)
    except StopIteration as done:
        result: EntityResult = done.value
        return result
    finally:
        steps.close()


# Python's sqlite3 (and aiosqlite) in its default "legacy" mode does not BEGIN before a
# SAVEPOINT, so a savepoint opened first in a transaction runs on its own and its RELEASE
# commits: the batch would survive the caller's rollback. Opening the transaction SQLAlchemy
# already believes open keeps the batch inside it.


def _begin_sqlite(conn: Session | Connection, plan: Plan) -> None:
    connection = (
        conn.connection(bind_arguments={"clause": plan.shape.table})
        if isinstance(conn, Session)
        else conn
    )
    if not getattr(connection.connection.dbapi_connection, "in_transaction", True):
        connection.exec_driver_sql("BEGIN")


async def _begin_sqlite_async(conn: AsyncSession | AsyncConnection, plan: Plan) -> None:
    from sqlalchemy.ext.asyncio import AsyncSession  # noqa: PLC0415 - needs greenlet

    connection = (
        await conn.connection(bind_arguments={"clause": plan.shape.table})
        if isinstance(conn, AsyncSession)
        else conn
    )
    raw = await connection.get_raw_connection()
    if not getattr(raw.driver_connection, "in_transaction", True):
        await connection.exec_driver_sql("BEGIN")
