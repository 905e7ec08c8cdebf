"""A session's calls when the database ends its transaction or its connections: a server
restart (the store remembers which database it is in, and PostgreSQL's identity includes
its start time: before, every ``handle_in_session`` after a restart was refused as "another
database" until the process restarted; the store's side is now read again on a mismatch),
and a deadlock that ends the transaction under the savepoint (R7)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

import oncely
from oncely.integrations.sqlalchemy import handle_in_session
from tests.integrations.sqlalchemy_helpers import Env, booker
from tests.services import disruptive
from tests.stores.postgres.test_crash import _pg_ctl, _wait_until_ready


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("env", ["postgresql"], indirect=True)
@disruptive("restarts the machine's PostgreSQL cluster")
def test_r7_joined_calls_work_again_once_the_server_is_back(env: Env) -> None:
    inbox = env.inbox(migrated=True)
    engine = env.new_engine(pool_pre_ping=True)
    calls: list[str] = []
    book = booker(env, calls)

    def deliver(order: str) -> oncely.Handled[Any]:
        with Session(engine) as session, session.begin():
            return handle_in_session(inbox, session, order, {"id": order, "amount": 5}, book)

    assert deliver("o-1").outcome is oncely.Outcome.PROCESSED
    _pg_ctl("stop")
    _pg_ctl("start")
    _wait_until_ready()
    env.engine.dispose()  # the fixture's own connections (for its checks) died with the server
    refused: list[BaseException] = []
    deadline = time.monotonic() + 60
    while True:  # the store's pool finds its connections dead: a retry or two
        try:
            done = deliver("o-2")
            break
        except oncely.StoreUnavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
        except (oncely.ConfigurationError, sa.exc.SQLAlchemyError) as exc:
            refused.append(exc)
            if time.monotonic() > deadline or isinstance(exc, oncely.ConfigurationError):
                raise
            time.sleep(0.5)
    assert done.outcome is oncely.Outcome.PROCESSED
    assert deliver("o-1").outcome is oncely.Outcome.DUPLICATE
    assert calls == ["o-1", "o-2"]
    assert env.rows() == {"o-1": 5, "o-2": 5}


@pytest.mark.parametrize("env", ["mariadb"], indirect=True)
def test_r7_a_deadlock_inside_the_savepoint_is_the_stores_error(env: Env) -> None:
    """Four copies of one message at once; the first writes, waits, then fails. InnoDB ends
    the waiting copies' transactions with a deadlock, savepoint and all: before, leaving the
    savepoint raised SQLAlchemy's ``SAVEPOINT ... does not exist`` on top of oncely's
    ``StoreUnavailable`` (which a caller catching ``StoreError`` then missed)."""
    inbox = env.inbox(migrated=True)
    engine = env.new_engine(pool_size=8)
    first = threading.Lock()
    failing = [True]

    def book(session: Session, order: dict[str, Any]) -> str:
        session.add(env.booking(order_id=order["id"], amount=1))
        session.flush()
        time.sleep(0.2)
        with first:
            fail, failing[0] = failing[0], False
        if fail:
            raise RuntimeError("the first copy fails after writing")
        return "booked"

    got: list[object] = []

    def deliver() -> None:
        try:
            with Session(engine) as session, session.begin():
                got.append(handle_in_session(inbox, session, "o-9", {"id": "o-9"}, book).outcome)
        except Exception as exc:
            got.append(exc)

    for _ in range(3):  # the deadlock is likely, not certain, in one round
        got.clear()
        failing[0] = True
        with env.engine.begin() as conn:
            conn.execute(sa.delete(env.booking.__table__))
        inbox.forget("o-9")
        threads = [threading.Thread(target=deliver) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        strays = [
            g for g in got if isinstance(g, Exception) and not isinstance(g, oncely.StoreError)
        ]
        assert not strays, strays
    assert len(got) == 4


@pytest.mark.parametrize("ends", ["rollback", "commit"])
def test_r7_a_handler_that_ends_the_sessions_transaction_is_refused(env: Env, ends: str) -> None:
    """Before, ``session.rollback()`` in the handler gave ``processed`` with neither the row
    nor the marker (the message acknowledged, lost), and ``session.commit()`` a marker without
    its result."""
    inbox = env.inbox(migrated=True)
    engine = env.new_engine()

    def book(session: Session, order: dict[str, Any]) -> str:
        session.add(env.booking(order_id=order["id"], amount=1))
        getattr(session, ends)()
        return "booked"

    with (
        pytest.raises(oncely.TransactionEnded, match="ended the transaction"),
        Session(engine) as session,
        session.begin(),
    ):
        handle_in_session(inbox, session, "o-1", {"id": "o-1"}, book)
    if ends == "rollback":
        assert env.rows() == {} and env.marker("o-1") is None
        good = booker(env, [])
        with Session(engine) as session, session.begin():
            done = handle_in_session(inbox, session, "o-1", {"id": "o-1", "amount": 1}, good)
        assert done.outcome is oncely.Outcome.PROCESSED and env.rows() == {"o-1": 1}


def test_r7_a_handler_that_ends_oncelys_transaction_is_refused(env: Env) -> None:
    inbox = env.inbox(migrated=True)

    def book(tx: Any, order: dict[str, Any]) -> str:
        tx.rollback()
        return "booked"

    if env.backend == "postgresql":  # psycopg itself forbids it inside its transaction block
        failed = inbox.handle_in_transaction("o-2", {"id": "o-2"}, book)
        assert failed.outcome is oncely.Outcome.FAILED and "forbidden" in str(failed.error)
    else:
        with pytest.raises(oncely.TransactionEnded):
            inbox.handle_in_transaction("o-2", {"id": "o-2"}, book)
    assert env.marker("o-2") is None
    again = inbox.handle_in_transaction("o-2", {"id": "o-2"}, lambda tx, order: "booked")
    assert again.outcome is oncely.Outcome.PROCESSED
