"""The transactional inbox inside a SQLAlchemy 2 session (R7), on real SQLite, PostgreSQL and
MariaDB, with sync and asyncio sessions.

Each test makes an ORM table and oncely tables of its own (unique names) and drops them
afterwards. PostgreSQL and MariaDB tests skip without the server (fail under
ONCELY_REQUIRE_SERVICES=1).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

import oncely
from oncely.integrations import _sqlalchemy_join
from oncely.integrations.sqlalchemy import handle_in_session, handle_in_session_async
from tests.services import MYSQL_URL, POSTGRES_DSN, require

ROOT = Path(__file__).resolve().parents[2]
BACKENDS = ["sqlite", "postgresql", "mariadb"]
Outcome = oncely.Outcome


# --- fixtures: real databases, tables of our own -------------------------------------------


def _server_url(backend: str, driver: str, database: str | None = None) -> str:
    if backend == "postgresql":
        require("PostgreSQL", POSTGRES_DSN, 5432)
        url = make_url(POSTGRES_DSN).set(drivername=f"postgresql+{driver}")
    else:
        require("MariaDB", MYSQL_URL, 3306)
        url = make_url(MYSQL_URL).set(drivername=f"mysql+{driver}")
    if database is not None:
        url = url.set(database=database)
    return url.render_as_string(hide_password=False)


@dataclass
class Env:
    """One backend, an ORM model ``Booking`` on a table of its own, and oncely tables."""

    backend: str
    path: Path  # the SQLite file (unused on the servers)
    inbox_table: str
    booking: Any  # the mapped class (made per test)
    base: Any
    engine: Engine  # for set-up and checks
    closers: list[Callable[[], None]] = field(default_factory=list)

    @property
    def url(self) -> str:
        if self.backend == "sqlite":
            return f"sqlite:///{self.path}"
        return _server_url(self.backend, "psycopg" if self.backend == "postgresql" else "pymysql")

    @property
    def async_url(self) -> str:
        if self.backend == "sqlite":
            return f"sqlite+aiosqlite:///{self.path}"
        return _server_url(self.backend, "psycopg" if self.backend == "postgresql" else "aiomysql")

    def new_engine(self, url: str | None = None, **options: Any) -> Engine:
        url = url or self.url
        if url.startswith("sqlite"):
            options.setdefault("connect_args", {"check_same_thread": False})
        engine = sa.create_engine(url, **options)
        self.closers.append(engine.dispose)
        return engine

    def new_async_engine(self, url: str | None = None, **options: Any) -> AsyncEngine:
        return create_async_engine(url or self.async_url, **options)

    def store(self) -> oncely.TransactionalStore[Any]:
        t = self.inbox_table
        store: oncely.TransactionalStore[Any]
        if self.backend == "sqlite":
            store = oncely.SQLiteStore(self.path, table=t)
        elif self.backend == "postgresql":
            store = oncely.PostgresStore(POSTGRES_DSN, table=t)
        else:
            store = oncely.MySQLStore.from_url(f"{MYSQL_URL}?table={t}")
        self.closers.append(store.close)
        return store

    def async_store(self) -> oncely.AsyncTransactionalStore[Any]:
        t = self.inbox_table
        if self.backend == "sqlite":
            return oncely.AsyncSQLiteStore(self.path, table=t)
        if self.backend == "postgresql":
            return oncely.AsyncPostgresStore(POSTGRES_DSN, table=t)
        return oncely.AsyncMySQLStore.from_url(f"{MYSQL_URL}?table={t}")

    def inbox(self, consumer: str = "billing", *, migrated: bool = False) -> oncely.Inbox:
        """An inbox on a store of its own. ``migrated``: its tables made now, as an application
        does at start-up; needed on SQLite when a session writes before its first message."""
        store = self.store()
        if migrated:
            store.migrate()
        return oncely.Inbox(store, consumer=consumer)

    def rows(self) -> dict[str, int]:
        """The committed bookings, as a fresh connection sees them."""
        b = self.booking
        with self.engine.connect() as conn:
            return {r[0]: r[1] for r in conn.execute(sa.select(b.order_id, b.amount))}

    def marker(self, key: str, consumer: str = "billing") -> oncely.Record | None:
        """The committed marker, read by a store of its own."""
        store = self.store()
        return store.get(consumer, key)


def _model(table: str) -> tuple[Any, Any]:
    class Base(DeclarativeBase):
        pass

    class Booking(Base):
        __tablename__ = table
        order_id: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
        amount: Mapped[int]

    class Entry(Base):  # a generated key, read back by the ORM after its INSERT
        __tablename__ = f"{table}_entries"
        id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
        order_id: Mapped[str] = mapped_column(sa.String(64))

    Booking.entry = Entry  # type: ignore[attr-defined]
    return Base, Booking


@pytest.fixture(params=BACKENDS)
def env(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Env]:
    backend = str(request.param)
    unique = uuid.uuid4().hex[:10]
    base, booking = _model(f"osa_{unique}_bookings")
    path = tmp_path / "app.db"
    url = f"sqlite:///{path}" if backend == "sqlite" else None
    if url is None:
        url = _server_url(backend, "psycopg" if backend == "postgresql" else "pymysql")
    engine = sa.create_engine(url)
    base.metadata.create_all(engine)
    e = Env(backend, path, f"osa_{unique}_inbox", booking, base, engine)
    try:
        yield e
    finally:
        for close in reversed(e.closers):
            close()
        base.metadata.drop_all(engine)
        quote = engine.dialect.identifier_preparer.quote
        with engine.begin() as conn:
            for name in (e.inbox_table, f"{e.inbox_table}_meta"):
                conn.exec_driver_sql(f"DROP TABLE IF EXISTS {quote(name)}")
        engine.dispose()


@asynccontextmanager
async def async_parts(
    env: Env, *, migrated: bool = False
) -> AsyncIterator[tuple[AsyncEngine, Any]]:
    """An async engine on the env's database and an AsyncInbox on an async store, closed on
    this event loop afterwards."""
    engine = env.new_async_engine()
    store = env.async_store()
    if migrated:
        await store.migrate()
    try:
        yield engine, oncely.AsyncInbox(store, consumer="billing")
    finally:
        await store.aclose()
        await engine.dispose()


ORDER = {"id": "o-1", "amount": 42}


def booker(env: Env, calls: list[str]) -> Callable[[Session, dict[str, Any]], dict[str, int]]:
    def book(session: Session, order: dict[str, Any]) -> dict[str, int]:
        calls.append(order["id"])
        session.add(env.booking(order_id=order["id"], amount=order["amount"]))
        return {"booked": order["amount"]}

    return book


def async_booker(env: Env, calls: list[str]) -> Callable[..., Any]:
    async def book(session: AsyncSession, order: dict[str, Any]) -> dict[str, int]:
        calls.append(order["id"])
        session.add(env.booking(order_id=order["id"], amount=order["amount"]))
        return {"booked": order["amount"]}

    return book


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


# --- what cannot join is refused, clearly ----------------------------------------------------


def test_a_store_that_cannot_join_is_refused(tmp_path: Path) -> None:
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'm.db'}")
    inbox = oncely.Inbox(oncely.MemoryStore(), consumer="billing")
    try:
        with (
            Session(engine) as session,
            session.begin(),
            pytest.raises(oncely.TransactionsUnsupported, match="MemoryStore cannot join"),
        ):
            handle_in_session(inbox, session, "o-1", ORDER, lambda s, p: None)
    finally:
        engine.dispose()


def test_a_session_on_another_database_is_refused(env: Env, tmp_path: Path) -> None:
    if env.backend == "sqlite":
        other = f"sqlite:///{tmp_path / 'other.db'}"
    elif env.backend == "postgresql":
        other = _server_url("postgresql", "psycopg", database="postgres")
    else:
        other = _server_url("mariadb", "pymysql", database="mysql")
    engine, inbox = env.new_engine(other), env.inbox()
    with (
        Session(engine) as session,
        session.begin(),
        pytest.raises(oncely.ConfigurationError, match="must commit in the database"),
    ):
        handle_in_session(inbox, session, "o-1", ORDER, booker(env, []))
    assert env.marker("o-1") is None


def test_sqlite_store_opened_first_inside_a_written_transaction_says_to_migrate(
    tmp_path: Path,
) -> None:
    base, booking = _model("bookings")
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'w.db'}", connect_args={"timeout": 0.2})
    base.metadata.create_all(engine)
    store = oncely.SQLiteStore(tmp_path / "w.db")  # tables not made yet, file not in WAL mode
    try:
        with Session(engine) as session, session.begin():
            session.add(booking(order_id="x", amount=1))
            session.flush()  # this transaction now holds the write lock
            with pytest.raises(oncely.StoreUnavailable, match=r"store\.migrate\(\)"):
                handle_in_session(
                    oncely.Inbox(store, consumer="c"), session, "k", 1, lambda s, p: 1
                )
    finally:
        store.close()
        engine.dispose()


def test_an_in_memory_sqlite_session_is_refused(tmp_path: Path) -> None:
    engine = sa.create_engine("sqlite://")
    store = oncely.SQLiteStore(tmp_path / "s.db")
    try:
        with (
            Session(engine) as session,
            session.begin(),
            pytest.raises(oncely.ConfigurationError, match="in-memory"),
        ):
            handle_in_session(oncely.Inbox(store, consumer="c"), session, "k", 1, lambda s, p: 1)
    finally:
        store.close()
        engine.dispose()


def test_a_session_without_a_transaction_is_refused(env: Env) -> None:
    engine, inbox = env.new_engine(isolation_level="AUTOCOMMIT"), env.inbox()
    with Session(engine) as session, pytest.raises(oncely.TransactionRequired):
        handle_in_session(inbox, session, "o-1", ORDER, booker(env, []))
    assert env.rows() == {}
    assert env.marker("o-1") is None


@pytest.mark.parametrize("server", ["postgresql", "mariadb"])
async def test_a_session_of_another_family_is_refused_naming_the_fix(
    server: str, tmp_path: Path
) -> None:
    # Refused before either store touches its server: no server is needed.
    engine = create_async_engine(f"sqlite+aiosqlite:///{tmp_path / 'x.db'}")
    store: oncely.AsyncTransactionalStore[Any] = (
        oncely.AsyncPostgresStore(POSTGRES_DSN)
        if server == "postgresql"
        else oncely.AsyncMySQLStore.from_url(MYSQL_URL)
    )
    try:
        async with AsyncSession(engine) as session, session.begin():
            with pytest.raises(oncely.TransactionsUnsupported, match="the session is on sqlite"):
                await handle_in_session_async(
                    oncely.AsyncInbox(store, consumer="c"), session, "k", 1, _never
                )
    finally:
        await store.aclose()
        await engine.dispose()


async def _never(session: AsyncSession, payload: object) -> None:
    raise AssertionError("the handler must not run")


def test_an_unsupported_driver_is_named_with_the_engine_to_use() -> None:
    kind = _sqlalchemy_join.ASYNC_KINDS[0]  # AsyncPostgresStore
    with pytest.raises(oncely.TransactionsUnsupported) as raised:
        _sqlalchemy_join.check_driver(kind, object(), "postgresql", "asyncpg")
    message = str(raised.value)
    assert "postgresql+asyncpg" in message
    assert "cannot join" in message
    assert "postgresql+psycopg://" in message


def test_an_async_inbox_is_refused_by_the_sync_function(tmp_path: Path) -> None:
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'x.db'}")
    inbox = oncely.AsyncInbox(oncely.AsyncSQLiteStore(tmp_path / "x.db"), consumer="c")
    try:
        with Session(engine) as session, pytest.raises(TypeError, match="AsyncInbox"):
            handle_in_session(inbox, session, "k", 1, lambda s, p: 1)  # type: ignore[arg-type]
    finally:
        engine.dispose()


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
