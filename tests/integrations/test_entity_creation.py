"""The business entity as the dedup marker (R6, R20), on real SQLite, PostgreSQL, MariaDB: copies
of an order create one order, compared by fields or by fingerprint; a reused key with other
content is a key conflict naming the fields; other integrity errors propagate; and the example.

Each test makes tables of its own with unique names and drops them afterwards. PostgreSQL and
MariaDB tests skip without the server (fail under ONCELY_REQUIRE_SERVICES=1). The ``db`` and
``adb`` fixtures are in ``conftest.py``, the shared helpers in ``entity_helpers.py``.
"""

from __future__ import annotations

import datetime
import logging
import subprocess
import sys
from decimal import Decimal
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import DeclarativeBase, Session

import oncely
from oncely.integrations.entity import EntityResult, create_once
from tests.integrations.entity_helpers import (
    BODY,
    CREATED,
    DUPLICATE,
    KEY_CONFLICT,
    ORDER,
    Db,
    _by_fields,
    _by_fingerprint,
)

ROOT = Path(__file__).resolve().parents[2]


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


@pytest.mark.parametrize(
    ("amount", "why"),
    [("12.50", "is a str"), (Decimal("12.505"), "more decimal places"), (12.505, "more decimal")],
)
def test_r20_a_compared_value_the_database_would_change_is_refused(
    db: Db, amount: object, why: str
) -> None:
    # Before, "12.50" (a JSON payload's amount) for a Numeric(10, 2) column was written, read
    # back as Decimal("12.50"), and every copy of the message was a key_conflict.
    with db.engine.begin() as conn, pytest.raises(oncely.ConfigurationError, match=why):
        _by_fields(conn, db, amount=amount)
    assert db.count(db.orders) == 0
    with db.engine.begin() as conn:
        assert _by_fields(conn, db, amount=Decimal("12.50")).outcome == CREATED
    with db.engine.begin() as conn:
        assert _by_fields(conn, db, amount=12.5).outcome == DUPLICATE


def test_r20_r2_a_number_for_a_text_key_is_refused(db: Db) -> None:
    """An order id that arrives as a number (a JSON body's ``"order_id": 17``) for the text
    key column is refused before anything is written: the column gives back ``"17"``."""
    # Before, the first copy was created; then on PostgreSQL every copy failed on the read by
    # key (varchar = integer) with the transaction aborted, elsewhere each was a false
    # key_conflict, dead-lettered.
    for _ in range(2):
        with db.engine.begin() as conn, pytest.raises(oncely.ConfigurationError, match="str"):
            _by_fields(conn, db, order_id=17)  # type: ignore[arg-type]
    assert db.count(db.orders) == 0
    with db.engine.begin() as conn:
        assert _by_fields(conn, db, order_id="17").outcome is CREATED


def test_r20_r21_copies_keyed_in_a_char_column_are_duplicates(db: Db) -> None:
    """A CHAR(n) key and compared field: PostgreSQL gives the text back padded to n and
    MariaDB stripped, and both compare CHAR text without trailing spaces, so every copy is
    a duplicate (SQLite keeps the text as written: there ``"o-1 "`` is another key)."""
    # Before, on PostgreSQL every copy of "o-1" was a false key_conflict (stored "o-1" padded
    # to 10), dead-lettered and logged at ERROR; on MariaDB every copy of a padded one.
    table = sa.Table(
        db.orders.name + "_char",
        db.orders.metadata,
        sa.Column("code", sa.CHAR(10), primary_key=True),
        sa.Column("region", sa.CHAR(4), nullable=False),
        sa.Column("other", sa.CHAR(4), nullable=False),
    )
    table.create(db.engine)
    outcomes = []
    for code, region in (("o-1", "eu"), ("o-1", "eu"), ("o-1 ", "eu  ")):
        with db.engine.begin() as conn:
            result = create_once(
                conn,
                table,
                key={"code": code},
                values={"region": region, "other": "x"},
                compare=("region",),
            )
        outcomes.append(result.outcome)
    if db.backend == "sqlite":
        assert outcomes == [CREATED, DUPLICATE, CREATED]
    else:
        assert outcomes == [CREATED, DUPLICATE, DUPLICATE]
    with db.engine.begin() as conn:
        result = create_once(
            conn,
            table,
            key={"code": "o-1"},
            values={"region": "us", "other": "x"},
            compare=("region",),
        )
    assert result.outcome is KEY_CONFLICT  # other text is still told apart
    assert result.differing == ("region",)


