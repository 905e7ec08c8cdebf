"""What the SQLAlchemy session tests (``test_sqlalchemy_*.py``) share: ``Env`` (one backend, an
ORM model on a table of its own, oncely tables), the model itself, async engines and inboxes, the
order every test books and the handlers that book it. The ``env`` fixture is in ``conftest.py``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

import oncely
from tests.services import MYSQL_URL, POSTGRES_DSN, require

Outcome = oncely.Outcome


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
