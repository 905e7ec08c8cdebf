"""The transactional inbox inside a SQLAlchemy 2 session (R7), on real SQLite, PostgreSQL and
MariaDB: the caller's rollback takes the marker and the rows with it, and a failing handler's
writes go while the session stays usable.

Each test makes an ORM table and oncely tables of its own (unique names) and drops them
afterwards. PostgreSQL and MariaDB tests skip without the server (fail under
ONCELY_REQUIRE_SERVICES=1). The ``env`` fixture is in ``conftest.py``, the shared helpers
in ``sqlalchemy_helpers.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

import oncely
from oncely.integrations.sqlalchemy import handle_in_session, handle_in_session_async
from tests.integrations.sqlalchemy_helpers import (
    ORDER,
    Env,
    Outcome,
    _model,
    async_booker,
    async_parts,
    booker,
)

# --- R7: the caller's rollback takes the marker and the rows with it -------------------------


def test_r7_caller_rollback_leaves_neither_marker_nor_rows(env: Env) -> None:
    # On SQLite this is the legacy-transaction case: nothing but our claim and the ORM insert
    # is written, and pysqlite would not BEGIN before SQLAlchemy's SAVEPOINT on its own.
    engine, inbox, calls = env.new_engine(), env.inbox(), []
    with Session(engine) as session:
        session.begin()
        handled = handle_in_session(inbox, session, "o-1", ORDER, booker(env, calls))
        assert handled.outcome is Outcome.PROCESSED  # tentative until the commit
        session.rollback()
    assert env.rows() == {}
    assert env.marker("o-1") is None
    with Session(engine) as session, session.begin():  # a redelivery processes it again
        handled = handle_in_session(inbox, session, "o-1", ORDER, booker(env, calls))
    assert handled.outcome is Outcome.PROCESSED
    assert calls == ["o-1", "o-1"]
    assert env.rows() == {"o-1": 42}


async def test_r7_async_caller_rollback_leaves_neither_marker_nor_rows(env: Env) -> None:
    calls: list[str] = []
    async with async_parts(env) as (engine, inbox):
        async with AsyncSession(engine) as session:
            await session.begin()
            handled = await handle_in_session_async(
                inbox, session, "o-1", ORDER, async_booker(env, calls)
            )
            assert handled.outcome is Outcome.PROCESSED
            await session.rollback()
        assert await inbox.get("o-1") is None
    assert env.rows() == {}
    assert env.marker("o-1") is None


def test_r7_sqlite_documented_begin_recipe_is_left_alone(tmp_path: Path) -> None:
    """SQLAlchemy's recipe for SQLite (isolation_level=None, BEGIN on the begin event) opens
    the transaction itself; a rollback still takes the marker and the rows."""
    base, booking = _model("bookings")
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'r.db'}")
    began: list[str] = []

    @sa.event.listens_for(engine, "connect")
    def _connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None

    @sa.event.listens_for(engine, "begin")
    def _begin(conn: sa.Connection) -> None:
        began.append("BEGIN")
        conn.exec_driver_sql("BEGIN")

    base.metadata.create_all(engine)
    store = oncely.SQLiteStore(tmp_path / "r.db")
    inbox = oncely.Inbox(store, consumer="billing")

    def book(session: Session, order: dict[str, Any]) -> int:
        session.add(booking(order_id=order["id"], amount=order["amount"]))
        return int(order["amount"])

    try:
        with Session(engine) as session:
            session.begin()
            assert handle_in_session(inbox, session, "o-1", ORDER, book).value == 42
            session.rollback()
        with Session(engine) as session, session.begin():
            assert handle_in_session(inbox, session, "o-2", ORDER, book).value == 42
        with engine.connect() as conn:
            assert conn.scalar(sa.select(sa.func.count()).select_from(booking)) == 1
        assert inbox.get("o-1") is None
        assert inbox.get("o-2") is not None
        assert began  # the recipe's BEGIN ran; ours was not needed
    finally:
        store.close()
        engine.dispose()


# --- R7: a failing handler: its writes go, the session stays usable ------------------------


def test_r7_handler_failure_rolls_back_its_writes_and_keeps_the_session_usable(env: Env) -> None:
    engine, inbox, calls = env.new_engine(), env.inbox(migrated=True), []
    with Session(engine) as session, session.begin():
        session.add(env.booking(order_id="before", amount=1))
        session.flush()
        earlier = session.get(env.booking, "before")
        session.add(env.booking(order_id="pending", amount=2))  # not flushed yet: ours to flush

        added: list[Any] = []  # held, so the session's weak identity map cannot forget them

        def broken(s: Session, order: dict[str, Any]) -> int:
            assert s is session
            earlier.amount = 999  # changes an object loaded before the call
            added.append(env.booking(order_id="o-1", amount=order["amount"]))
            s.add(added[-1])
            s.flush()
            added.append(env.booking(order_id="o-9", amount=9))
            s.add(added[-1])  # never flushed: must not be flushed by the caller's commit
            raise RuntimeError("ledger offline")

        handled = handle_in_session(inbox, session, "o-1", ORDER, broken)
        assert handled.outcome is Outcome.FAILED
        assert handled.action is oncely.Action.RETRY
        assert isinstance(handled.error, RuntimeError)
        assert "ledger offline" in (handled.reason or "")
        # SQLAlchemy saw the rollback: the handler's objects are gone, the change is undone.
        assert [obj in session for obj in added] == [False, False]
        assert session.get(env.booking, "o-1") is None
        assert earlier.amount == 1
        assert not session.new
        assert not session.dirty
        # The same session processes the redelivery in the same transaction.
        handled = handle_in_session(inbox, session, "o-1", ORDER, booker(env, calls))
        assert handled.outcome is Outcome.PROCESSED
    assert env.rows() == {"before": 1, "pending": 2, "o-1": 42}
    assert calls == ["o-1"]


def test_r7_failing_flush_of_the_handler_is_a_failed_outcome(env: Env) -> None:
    engine, inbox = env.new_engine(), env.inbox(migrated=True)
    with Session(engine) as session, session.begin():
        session.add(env.booking(order_id="taken", amount=1))

        def clash(s: Session, order: dict[str, Any]) -> int:
            s.add(env.booking(order_id="fresh", amount=3))
            s.add(env.booking(order_id="taken", amount=order["amount"]))  # duplicate primary key
            return 0

        handled = handle_in_session(inbox, session, "o-1", ORDER, clash)
        assert handled.outcome is Outcome.FAILED
        assert isinstance(handled.error, sa.exc.IntegrityError)
        assert session.get(env.booking, "taken").amount == 1  # usable, even on PostgreSQL
    assert env.rows() == {"taken": 1}
    assert env.marker("o-1") is None


def test_r7_unstorable_result_fails_and_rolls_back_the_handler(env: Env) -> None:
    engine, inbox = env.new_engine(), env.inbox()
    added: list[Any] = []  # held, so the session's weak identity map cannot forget it
    with Session(engine) as session, session.begin():

        def odd(s: Session, order: dict[str, Any]) -> object:
            added.append(env.booking(order_id="o-1", amount=order["amount"]))
            s.add(added[0])
            return object()  # JSON cannot hold it; found after the handler's flush

        handled = handle_in_session(inbox, session, "o-1", ORDER, odd)
        assert handled.outcome is Outcome.FAILED
        assert isinstance(handled.error, oncely.PayloadError)
        assert added[0] not in session  # not a phantom "persistent" row
        assert session.get(env.booking, "o-1") is None
    assert env.rows() == {}
    assert env.marker("o-1") is None


async def test_r7_async_handler_failure_keeps_the_session_usable(env: Env) -> None:
    calls: list[str] = []

    added: list[Any] = []

    async def broken(s: AsyncSession, order: dict[str, Any]) -> int:
        added.append(env.booking(order_id="o-1", amount=order["amount"]))
        s.add(added[-1])
        await s.flush()
        added.append(env.booking(order_id="o-9", amount=9))
        s.add(added[-1])  # pending when the handler raises
        raise RuntimeError("ledger offline")

    async with (
        async_parts(env, migrated=True) as (engine, inbox),
        AsyncSession(engine) as session,
        session.begin(),
    ):
        session.add(env.booking(order_id="before", amount=1))
        handled = await handle_in_session_async(inbox, session, "o-1", ORDER, broken)
        assert handled.outcome is Outcome.FAILED
        assert [obj in session for obj in added] == [False, False]
        assert await session.get(env.booking, "o-1") is None
        handled = await handle_in_session_async(
            inbox, session, "o-1", ORDER, async_booker(env, calls)
        )
        assert handled.outcome is Outcome.PROCESSED
    assert env.rows() == {"before": 1, "o-1": 42}


def test_r7_without_savepoint_the_exception_propagates_and_the_caller_rolls_back(
    env: Env,
) -> None:
    engine, inbox = env.new_engine(), env.inbox()

    def broken(s: Session, order: dict[str, Any]) -> int:
        s.add(env.booking(order_id="o-1", amount=order["amount"]))
        raise oncely.Reject("bad order")

    with pytest.raises(oncely.Reject), Session(engine) as session, session.begin():
        handle_in_session(inbox, session, "o-1", ORDER, broken, savepoint=False)
    assert env.rows() == {}
    assert env.marker("o-1") is None
    with Session(engine) as session, session.begin():
        handled = handle_in_session(inbox, session, "o-1", ORDER, booker(env, []), savepoint=False)
    assert handled.outcome is Outcome.PROCESSED
    assert env.rows() == {"o-1": 42}
