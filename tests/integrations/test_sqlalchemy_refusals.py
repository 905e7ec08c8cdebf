"""The transactional inbox inside a SQLAlchemy 2 session (R7): what cannot join the session's
transaction is refused, clearly (a store that cannot join, another database, an in-memory
SQLite, no transaction, another family, an unsupported driver, an async inbox).

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
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

import oncely
from oncely.integrations._joined import kinds as _sqlalchemy_join
from oncely.integrations.sqlalchemy import handle_in_session, handle_in_session_async
from tests.integrations.sqlalchemy_helpers import (
    ORDER,
    Env,
    _model,
    _server_url,
    async_booker,
    async_parts,
    booker,
)
from tests.services import MYSQL_URL, POSTGRES_DSN

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
            # The store reads its schema through the session's connection: no wait on the
            # session's own write lock, a typed answer at once.
            with pytest.raises(oncely.SchemaMissing, match=r"migrate"):
                handle_in_session(
                    oncely.Inbox(store, consumer="c"), session, "k", 1, lambda s, p: 1
                )
    finally:
        store.close()
        engine.dispose()


@pytest.mark.parametrize("both", [False, True], ids=["session-in-memory", "both-in-memory"])
def test_an_in_memory_sqlite_session_is_refused(tmp_path: Path, both: bool) -> None:
    # Both in memory: before, the two empty paths compared equal and the store's own (empty)
    # database answered SchemaMissing, "run oncely migrate", which cannot help.
    engine = sa.create_engine("sqlite://")
    store = oncely.SQLiteStore(":memory:" if both else tmp_path / "s.db")
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
    with (
        Session(engine) as session,
        pytest.raises(oncely.TransactionRequired, match=r"session\.begin\(\)") as refused,
    ):
        handle_in_session(inbox, session, "o-1", ORDER, booker(env, []))
    assert "AUTOCOMMIT" in str(refused.value)
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


@pytest.mark.parametrize("env", ["sqlite"], indirect=True)
def test_what_is_not_a_session_is_refused_and_a_scoped_session_is_taken(env: Env) -> None:
    """Before, a scoped_session (Flask-SQLAlchemy's ``db.session``), an Engine or an
    AsyncSession given to ``handle_in_session`` failed with an AttributeError."""
    from sqlalchemy.orm import scoped_session, sessionmaker

    engine, inbox = env.new_engine(), env.inbox(migrated=True)
    calls: list[str] = []
    registry = scoped_session(sessionmaker(engine))
    try:
        with registry.begin():
            done = handle_in_session(inbox, registry, "o-1", ORDER, booker(env, calls))
        assert done.outcome is oncely.Outcome.PROCESSED and calls == [ORDER["id"]]
    finally:
        registry.remove()
    with pytest.raises(TypeError, match=r"engine\.begin"):
        handle_in_session(inbox, engine, "o-2", ORDER, booker(env, calls))  # type: ignore[arg-type]
    async_engine = create_async_engine(env.async_url)
    with pytest.raises(TypeError, match="handle_in_session_async"):
        handle_in_session(inbox, AsyncSession(async_engine), "o-3", ORDER, booker(env, calls))  # type: ignore[arg-type]


def test_r7_a_handler_writing_through_another_bind_is_refused(env: Env) -> None:
    """A session with ``binds`` sends the bookings through another engine: another
    connection, another transaction, committed apart from the one holding the marker (a crash
    between the two commits keeps one without the other: a lost message or a duplicate).
    Refused before anything commits, naming the two; the caller's transaction rolls back."""
    if env.backend == "sqlite":
        pytest.skip("a second SQLite connection waits on the first's write lock")
    main, other = env.new_engine(), env.new_engine()
    inbox = env.inbox()
    with (
        Session(bind=main, binds={env.booking: other}) as session,
        pytest.raises(oncely.ConfigurationError, match="another connection"),
        session.begin(),
    ):
        handle_in_session(inbox, session, "o-1", ORDER, booker(env, []))
    assert env.rows() == {}
    assert env.marker("o-1") is None


async def test_r7_an_async_handler_writing_through_another_bind_is_refused(env: Env) -> None:
    if env.backend == "sqlite":
        pytest.skip("a second SQLite connection waits on the first's write lock")
    async with async_parts(env) as (engine, inbox):
        other = env.new_async_engine()
        try:
            async with AsyncSession(bind=engine, binds={env.booking: other}) as session:
                with pytest.raises(oncely.ConfigurationError, match="another connection"):
                    async with session.begin():
                        await handle_in_session_async(
                            inbox, session, "o-1", ORDER, async_booker(env, [])
                        )
        finally:
            await other.dispose()
    assert env.rows() == {}
    assert env.marker("o-1") is None
