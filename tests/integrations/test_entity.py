"""The business entity as the dedup marker (R6, R20-R22), on real SQLite, PostgreSQL, MariaDB.

Each test makes tables of its own with unique names and drops them afterwards. PostgreSQL and
MariaDB tests skip without the server (fail under ONCELY_REQUIRE_SERVICES=1).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.dialects import mysql, oracle, sqlite
from sqlalchemy.engine import Connection, Engine, make_url
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import DeclarativeBase, Session

import oncely
from oncely.integrations import _entity_flow
from oncely.integrations.entity import (
    EntityOutcome,
    EntityResult,
    create_batch_once,
    create_batch_once_async,
    create_once,
    create_once_async,
)
from tests.services import MYSQL_URL, POSTGRES_DSN, REQUIRED, require

ROOT = Path(__file__).resolve().parents[2]
BACKENDS = ["sqlite", "postgresql", "mariadb"]
CREATED, DUPLICATE, KEY_CONFLICT = (
    EntityOutcome.CREATED,
    EntityOutcome.DUPLICATE,
    EntityOutcome.KEY_CONFLICT,
)


# --- fixtures: real databases, tables of our own -----------------------------------------


def _url(backend: str, tmp_path: Path, *, asynchronous: bool = False) -> str:
    if backend == "sqlite":
        return f"sqlite+{'aiosqlite' if asynchronous else 'pysqlite'}:///{tmp_path / 'e.db'}"
    if backend == "postgresql":
        require("PostgreSQL", POSTGRES_DSN, 5432)
        url = make_url(POSTGRES_DSN).set(drivername="postgresql+psycopg")
    else:
        require("MariaDB", MYSQL_URL, 3306)
        driver = "mysql+aiomysql" if asynchronous else "mysql+pymysql"
        url = make_url(MYSQL_URL).set(drivername=driver)
    return url.render_as_string(hide_password=False)


def _engine(url: str) -> Engine:
    engine = sa.create_engine(
        url, connect_args={"check_same_thread": False} if "sqlite" in url else {}
    )
    if url.startswith("sqlite"):
        sa.event.listen(engine, "connect", _sqlite_foreign_keys)
    return engine


def _sqlite_foreign_keys(dbapi_connection: object, _record: object) -> None:
    dbapi_connection.execute("PRAGMA foreign_keys=ON")  # type: ignore[attr-defined]


@dataclass
class Db:
    backend: str
    engine: Engine
    url: str
    customers: sa.Table
    orders: sa.Table
    lines: sa.Table
    outbox: sa.Table

    def count(self, table: sa.Table) -> int:
        with self.engine.connect() as conn:
            return int(conn.scalar(sa.select(sa.func.count()).select_from(table)) or 0)

    def amount(self, order_id: str) -> Decimal:
        with self.engine.connect() as conn:
            value = conn.scalar(
                sa.select(self.orders.c.amount).where(self.orders.c.order_id == order_id)
            )
        return Decimal(value)


def _tables(metadata: sa.MetaData) -> tuple[sa.Table, sa.Table, sa.Table, sa.Table]:
    prefix = f"oe_{uuid.uuid4().hex[:10]}_"
    customers = sa.Table(
        prefix + "customers", metadata, sa.Column("customer_id", sa.String(50), primary_key=True)
    )
    orders = sa.Table(
        prefix + "orders",
        metadata,
        sa.Column("order_id", sa.String(64), primary_key=True),
        sa.Column(
            "customer_id", sa.String(50), sa.ForeignKey(customers.c.customer_id), nullable=False
        ),
        sa.Column("amount", sa.Numeric(10, 2), nullable=False),
        sa.Column("email", sa.String(100), unique=True),
        sa.Column("request_fingerprint", sa.String(40)),
        sa.Column("note", sa.String(100)),  # written, never compared (a volatile field)
    )
    lines = sa.Table(
        prefix + "lines",
        metadata,
        sa.Column("order_id", sa.String(64), sa.ForeignKey(orders.c.order_id), primary_key=True),
        sa.Column("line_no", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("sku", sa.String(20), nullable=False),
        sa.Column("qty", sa.Integer, nullable=False),
    )
    outbox = sa.Table(
        prefix + "outbox",
        metadata,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("order_id", sa.String(64), nullable=False),
        sa.Column("event", sa.String(100), nullable=False),
    )
    return customers, orders, lines, outbox


@pytest.fixture(params=BACKENDS)
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Db]:
    url = _url(str(request.param), tmp_path)
    engine = _engine(url)
    metadata = sa.MetaData()
    customers, orders, lines, outbox = _tables(metadata)
    metadata.create_all(engine)
    with engine.begin() as conn:
        conn.execute(sa.insert(customers), [{"customer_id": "c-1"}, {"customer_id": "c-2"}])
    try:
        yield Db(str(request.param), engine, url, customers, orders, lines, outbox)
    finally:
        metadata.drop_all(engine)
        engine.dispose()


ORDER = {"customer_id": "c-1", "amount": Decimal("12.50")}
BODY = {"order_id": "o-1", "customer_id": "c-1", "amount": "12.50", "sent_at": "10:00"}


def _by_fields(
    conn: Connection | Session, db: Db, order_id: str = "o-1", **changes: object
) -> EntityResult:
    return create_once(
        conn,
        db.orders,
        key={"order_id": order_id},
        values={**ORDER, **changes},
        compare=("customer_id", "amount"),
    )


def _by_fingerprint(conn: Connection | Session, db: Db, body: dict[str, object]) -> EntityResult:
    return create_once(
        conn,
        db.orders,
        key={"order_id": "o-1"},
        values=ORDER,
        fingerprint_column="request_fingerprint",
        payload=body,
    )


# --- R20: the worked example -----------------------------------------------------------


def test_r20_r6_copies_of_an_order_create_one_order_compared_by_fields(db: Db) -> None:
    outcomes = []
    for delivery in range(3):
        with db.engine.begin() as conn:
            result = _by_fields(conn, db, note=f"delivery {delivery}")
        outcomes.append(result.outcome)
        assert result.row["order_id"] == "o-1"
        assert result.row["note"] == "delivery 0"  # the row as stored: the first copy's
        assert Decimal(str(result.row["amount"])) == Decimal("12.50")
    assert outcomes == [CREATED, DUPLICATE, DUPLICATE]
    assert db.count(db.orders) == 1


def test_r20_r6_copies_of_an_order_create_one_order_compared_by_fingerprint(db: Db) -> None:
    results = []
    for _ in range(3):
        with db.engine.begin() as conn:
            results.append(_by_fingerprint(conn, db, BODY))
    assert [r.outcome for r in results] == [CREATED, DUPLICATE, DUPLICATE]
    assert results[0].row["request_fingerprint"] == oncely.fingerprint(BODY)
    assert results[1].row == results[0].row
    assert db.count(db.orders) == 1


def test_r20_reused_order_id_with_other_content_is_key_conflict_naming_the_fields(db: Db) -> None:
    with db.engine.begin() as conn:
        assert _by_fields(conn, db).outcome is CREATED
    with db.engine.begin() as conn:
        result = _by_fields(conn, db, amount=Decimal("99.99"), customer_id="c-2")
    assert result.outcome is KEY_CONFLICT
    assert result.differing == ("customer_id", "amount")
    assert result.reason is not None
    assert "customer_id, amount" in result.reason
    assert "99.99" not in result.reason  # names fields, never payload values
    assert result.action is oncely.Action.DEAD_LETTER
    assert result.outcome.as_outcome is oncely.Outcome.KEY_CONFLICT
    assert Decimal(str(result.row["amount"])) == Decimal("12.50")  # the stored row, untouched
    assert db.amount("o-1") == Decimal("12.50")
    assert db.count(db.orders) == 1


def test_r20_reused_order_id_with_other_payload_is_key_conflict_by_fingerprint(db: Db) -> None:
    big = {**BODY, "notes": "x" * 100_000}
    with db.engine.begin() as conn:
        assert _by_fingerprint(conn, db, BODY).outcome is CREATED
    with db.engine.begin() as conn:
        result = _by_fingerprint(conn, db, big)
    assert result.outcome is KEY_CONFLICT
    assert result.differing == ("request_fingerprint",)
    assert result.reason is not None
    assert len(result.reason) < 500
    assert db.count(db.orders) == 1


def test_r20_identical_redelivery_is_duplicate_never_key_conflict(db: Db) -> None:
    reordered = dict(reversed(list(BODY.items())))
    assert list(reordered) != list(BODY)
    with db.engine.begin() as conn:
        assert _by_fingerprint(conn, db, BODY).outcome is CREATED
    with db.engine.begin() as conn:
        assert _by_fingerprint(conn, db, reordered).outcome is DUPLICATE
    with db.engine.begin() as conn:  # numbers by value: 12.5 and Decimal("12.50") are one amount
        assert _by_fields(conn, db, amount=12.5).outcome is DUPLICATE


def test_r20_volatile_fields_left_out_of_the_fingerprint_do_not_conflict(db: Db) -> None:
    by_fields = oncely.Fingerprint.fields("order_id", "customer_id", "amount")
    later = {**BODY, "sent_at": "10:05"}
    outcomes = []
    for body in (BODY, later):
        with db.engine.begin() as conn:
            outcomes.append(
                create_once(
                    conn,
                    db.orders,
                    key={"order_id": "o-1"},
                    values=ORDER,
                    fingerprint_column="request_fingerprint",
                    payload=body,
                    fingerprinter=by_fields,
                ).outcome
            )
    assert outcomes == [CREATED, DUPLICATE]


def test_r20_conflict_never_poisons_the_callers_transaction(db: Db) -> None:
    with db.engine.begin() as conn:
        assert _by_fields(conn, db).outcome is CREATED
    with db.engine.begin() as conn:
        conn.execute(sa.insert(db.customers).values(customer_id="c-3"))
        assert _by_fields(conn, db).outcome is DUPLICATE
        assert _by_fields(conn, db, amount=1).outcome is KEY_CONFLICT
        conn.execute(sa.insert(db.outbox).values(order_id="o-1", event="after"))
    assert db.count(db.customers) == 3
    assert db.count(db.outbox) == 1


def test_r20_same_key_twice_in_one_transaction_is_a_duplicate(db: Db) -> None:
    with db.engine.begin() as conn:
        assert _by_fields(conn, db).outcome is CREATED
        assert _by_fields(conn, db).outcome is DUPLICATE
    assert db.count(db.orders) == 1


@pytest.mark.parametrize(
    ("order_id", "changes", "what"),
    [
        ("o-2", {"amount": None}, "NOT NULL"),
        ("o-2", {"customer_id": "nobody"}, "foreign key"),
        ("o-2", {"email": "a@example.com"}, "another unique constraint"),
    ],
)
def test_r20_other_integrity_errors_propagate(
    db: Db, order_id: str, changes: dict[str, object], what: str
) -> None:
    with db.engine.begin() as conn:
        _by_fields(conn, db, email="a@example.com")
    with pytest.raises(IntegrityError), db.engine.begin() as conn:
        _by_fields(conn, db, order_id, **changes)
    assert db.count(db.orders) == 1, what


def test_r20_orm_session_and_attribute_names(db: Db) -> None:
    class Base(DeclarativeBase):
        pass

    class Order(Base):
        __table__ = db.orders
        __mapper_args__ = {"properties": {"total": db.orders.c.amount}}  # noqa: RUF012

    with Session(db.engine) as session, session.begin():
        created = create_once(
            session,
            Order,
            key={"order_id": "o-1"},
            values={"customer_id": "c-1", "total": Decimal("3.00")},
            compare=("total",),
        )
    with Session(db.engine) as session, session.begin():
        again = create_once(
            session,
            Order,
            key={"order_id": "o-1"},
            values={"customer_id": "c-1", "total": Decimal("4.00")},
            compare=("total",),
        )
    assert created.outcome is CREATED
    assert "total" in created.row
    assert "amount" not in created.row
    assert again.outcome is KEY_CONFLICT
    assert again.differing == ("total",)


def test_r20_a_key_the_database_deems_equal_but_spelled_otherwise_is_a_conflict(db: Db) -> None:
    # MariaDB's default collation is case-insensitive: "O-1" collides with "o-1" on the
    # primary key. The key columns are compared too, so that is a loud conflict, not a
    # duplicate; case-sensitive databases simply create a second order.
    with db.engine.begin() as conn:
        _by_fields(conn, db, "o-1")
    with db.engine.begin() as conn:
        result = _by_fields(conn, db, "O-1")
    if db.backend == "mariadb":
        assert (result.outcome, result.differing) == (KEY_CONFLICT, ("order_id",))
        assert db.count(db.orders) == 1
    else:
        assert result.outcome is CREATED
        assert db.count(db.orders) == 2


# --- R22: the marker and other rows, all or nothing ------------------------------------


def _order_rows(db: Db, sku: object = "sku-1") -> list[tuple[sa.Table, dict[str, object]]]:
    return [
        (db.lines, {"order_id": "o-1", "line_no": 1, "sku": sku, "qty": 2}),
        (db.lines, {"order_id": "o-1", "line_no": 2, "sku": "sku-2", "qty": 1}),
        (db.outbox, {"order_id": "o-1", "event": "order created"}),
    ]


def _batch(conn: Connection | Session, db: Db, rows: object, **changes: object) -> EntityResult:
    return create_batch_once(
        conn,
        db.orders,
        key={"order_id": "o-1"},
        values={**ORDER, **changes},
        compare=("customer_id", "amount"),
        rows=rows,  # type: ignore[arg-type]
    )


def test_r22_batch_writes_the_marker_and_its_rows_once(db: Db) -> None:
    outcomes = []
    for amount in ("12.50", "12.50", "13.00"):
        with db.engine.begin() as conn:
            outcomes.append(_batch(conn, db, _order_rows(db), amount=Decimal(amount)).outcome)
    assert outcomes == [CREATED, DUPLICATE, KEY_CONFLICT]
    assert (db.count(db.orders), db.count(db.lines), db.count(db.outbox)) == (1, 2, 1)


def test_r22_batch_row_failure_writes_nothing_and_propagates(db: Db) -> None:
    with db.engine.begin() as conn:
        conn.execute(sa.insert(db.customers).values(customer_id="c-3"))
        with pytest.raises(IntegrityError):
            _batch(conn, db, _order_rows(db, sku=None))
        # The savepoint is gone, the caller's transaction and earlier work are not.
        conn.execute(sa.insert(db.outbox).values(order_id="o-9", event="after"))
    assert (db.count(db.orders), db.count(db.lines), db.count(db.outbox)) == (0, 0, 1)
    assert db.count(db.customers) == 3
    with db.engine.begin() as conn:  # the redelivery then creates it all
        assert _batch(conn, db, _order_rows(db)).outcome is CREATED
    assert (db.count(db.orders), db.count(db.lines), db.count(db.outbox)) == (1, 2, 2)


def test_r22_batch_rolls_back_with_the_callers_transaction(db: Db) -> None:
    # The batch is the first statement of the transaction: Python's sqlite3 would otherwise
    # run the SAVEPOINT outside any transaction and commit the batch on RELEASE.
    with db.engine.connect() as conn:
        assert _batch(conn, db, _order_rows(db)).outcome is CREATED
        conn.rollback()
    with Session(db.engine) as session:
        assert _batch(session, db, _order_rows(db)).outcome is CREATED
        session.rollback()
    assert (db.count(db.orders), db.count(db.lines), db.count(db.outbox)) == (0, 0, 0)


def test_r22_batch_rows_built_from_the_created_row(db: Db) -> None:
    def rows(order: object) -> list[tuple[sa.Table, dict[str, object]]]:
        assert isinstance(order, dict)
        return [(db.outbox, {"order_id": order["order_id"], "event": f"total {order['amount']}"})]

    with Session(db.engine) as session, session.begin():
        assert _batch(session, db, rows).outcome is CREATED
    with db.engine.connect() as conn:
        assert conn.scalar(sa.select(db.outbox.c.event)) == "total 12.50"


def test_r22_batch_rows_of_one_table_with_other_columns(db: Db) -> None:
    rows = [
        (db.outbox, {"order_id": "o-1", "event": "a"}),
        (db.outbox, {"order_id": "o-1", "event": "b", "id": 100}),
        (db.outbox, {"order_id": "o-1", "event": "c", "id": 101}),
    ]
    with db.engine.begin() as conn:
        assert _batch(conn, db, rows).outcome is CREATED
    with db.engine.connect() as conn:
        events = conn.execute(sa.select(db.outbox.c.event).order_by(db.outbox.c.event)).all()
    assert [e for (e,) in events] == ["a", "b", "c"]


# --- R21: concurrent creators ------------------------------------------------------------


def _waits_on_lock(db: Db) -> bool:
    """True when another transaction waits on a lock in a statement on this test's orders table
    (on MariaDB: a one-row INSERT into it has run for 200 ms, which only a lock wait explains)."""
    if db.backend == "sqlite":
        time.sleep(0.3)  # SQLite's busy wait is invisible from outside; give it time to start
        return True
    like = f"%{db.orders.name}%"
    if db.backend == "postgresql":
        query = sa.text(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
            "AND query LIKE :like AND pid <> pg_backend_pid()"
        )
    else:
        # Not information_schema.innodb_trx: InnoDB refreshes that view only when nobody read
        # it for 100 ms, so frequent polling (ours or another test's) keeps it stale.
        like = f"INSERT INTO {db.orders.name}%"
        query = sa.text(
            "SELECT count(*) FROM information_schema.processlist "
            "WHERE info LIKE :like AND time_ms > 200 AND id <> connection_id()"
        )
    with db.engine.connect() as conn:
        return bool(conn.scalar(query, {"like": like}))


def _until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 20
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.mark.parametrize(("amount", "expected"), [("12.50", DUPLICATE), ("77.00", KEY_CONFLICT)])
def test_r21_second_creator_waits_for_the_first_then_never_errs(
    db: Db, amount: str, expected: EntityOutcome
) -> None:
    first_committing = threading.Event()
    seen: dict[str, object] = {}

    def second() -> None:
        try:
            with db.engine.begin() as conn:
                # A read first: on MariaDB's REPEATABLE READ it fixes the snapshot before the
                # winner commits, so only a locking read can then see the winner's row.
                conn.execute(sa.select(db.customers)).all()
                seen["result"] = _by_fields(conn, db, amount=Decimal(amount))
                seen["after_first_commit"] = first_committing.is_set()
        except BaseException as exc:  # reported below
            seen["error"] = exc

    thread = threading.Thread(target=second)
    try:
        with db.engine.begin() as conn:
            assert _by_fields(conn, db).outcome is CREATED
            thread.start()
            _until(lambda: _waits_on_lock(db) or not thread.is_alive(), "the second to wait")
            first_committing.set()
    finally:  # on a failure too: the second finishes once the first has ended
        if thread.ident is not None:
            thread.join(30)
    assert "error" not in seen, seen.get("error")
    result = seen["result"]
    assert isinstance(result, EntityResult)
    assert result.outcome is expected
    assert seen["after_first_commit"] is True  # it waited on the unique index
    assert db.count(db.orders) == 1


def test_r21_racing_creators_make_exactly_one_row_per_key(db: Db) -> None:
    keys = [f"o-{i}" for i in range(5)]
    workers = 4
    barrier = threading.Barrier(workers)
    outcomes: dict[str, list[EntityOutcome]] = {key: [] for key in keys}
    errors: list[BaseException] = []
    lock = threading.Lock()

    def work(offset: int) -> None:
        try:
            barrier.wait(10)
            for key in keys[offset:] + keys[:offset]:
                with db.engine.begin() as conn:
                    outcome = _by_fields(conn, db, key).outcome
                with lock:
                    outcomes[key].append(outcome)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i % len(keys),)) for i in range(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    for key in keys:
        assert sorted(outcomes[key]) == sorted([CREATED] + [DUPLICATE] * (workers - 1)), key
    assert db.count(db.orders) == len(keys)


# --- async: the same flow on AsyncSession / AsyncConnection -----------------------------


@pytest.fixture(params=BACKENDS)
async def adb(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[tuple[Db, object]]:
    try:
        import greenlet  # noqa: F401
    except ImportError:
        reason = "SQLAlchemy's asyncio needs greenlet: install SQLAlchemy[asyncio]"
        if REQUIRED:
            pytest.fail(reason)
        pytest.skip(reason)
    from sqlalchemy.ext.asyncio import create_async_engine

    backend = str(request.param)
    url = _url(backend, tmp_path)
    engine = _engine(url)
    metadata = sa.MetaData()
    customers, orders, lines, outbox = _tables(metadata)
    metadata.create_all(engine)
    with engine.begin() as conn:
        conn.execute(sa.insert(customers), [{"customer_id": "c-1"}, {"customer_id": "c-2"}])
    aengine = create_async_engine(_url(backend, tmp_path, asynchronous=True))
    try:
        yield Db(backend, engine, url, customers, orders, lines, outbox), aengine
    finally:
        await aengine.dispose()
        metadata.drop_all(engine)
        engine.dispose()


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


# --- the pure part: outcomes, configuration, the flow --------------------------------


def test_r20_outcomes_map_to_oncely_outcomes_and_broker_actions() -> None:
    assert {o: (o.as_outcome, o.action) for o in EntityOutcome} == {
        CREATED: (oncely.Outcome.PROCESSED, oncely.Action.ACK),
        DUPLICATE: (oncely.Outcome.DUPLICATE, oncely.Action.ACK),
        KEY_CONFLICT: (oncely.Outcome.KEY_CONFLICT, oncely.Action.DEAD_LETTER),
    }
    conflict = EntityResult(KEY_CONFLICT, {"order_id": "o-1"}, {"order_id": "o-1"}, ("a",), "r")
    handled = conflict.handled("orders")
    assert (handled.outcome, handled.key, handled.value, handled.reason) == (
        oncely.Outcome.KEY_CONFLICT,
        "o-1",
        None,
        "r",
    )
    with pytest.raises(oncely.KeyConflict):
        handled.unwrap()
    composite = EntityResult(DUPLICATE, {"t": 1, "id": "x"}, {"t": 1, "id": "x"})
    assert composite.handled("c").key == '{"id":"x","t":1}'
    assert composite.handled("c").value == {"t": 1, "id": "x"}


def _plan(table: sa.Table, **overrides: object) -> _entity_flow.Plan:
    arguments: dict[str, object] = {
        "dialect": sqlite.dialect(),
        "key": {"order_id": "o-1"},
        "values": ORDER,
        "compare": ("amount",),
        "fingerprint_column": None,
        "payload": _entity_flow.MISSING,
        "fingerprinter": oncely.fingerprint,
    }
    arguments.update(overrides)
    return _entity_flow.make_plan(table, **arguments)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"key": {"customer_id": "c-1"}}, "not the primary key nor a unique"),
        ({"compare": ()}, "say how to tell a duplicate"),
        ({"compare": "amount"}, "not the string"),
        ({"compare": ("email",)}, "which values do not give"),
        ({"values": {**ORDER, "colour": "red"}}, "has no column 'colour'"),
        ({"fingerprint_column": "request_fingerprint"}, "needs the payload"),
        ({"payload": BODY}, "only used with fingerprint_column"),
        ({"dialect": oracle.dialect()}, "not oracle"),
        ({"values": {"order_id": "o-2"}}, "other than the key"),
    ],
)
def test_r6_a_call_that_cannot_work_is_refused(overrides: dict[str, object], message: str) -> None:
    _customers, orders, _lines, _outbox = _tables(sa.MetaData())
    with pytest.raises(oncely.ConfigurationError, match=message):
        _plan(orders, **overrides)
    with pytest.raises(oncely.InvalidKey):
        _plan(orders, key={"order_id": None})


def test_r20_a_key_that_vanishes_after_its_conflict_is_retried_then_reported() -> None:
    _customers, orders, _lines, _outbox = _tables(sa.MetaData())
    steps = _entity_flow.flow(_plan(orders))
    step = next(steps)
    for attempt in range(3):
        assert isinstance(step.statement, sa.Insert)
        step = steps.send(_entity_flow.Answer([]))  # the insert did nothing: a conflict
        assert isinstance(step.statement, sa.Select)
        if attempt < 2:
            step = steps.send(_entity_flow.Answer([]))  # ...and the read found nothing
    with pytest.raises(oncely.StoreUnavailable, match="gone when read"):
        steps.send(_entity_flow.Answer([]))


def test_r20_mysql_duplicate_on_another_unique_key_is_re_raised() -> None:
    _customers, orders, _lines, _outbox = _tables(sa.MetaData())
    steps = _entity_flow.flow(_plan(orders, dialect=mysql.dialect()))
    step = next(steps)
    assert step.duplicate_ok
    duplicate = IntegrityError("INSERT ...", {}, Exception(1062, "Duplicate entry for 'email'"))
    assert _entity_flow.is_duplicate_key(duplicate)
    assert not _entity_flow.is_duplicate_key(IntegrityError("INSERT", {}, Exception(1048, "null")))
    step = steps.send(duplicate)
    assert isinstance(step.statement, sa.Select)
    with pytest.raises(IntegrityError) as raised:
        steps.send(_entity_flow.Answer([]))  # no row has the key: the duplicate was elsewhere
    assert raised.value is duplicate


def test_r20_numbers_compare_by_value_and_nothing_else_is_coerced() -> None:
    same = _entity_flow.same_value
    assert same(Decimal("5.00"), 5)
    assert same(0.1, Decimal("0.10"))
    assert not same(Decimal("5.01"), 5)
    assert not same("5", 5)
    assert not same(None, 0)


# --- the example ---------------------------------------------------------------------------


def test_r20_example_orders_entity_runs(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "orders_entity.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "delivery 1 of o-1: created -> ack",
        "delivery 2 of o-1: duplicate -> ack",
        "o-1 reused with another amount: key_conflict -> dead_letter (differing: amount)",
        "orders: 1, lines: 2, outbox: 1",
    ]
