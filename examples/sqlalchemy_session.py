"""The inbox inside a SQLAlchemy session (R7): python examples/sqlalchemy_session.py [DIR]

A booking consumer whose handler writes through the ORM. The dedup marker is written in the
same session transaction as the booking, so they commit together or not at all: a copy of a
message is a duplicate, a failing handler leaves nothing behind (and the session goes on), a
rollback of the caller's transaction takes the marker and the booking with it. The same code
runs on PostgreSQL (PostgresStore + postgresql+psycopg://) and MariaDB (MySQLStore +
mysql+pymysql://).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

import oncely
from oncely.integrations.sqlalchemy import handle_in_session


class Base(DeclarativeBase):
    pass


class Booking(Base):
    __tablename__ = "bookings"
    order_id: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    amount: Mapped[int]


def book(session: Session, order: dict[str, int | str]) -> dict[str, int | str]:
    """The handler: ORM writes in the caller's session; the result is kept for duplicates."""
    session.add(Booking(order_id=str(order["id"]), amount=int(order["amount"])))
    return {"booked": order["amount"]}


def ledger_offline(session: Session, order: dict[str, int | str]) -> dict[str, int | str]:
    session.add(Booking(order_id=str(order["id"]), amount=int(order["amount"])))
    session.flush()  # written, then rolled back with the savepoint
    raise ConnectionError("ledger offline")


def main(workdir: Path) -> None:
    path = workdir / "bookings.db"
    engine = sa.create_engine(f"sqlite:///{path}")  # one database file for both
    Base.metadata.create_all(engine)
    store = oncely.SQLiteStore(path)
    inbox = oncely.Inbox(store, consumer="bookings")
    order: dict[str, int | str] = {"id": "o-1", "amount": 42}

    for delivery in (1, 2):  # an at-least-once broker delivers it twice
        with Session(engine) as session, session.begin():
            handled = handle_in_session(inbox, session, "o-1", order, book)
        print(f"delivery {delivery}: {handled.outcome} {handled.value}")

    with Session(engine) as session, session.begin():
        failed = handle_in_session(
            inbox, session, "o-2", {"id": "o-2", "amount": 5}, ledger_offline
        )
        count = session.scalar(sa.select(sa.func.count()).select_from(Booking))  # still usable
    state = "session still usable" if count == 1 else f"the session sees {count} bookings"
    print(f"ledger offline: {failed.outcome} -> {failed.action}, {state}")

    with Session(engine) as session, session.begin():
        changed = handle_in_session(inbox, session, "o-1", {**order, "amount": 99}, book)
    print(f"changed amount: {changed.outcome} -> {changed.action}")

    with Session(engine) as session:
        session.begin()
        tentative = handle_in_session(inbox, session, "o-3", {"id": "o-3", "amount": 7}, book)
        session.rollback()  # the caller's transaction fails later: nothing of o-3 remains
    gone = inbox.get("o-3") is None
    with Session(engine) as session:
        gone = gone and session.get(Booking, "o-3") is None
        rows = session.execute(sa.select(Booking.order_id, Booking.amount)).all()
    left = "neither marker nor booking" if gone else "something LEFT BEHIND"
    print(f"rolled back: {tentative.outcome}, then {left}")
    print(f"bookings: {[tuple(row) for row in rows]}")
    store.close()
    engine.dispose()


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(Path(sys.argv[1]))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            main(Path(tmp))
