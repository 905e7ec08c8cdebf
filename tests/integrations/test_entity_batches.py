"""The business entity as the dedup marker with the rows that go with it (R22), on real SQLite,
PostgreSQL, MariaDB: the marker and its other rows are written all or nothing.

Each test makes tables of its own with unique names and drops them afterwards. PostgreSQL and
MariaDB tests skip without the server (fail under ONCELY_REQUIRE_SERVICES=1). The ``db`` and
``adb`` fixtures are in ``conftest.py``, the shared helpers in ``entity_helpers.py``.
"""

from __future__ import annotations

from decimal import Decimal

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from oncely.integrations.entity import EntityResult, create_batch_once
from tests.integrations.entity_helpers import (
    CREATED,
    DUPLICATE,
    KEY_CONFLICT,
    ORDER,
    Db,
    _order_rows,
)


# --- R22: the marker and other rows, all or nothing ------------------------------------
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
