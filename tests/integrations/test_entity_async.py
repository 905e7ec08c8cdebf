"""The business entity as the dedup marker on ``AsyncSession`` / ``AsyncConnection`` (R20-R22),
on real SQLite, PostgreSQL, MariaDB: the same flow as the sync tests.

Each test makes tables of its own with unique names and drops them afterwards. PostgreSQL and
MariaDB tests skip without the server (fail under ONCELY_REQUIRE_SERVICES=1). The ``db`` and
``adb`` fixtures are in ``conftest.py``, the shared helpers in ``entity_helpers.py``.
"""

from __future__ import annotations

import asyncio
import time
from decimal import Decimal

import pytest
import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError

from oncely.integrations.entity import EntityResult, create_batch_once_async, create_once_async
from tests.integrations.entity_helpers import (
    BODY,
    CREATED,
    DUPLICATE,
    KEY_CONFLICT,
    ORDER,
    Db,
    _order_rows,
    _waits_on_lock,
)


# --- async: the same flow on AsyncSession / AsyncConnection -----------------------------
async def test_r20_async_session_copies_create_one_order_and_name_conflicts(
    adb: tuple[Db, object],
) -> None:
    from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

    db, aengine = adb
    assert isinstance(aengine, AsyncEngine)
    results = []
    for amount in ("12.50", "12.5", "99.00"):
        async with AsyncSession(aengine) as session, session.begin():
            results.append(
                await create_once_async(
                    session,
                    db.orders,
                    key={"order_id": "o-1"},
                    values={**ORDER, "amount": Decimal(amount)},
                    compare=("customer_id", "amount"),
                )
            )
    assert [r.outcome for r in results] == [CREATED, DUPLICATE, KEY_CONFLICT]
    assert results[2].differing == ("amount",)
    assert db.count(db.orders) == 1


async def test_r22_async_batch_is_all_or_nothing(adb: tuple[Db, object]) -> None:
    from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

    db, aengine = adb
    assert isinstance(aengine, AsyncEngine)

    async def batch(conn: object, rows: object) -> EntityResult:
        return await create_batch_once_async(
            conn,  # type: ignore[arg-type]
            db.orders,
            key={"order_id": "o-1"},
            values=ORDER,
            fingerprint_column="request_fingerprint",
            payload=BODY,
            rows=rows,  # type: ignore[arg-type]
        )

    async with aengine.connect() as conn:  # first statement, then the caller rolls back
        assert (await batch(conn, _order_rows(db))).outcome is CREATED
        await conn.rollback()
    async with AsyncSession(aengine) as session:
        assert (await batch(session, _order_rows(db))).outcome is CREATED
        await session.rollback()
    assert db.count(db.orders) == 0
    async with aengine.begin() as conn:
        with pytest.raises(IntegrityError):
            await batch(conn, _order_rows(db, sku=None))
        await conn.execute(sa.insert(db.outbox).values(order_id="o-9", event="after"))
    assert (db.count(db.orders), db.count(db.lines), db.count(db.outbox)) == (0, 0, 1)
    outcomes = []
    for _ in range(2):
        async with aengine.begin() as conn:
            outcomes.append((await batch(conn, _order_rows(db))).outcome)
    assert outcomes == [CREATED, DUPLICATE]
    assert (db.count(db.orders), db.count(db.lines), db.count(db.outbox)) == (1, 2, 2)


async def test_r21_async_second_creator_waits_then_reports_conflict(
    adb: tuple[Db, object],
) -> None:
    from sqlalchemy.ext.asyncio import AsyncEngine

    db, aengine = adb
    assert isinstance(aengine, AsyncEngine)
    first_committing = asyncio.Event()

    async def create(conn: object, amount: str) -> EntityResult:
        return await create_once_async(
            conn,  # type: ignore[arg-type]
            db.orders,
            key={"order_id": "o-1"},
            values={**ORDER, "amount": Decimal(amount)},
            compare=("amount",),
        )

    async def second() -> tuple[EntityResult, bool]:
        async with aengine.begin() as conn:
            (await conn.execute(sa.select(db.customers))).all()  # fixes MariaDB's snapshot
            result = await create(conn, "55.00")
            return result, first_committing.is_set()

    task: asyncio.Task[tuple[EntityResult, bool]] | None = None
    try:
        async with aengine.begin() as conn:
            assert (await create(conn, "12.50")).outcome is CREATED
            task = asyncio.create_task(second())
            deadline = time.monotonic() + 20
            while not task.done() and not await asyncio.to_thread(_waits_on_lock, db):
                assert time.monotonic() < deadline, "the second creator never waited"
                await asyncio.sleep(0.02)
            first_committing.set()
    finally:  # on a failure too: the second finishes once the first ends
        if task is not None:
            await asyncio.wait({task}, timeout=30)
    result, after_first_commit = task.result()
    assert result.outcome is KEY_CONFLICT
    assert after_first_commit
    assert db.count(db.orders) == 1
