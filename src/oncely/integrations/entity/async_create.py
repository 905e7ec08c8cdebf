"""Create once in an ``AsyncSession`` or ``AsyncConnection`` (source of the generated
``sync_create``, which does the same in a ``Session`` or ``Connection``): the shells that run
what :mod:`._flow` decides. The contract is in :mod:`oncely.integrations.entity`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from sqlalchemy import CursorResult
from sqlalchemy.engine import Dialect, Result
from sqlalchemy.exc import IntegrityError

from oncely._core.fingerprint import Fingerprinter, fingerprint
from oncely._twin import ASYNC
from oncely.integrations.entity._flow import (
    MISSING,
    Answer,
    Entity,
    Flow,
    Plan,
    Reply,
    RowsOrFactory,
    Step,
    flow,
    is_duplicate_key,
    make_plan,
    shape_of,
)
from oncely.integrations.entity._result import EntityResult

if ASYNC:
    if TYPE_CHECKING:
        from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

        Conn = AsyncSession | AsyncConnection
else:
    from sqlalchemy import Connection
    from sqlalchemy.orm import Session

    Conn = Session | Connection

__all__ = ["create_batch_once_async", "create_once_async"]


async def create_once_async(
    conn: Conn,
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
    dialect = _dialect_async(conn, entity)
    plan = make_plan(
        entity, dialect, key, values, compare, fingerprint_column, payload, fingerprinter
    )
    return await _drive_async(conn, flow(plan))


async def create_batch_once_async(
    conn: Conn,
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
    dialect = _dialect_async(conn, entity)
    plan = make_plan(
        entity, dialect, key, values, compare, fingerprint_column, payload, fingerprinter, rows
    )
    if plan.dialect == "sqlite":
        await _begin_sqlite_async(conn, plan)
    async with conn.begin_nested():
        return await _drive_async(conn, flow(plan))


# --- the shells: everything above is decided in _entity_flow; these only execute ------------


def _dialect_async(conn: Conn, entity: Entity) -> Dialect:
    if ASYNC:
        from sqlalchemy.ext.asyncio import AsyncSession as Session  # noqa: PLC0415 - greenlet

    if isinstance(conn, Session):
        return conn.get_bind(clause=shape_of(entity).table).dialect
    return conn.dialect


def _answer(step: Step, result: Result[tuple[object, ...]]) -> Answer:
    rows = [dict(mapping) for mapping in result.mappings()] if step.fetch else []
    return Answer(rows, result.rowcount if isinstance(result, CursorResult) else -1)


async def _drive_async(conn: Conn, steps: Flow) -> EntityResult:
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


async def _begin_sqlite_async(conn: Conn, plan: Plan) -> None:
    if ASYNC:
        from sqlalchemy.ext.asyncio import AsyncSession as Session  # noqa: PLC0415 - greenlet

    connection = (
        await conn.connection(bind_arguments={"clause": plan.shape.table})
        if isinstance(conn, Session)
        else conn
    )
    if ASYNC:
        driver = (await connection.get_raw_connection()).driver_connection
    else:
        driver = connection.connection.dbapi_connection
    if not getattr(driver, "in_transaction", True):
        await connection.exec_driver_sql("BEGIN")