def test_r6_r20_a_partial_or_expression_unique_index_is_no_key(db: Db) -> None:
    """A unique index with a WHERE (partial) or on an expression (``lower(email)``) is not
    the key's unique index: ON CONFLICT cannot name it by columns, and a read by key would not
    see the rows it holds. It is refused as any key that is not unique is, with the reason;
    MariaDB, which has no partial index, creates a whole one and the key works there."""
    # Before, each was accepted, and every message then failed inside the database ("no
    # unique or exclusion constraint matching the ON CONFLICT specification" on PostgreSQL,
    # its transaction aborted; "ON CONFLICT clause does not match" on SQLite).
    table = sa.Table(
        db.orders.name + "_ix",
        db.orders.metadata,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("email", sa.String(50), nullable=False),
        sa.Column("tenant", sa.String(20), nullable=False),
        sa.Column("live", sa.Boolean, nullable=False),
    )
    live = table.c.live == sa.true()
    sa.Index(None, table.c.email, unique=True, postgresql_where=live, sqlite_where=live)
    if db.backend != "mariadb":  # no functional indexes there
        sa.Index(None, table.c.tenant, sa.func.lower(table.c.email), unique=True)
    table.create(db.engine)

    def create(key: dict[str, object]) -> object:
        with db.engine.begin() as conn:
            return create_once(
                conn,
                table,
                key=key,
                values={"id": 1, "email": "a@example.com", "tenant": "t", "live": True},
                compare=("live",),
            ).outcome

    if db.backend == "mariadb":
        assert [create({"email": "a@example.com"}) for _ in range(2)] == [CREATED, DUPLICATE]
        return
    for key in ({"email": "a@example.com"}, {"tenant": "t", "email": "a@example.com"}):
        with pytest.raises(oncely.ConfigurationError, match="partial or expression index"):
            create(key)
    assert db.count(table) == 0
    assert [create({"id": 1}) for _ in range(2)] == [CREATED, DUPLICATE]


_UTC = datetime.UTC


@pytest.mark.parametrize(
    ("timezone", "at", "why"),
    [
        (False, datetime.datetime(2026, 1, 1, 10, 0, 0, 250000), "fractional seconds"),
        (False, datetime.datetime(2026, 1, 1, 10, tzinfo=_UTC), "aware"),
        (True, datetime.datetime(2026, 1, 1, 10, 0, 0, 250000, tzinfo=_UTC), None),
        (True, datetime.datetime(2026, 1, 1, 10), None),
    ],
)
def test_r20_r21_a_datetime_key_the_database_would_change_is_refused(
    db: Db, timezone: bool, at: datetime.datetime, why: str | None
) -> None:
    """A datetime in the key whose time zone or fraction of a second the column drops (every
    zone but on PostgreSQL's ``timezone=True``; every fraction on MariaDB's default DATETIME)
    is refused before anything is written, as a Numeric with too many places is."""
    # Before, the first copy was created; on MariaDB each later copy re-read the row by the
    # value given, found none, and raised the duplicate-key IntegrityError of the first (a
    # message that fails on every redelivery); elsewhere each was a false key_conflict.
    table = sa.Table(
        db.orders.name + "_at",
        db.orders.metadata,
        sa.Column("account", sa.String(20), primary_key=True),
        sa.Column("at", sa.DateTime(timezone=timezone), primary_key=True),
        sa.Column("amount", sa.Numeric(10, 2), nullable=False),
    )
    table.create(db.engine)
    kept = (db.backend == "postgresql" and timezone) == (at.tzinfo is not None) and (
        db.backend != "mariadb" or not at.microsecond
    )
    why = why or ("aware" if at.tzinfo is not None else "naive")
    outcomes = []
    for _ in range(2):
        with db.engine.begin() as conn:
            if not kept:
                with pytest.raises(oncely.ConfigurationError, match=why):
                    create_once(
                        conn,
                        table,
                        key={"account": "a-1", "at": at},
                        values={"amount": Decimal("1.00")},
                        compare=("amount",),
                    )
                continue
            result = create_once(
                conn,
                table,
                key={"account": "a-1", "at": at},
                values={"amount": Decimal("1.00")},
                compare=("amount",),
            )
            outcomes.append(result.outcome)
    assert outcomes == ([CREATED, DUPLICATE] if kept else [])
    assert db.count(table) == (1 if kept else 0)


