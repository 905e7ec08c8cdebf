"""The transactional inbox inside a SQLAlchemy 2 session (R7), on real SQLite, PostgreSQL and
MariaDB, with sync and asyncio sessions: processed then duplicate, rejected and key_conflict
(R20), concurrent deliveries of one key (R8), and the example.

Each test makes an ORM table and oncely tables of its own (unique names) and drops them
afterwards. PostgreSQL and MariaDB tests skip without the server (fail under
ONCELY_REQUIRE_SERVICES=1). The ``env`` fixture is in ``conftest.py``, the shared helpers
in ``sqlalchemy_helpers.py``.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

import oncely
from oncely.integrations.sqlalchemy import handle_in_session, handle_in_session_async
from tests.integrations.sqlalchemy_helpers import (
    ORDER,
    Env,
    Outcome,
    async_booker,
    async_parts,
    booker,
)

ROOT = Path(__file__).resolve().parents[2]


# --- R7: processed, then duplicate; one row ------------------------------------------------


def test_r7_processed_then_duplicate_writes_one_row(env: Env) -> None:
    engine, inbox, calls = env.new_engine(), env.inbox(), []
    outcomes = []
    for _ in range(3):
        with Session(engine) as session, session.begin():
            handled = handle_in_session(inbox, session, "o-1", ORDER, booker(env, calls))
        outcomes.append((handled.outcome, handled.value))
    assert outcomes == [
        (Outcome.PROCESSED, {"booked": 42}),
        (Outcome.DUPLICATE, {"booked": 42}),  # the first result, the handler not called
        (Outcome.DUPLICATE, {"booked": 42}),
    ]
    assert calls == ["o-1"]
    assert env.rows() == {"o-1": 42}
    marker = env.marker("o-1")
    assert marker is not None
    assert marker.status is oncely.Status.COMPLETED


async def test_r7_async_processed_then_duplicate_writes_one_row(env: Env) -> None:
    calls: list[str] = []
    async with async_parts(env) as (engine, inbox):
        outcomes = []
        for _ in range(2):
            async with AsyncSession(engine) as session, session.begin():
                handled = await handle_in_session_async(
                    inbox, session, "o-1", ORDER, async_booker(env, calls)
                )
            outcomes.append((handled.outcome, handled.value))
    assert outcomes == [(Outcome.PROCESSED, {"booked": 42}), (Outcome.DUPLICATE, {"booked": 42})]
    assert calls == ["o-1"]
    assert env.rows() == {"o-1": 42}


def test_r7_core_connection_joins_like_a_session(env: Env) -> None:
    engine, inbox = env.new_engine(), env.inbox()
    table = env.booking.__table__

    def book(conn: sa.Connection, order: dict[str, Any]) -> int:
        conn.execute(sa.insert(table).values(order_id=order["id"], amount=order["amount"]))
        return int(order["amount"])

    def fail(conn: sa.Connection, order: dict[str, Any]) -> int:
        conn.execute(sa.insert(table).values(order_id="o-2", amount=1))
        raise RuntimeError("no")

    with engine.begin() as conn:
        assert handle_in_session(inbox, conn, "o-2", ORDER, fail).outcome is Outcome.FAILED
        assert handle_in_session(inbox, conn, "o-1", ORDER, book).value == 42
        assert conn.scalar(sa.select(sa.func.count()).select_from(table)) == 1  # usable
    with engine.begin() as conn:
        assert handle_in_session(inbox, conn, "o-1", ORDER, book).outcome is Outcome.DUPLICATE
    assert env.rows() == {"o-1": 42}
    assert env.marker("o-2") is None


async def test_r7_async_core_connection_joins_like_a_session(env: Env) -> None:
    table = env.booking.__table__

    async def book(conn: Any, order: dict[str, Any]) -> int:
        await conn.execute(sa.insert(table).values(order_id=order["id"], amount=order["amount"]))
        return int(order["amount"])

    async def fail(conn: Any, order: dict[str, Any]) -> int:
        await conn.execute(sa.insert(table).values(order_id="o-2", amount=1))
        raise RuntimeError("no")

    async with async_parts(env) as (engine, inbox):
        async with engine.begin() as conn:
            failed = await handle_in_session_async(inbox, conn, "o-2", ORDER, fail)
            processed = await handle_in_session_async(inbox, conn, "o-1", ORDER, book)
        async with engine.begin() as conn:
            duplicate = await handle_in_session_async(inbox, conn, "o-1", ORDER, book)
    assert [failed.outcome, processed.outcome, duplicate.outcome] == [
        Outcome.FAILED,
        Outcome.PROCESSED,
        Outcome.DUPLICATE,
    ]
    assert env.rows() == {"o-1": 42}


def test_r7_generated_ids_in_the_handler_are_the_rows_own(env: Env) -> None:
    """The claim runs first on the same connection (on MariaDB it sets LAST_INSERT_ID()); the
    ids the ORM reads back for the handler's rows are still the rows' own."""
    engine, inbox = env.new_engine(), env.inbox()
    entry = env.booking.entry

    def note(session: Session, order: dict[str, Any]) -> list[int]:
        rows = [entry(order_id=order["id"]) for _ in range(2)]
        session.add_all(rows)
        session.flush()
        return [row.id for row in rows]

    ids = []
    for key in ("o-1", "o-2"):
        with Session(engine) as session, session.begin():
            ids.extend(handle_in_session(inbox, session, key, {"id": key}, note).unwrap())
    with engine.connect() as conn:
        stored = dict(conn.execute(sa.select(entry.id, entry.order_id)).all())
    assert len(set(ids)) == 4
    assert stored == dict(zip(ids, ["o-1", "o-1", "o-2", "o-2"], strict=True))


# --- R20: rejected (poison) and key_conflict ------------------------------------------------


def test_r20_rejected_records_the_poison_key_without_the_handlers_writes(env: Env) -> None:
    engine, inbox, calls = env.new_engine(), env.inbox(), []

    def poison(s: Session, order: dict[str, Any]) -> int:
        calls.append(order["id"])
        s.add(env.booking(order_id="o-1", amount=order["amount"]))
        raise oncely.Reject("amount out of range")

    for _ in range(2):
        with Session(engine) as session, session.begin():
            handled = handle_in_session(inbox, session, "o-1", ORDER, poison)
        assert handled.outcome is Outcome.REJECTED
        assert handled.action is oncely.Action.DEAD_LETTER
        assert "amount out of range" in (handled.reason or "")
    assert calls == ["o-1"]  # the redelivery was rejected without running the handler
    assert env.rows() == {}
    marker = env.marker("o-1")
    assert marker is not None
    assert marker.status is oncely.Status.FAILED


async def test_r20_async_rejected_and_key_conflict(env: Env) -> None:
    async with async_parts(env) as (engine, inbox):

        async def poison(s: AsyncSession, order: dict[str, Any]) -> int:
            s.add(env.booking(order_id="p-1", amount=1))
            raise oncely.Reject("poison")

        async with AsyncSession(engine) as session, session.begin():
            rejected = await handle_in_session_async(inbox, session, "p-1", ORDER, poison)
            processed = await handle_in_session_async(
                inbox, session, "o-1", ORDER, async_booker(env, [])
            )
        async with AsyncSession(engine) as session, session.begin():
            conflict = await handle_in_session_async(
                inbox, session, "o-1", {**ORDER, "amount": 7}, async_booker(env, [])
            )
    assert rejected.outcome is Outcome.REJECTED
    assert processed.outcome is Outcome.PROCESSED
    assert conflict.outcome is Outcome.KEY_CONFLICT
    assert env.rows() == {"o-1": 42}


def test_r20_same_key_other_content_is_key_conflict(env: Env) -> None:
    engine, inbox, calls = env.new_engine(), env.inbox(), []
    with Session(engine) as session, session.begin():
        handle_in_session(inbox, session, "o-1", ORDER, booker(env, calls))
    with Session(engine) as session, session.begin():
        handled = handle_in_session(
            inbox, session, "o-1", {**ORDER, "amount": 7}, booker(env, calls)
        )
    assert handled.outcome is Outcome.KEY_CONFLICT
    assert handled.action is oncely.Action.DEAD_LETTER
    assert calls == ["o-1"]
    assert env.rows() == {"o-1": 42}


# --- R8: concurrent deliveries of one key ---------------------------------------------------


def test_r8_concurrent_deliveries_from_two_threads_write_one_row(env: Env) -> None:
    engine, inbox, calls = env.new_engine(), env.inbox(), []
    start = threading.Barrier(2)
    results: list[oncely.Handled[Any]] = []
    errors: list[BaseException] = []

    def slow(session: Session, order: dict[str, Any]) -> int:
        calls.append(order["id"])
        session.add(env.booking(order_id=order["id"], amount=order["amount"]))
        session.flush()
        time.sleep(0.3)  # hold the claim while the other delivery arrives
        return int(order["amount"])

    def deliver() -> None:
        try:
            start.wait(10)
            with Session(engine) as session, session.begin():
                results.append(handle_in_session(inbox, session, "o-1", ORDER, slow))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=deliver) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    assert sorted(h.outcome.value for h in results) == ["duplicate", "processed"]
    assert [h.value for h in results] == [42, 42]
    assert calls == ["o-1"]
    assert env.rows() == {"o-1": 42}


async def test_r8_async_concurrent_deliveries_write_one_row(env: Env) -> None:
    calls: list[str] = []
    async with async_parts(env) as (engine, inbox):

        async def slow(session: AsyncSession, order: dict[str, Any]) -> int:
            calls.append(order["id"])
            session.add(env.booking(order_id=order["id"], amount=order["amount"]))
            await session.flush()
            await asyncio.sleep(0.3)
            return int(order["amount"])

        async def deliver() -> oncely.Handled[int]:
            async with AsyncSession(engine) as session, session.begin():
                return await handle_in_session_async(inbox, session, "o-1", ORDER, slow)

        results = await asyncio.wait_for(asyncio.gather(deliver(), deliver()), 60)
    assert sorted(h.outcome.value for h in results) == ["duplicate", "processed"]
    assert calls == ["o-1"]
    assert env.rows() == {"o-1": 42}


# --- the example -----------------------------------------------------------------------------


def test_r7_example_runs(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "sqlalchemy_session.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "delivery 1: processed {'booked': 42}",
        "delivery 2: duplicate {'booked': 42}",
        "ledger offline: failed -> retry, session still usable",
        "changed amount: key_conflict -> dead_letter",
        "rolled back: processed, then neither marker nor booking",
        "bookings: [('o-1', 42)]",
    ]
