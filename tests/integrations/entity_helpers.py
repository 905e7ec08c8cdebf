"""What the entity-as-marker tests (``test_entity_*.py``) share: the outcomes by short name,
database URLs and engines, ``Db`` (one backend and its tables), the tables themselves, the order
every test creates and the calls that create it, the rows a batch writes with it, and telling
when another transaction waits on a lock. The ``db`` and ``adb`` fixtures are in ``conftest.py``.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine, make_url
from sqlalchemy.orm import Session

from oncely.integrations.entity import EntityOutcome, EntityResult, create_once
from tests.services import MYSQL_URL, POSTGRES_DSN, require

CREATED, DUPLICATE, KEY_CONFLICT = (
    EntityOutcome.CREATED,
    EntityOutcome.DUPLICATE,
    EntityOutcome.KEY_CONFLICT,
)


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


def _order_rows(db: Db, sku: object = "sku-1") -> list[tuple[sa.Table, dict[str, object]]]:
    return [
        (db.lines, {"order_id": "o-1", "line_no": 1, "sku": sku, "qty": 2}),
        (db.lines, {"order_id": "o-1", "line_no": 2, "sku": "sku-2", "qty": 1}),
        (db.outbox, {"order_id": "o-1", "event": "order created"}),
    ]


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