def test_r20_r6_copies_of_an_order_create_one_order_compared_by_fingerprint(db: Db) -> None:
    results = []
    for _ in range(3):
        with db.engine.begin() as conn:
            results.append(_by_fingerprint(conn, db, BODY))
    assert [r.outcome for r in results] == [CREATED, DUPLICATE, DUPLICATE]
    assert results[0].row["request_fingerprint"] == oncely.fingerprint(BODY)
    assert results[1].row == results[0].row
    assert db.count(db.orders) == 1


def test_r20_reused_order_id_with_other_content_is_key_conflict_naming_the_fields(
    db: Db, caplog: pytest.LogCaptureFixture
) -> None:
    with db.engine.begin() as conn:
        assert _by_fields(conn, db).outcome is CREATED
    with db.engine.begin() as conn, caplog.at_level(logging.ERROR, logger="oncely"):
        result = _by_fields(conn, db, amount=Decimal("99.99"), customer_id="c-2")
    assert result.outcome is KEY_CONFLICT
    # Logged at ERROR as the inbox logs it (R20 step 6: alert), whatever the caller does.
    (logged,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert "key_conflict" in logged and "customer_id, amount" in logged
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


def test_r20_orm_polymorphic_classes_get_their_discriminator(db: Db) -> None:
    """A class of a polymorphic hierarchy in one table gets its identity in the
    discriminator column, as a flush gives it, and a copy of the key as another class is a
    key conflict; a class whose rows span tables (joined inheritance) is refused."""
    # Before, the row was inserted with the discriminator NULL: the ORM then could not load
    # it ("the polymorphic discriminator column ... is NULL"), and a joined subclass wrote
    # its own table alone.

    class Base(DeclarativeBase):
        pass

    class Order(Base):
        __table__ = db.orders
        __mapper_args__ = {  # noqa: RUF012
            "polymorphic_on": db.orders.c.note,
            "polymorphic_identity": "plain",
        }

    class RushOrder(Order):
        __mapper_args__ = {"polymorphic_identity": "rush"}  # noqa: RUF012

    class Gift(Order):
        __table__ = db.lines
        __mapper_args__ = {"polymorphic_identity": "gift"}  # noqa: RUF012

    def create(entity: type[Order]) -> EntityResult:
        with Session(db.engine) as session, session.begin():
            return create_once(
                session, entity, key={"order_id": "o-1"}, values=ORDER, compare=("amount",)
            )

    results = [create(RushOrder), create(RushOrder), create(Order)]
    assert [r.outcome for r in results] == [CREATED, DUPLICATE, KEY_CONFLICT]
    assert results[2].differing == ("note",)
    with Session(db.engine) as session:
        loaded = session.get(Order, "o-1")
    assert type(loaded) is RushOrder
    with pytest.raises(oncely.ConfigurationError, match="joined-table inheritance"):
        create(Gift)


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


@pytest.mark.parametrize(
    ("column", "single"),
    [
        (sa.Float(), {"mariadb"}),
        (sa.REAL(), {"postgresql"}),
        (sa.Float(precision=24), {"mariadb", "postgresql"}),
        (sa.Float(precision=53), set()),
        (sa.Double(), set()),
    ],
    ids=["Float", "REAL", "Float(24)", "Float(53)", "Double"],
)
def test_r20_r21_a_float_its_column_keeps_in_single_precision_is_refused(
    db: Db, column: sa.types.TypeEngine[float], single: set[str]
) -> None:
    """A compared float the column keeps in 4 bytes comes back as another float (0.1 as
    0.10000000149...): before, every copy was a false key_conflict, and a float key raised
    the first insert's IntegrityError on every copy. Now it is refused before anything is
    written; one that 4 bytes hold exactly (0.5), and every float in double precision, is
    compared as before."""
    table = sa.Table(
        db.orders.name + "_f",
        db.orders.metadata,
        sa.Column("order_id", sa.String(20), primary_key=True),
        sa.Column("weight", column, nullable=False),
    )
    table.create(db.engine)
    refused = db.backend in single
    for weight in (0.1, 0.5):
        outcomes = []
        for _ in range(2):
            with db.engine.begin() as conn:
                if refused and weight == 0.1:
                    with pytest.raises(oncely.ConfigurationError, match="single precision"):
                        create_once(
                            conn,
                            table,
                            key={"order_id": f"o-{weight}"},
                            values={"weight": weight},
                            compare=("weight",),
                        )
                    continue
                result = create_once(
                    conn,
                    table,
                    key={"order_id": f"o-{weight}"},
                    values={"weight": weight},
                    compare=("weight",),
                )
                outcomes.append(result.outcome)
        assert outcomes == ([] if refused and weight == 0.1 else [CREATED, DUPLICATE])
