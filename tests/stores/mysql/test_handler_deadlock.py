"""A transactional handler that catches the deadlock InnoDB picked it for (R7).

InnoDB rolls a deadlock victim's whole transaction back, the key's claim with it, and the
connection goes on. A handler that catches the error and returns, or retries its statement as
the error's text invites ("try restarting transaction"), used to leave oncely with either no
marker and the outcome ``processed`` (the message acked while its effects were rolled back:
lost), or the later writes committed on their own (autocommit) without the marker, which the
redelivery then ran again. Now the block runs with autocommit off, so those later writes wait
in a new transaction, and the claim is looked for before the commit: ``TransactionEnded``, the
later writes rolled back, no marker, and the next delivery runs the handler once.
"""

from __future__ import annotations

import threading
from typing import Any

import pymysql
import pytest

import oncely
from oncely.errors import TransactionEnded
from oncely.stores.mysql.sync_store import MySQLStore
from tests.backends.mysql import admin, sql
from tests.stores.mysql.helpers import _deadlocks, _in_thread
from tests.stores.mysql.test_locking import _wait_for_lock_wait


def _rows(table: str) -> dict[int, int]:
    return {int(i): int(v) for i, v in sql(f"SELECT id, v FROM `{table}_scratch` ORDER BY id")}


@pytest.mark.parametrize("after", ["returns", "retries"])
@pytest.mark.parametrize("result", [None, {"charged": 10}])
def test_r7_a_deadlock_the_handler_caught_commits_nothing_and_runs_again(
    store: MySQLStore, table: str, after: str, result: object
) -> None:
    sql(f"CREATE TABLE `{table}_scratch` (id INT PRIMARY KEY, v INT) ENGINE=InnoDB")
    sql(f"INSERT INTO `{table}_scratch` VALUES (1, 0), (2, 0), (3, 0)")
    sql(f"CREATE TABLE `{table}_ledger` (k VARCHAR(64) NOT NULL) ENGINE=InnoDB")
    inbox = oncely.Inbox(store, consumer="billing")
    holds_1 = threading.Event()
    caught: list[int] = []

    def other() -> None:
        """The heavier transaction (20 rows written first), so InnoDB picks the handler's."""
        conn = admin()
        try:
            conn.begin()
            with conn.cursor() as cursor:
                for i in range(20):
                    cursor.execute(f"INSERT INTO `{table}_ledger` (k) VALUES (%s)", (f"w{i}",))
                cursor.execute(f"UPDATE `{table}_scratch` SET v = v + 1 WHERE id = 2")
                holds_1.wait(20)
                cursor.execute(f"UPDATE `{table}_scratch` SET v = v + 1 WHERE id = 1")
            conn.commit()
        finally:
            conn.close()

    def handler(conn: Any, payload: object) -> object:
        with conn.cursor() as cursor:
            cursor.execute(f"UPDATE `{table}_scratch` SET v = v + 10 WHERE id = 1")
            holds_1.set()
            _wait_for_lock_wait(f"{table}_scratch")  # the other waits for row 1
            try:
                cursor.execute(f"UPDATE `{table}_scratch` SET v = v + 10 WHERE id = 2")
            except pymysql.err.OperationalError as exc:
                caught.append(exc.args[0])
                if after == "retries":
                    cursor.execute(f"UPDATE `{table}_scratch` SET v = v + 100 WHERE id = 3")
        return result

    deadlocks = _deadlocks()
    thread, out = _in_thread(other)
    try:
        with pytest.raises(TransactionEnded, match="ended inside the handler"):
            inbox.handle_in_transaction("order-1", {"amount": 10}, handler)
    finally:
        holds_1.set()
        thread.join(30)
    assert "error" not in out, out
    assert caught == [1213] and _deadlocks() > deadlocks
    # Only the other transaction's writes: nothing of the handler's, the retry's neither.
    assert _rows(table) == {1: 1, 2: 1, 3: 0}
    assert store.get("billing", "order-1") is None

    again = inbox.handle_in_transaction("order-1", {"amount": 10}, _bump(table))
    assert again.outcome is oncely.Outcome.PROCESSED
    assert _rows(table) == {1: 1, 2: 1, 3: 1}
    record = store.get("billing", "order-1")
    assert record is not None and record.status is oncely.Status.COMPLETED


def _bump(table: str) -> Any:
    def handler(conn: Any, payload: object) -> None:
        with conn.cursor() as cursor:
            cursor.execute(f"UPDATE `{table}_scratch` SET v = v + 1 WHERE id = 3")

    return handler


def test_r7_the_stores_transaction_leaves_its_connection_in_autocommit(
    store: MySQLStore, table: str
) -> None:
    """The block turns autocommit off for its statements and on again at its end, committed
    or rolled back, so the pooled connection's two-phase work autocommits as before."""
    inbox = oncely.Inbox(store, consumer="billing")
    assert inbox.handle_in_transaction("a", {}, lambda conn, p: None).outcome.name == "PROCESSED"

    def fails(conn: Any, payload: object) -> None:
        raise RuntimeError("boom")

    assert inbox.handle_in_transaction("b", {}, fails).outcome is oncely.Outcome.FAILED
    with store.transaction() as conn:
        pass
    assert conn.get_autocommit()
    claim = inbox.handle("c", {}, lambda payload: 1)
    assert claim.outcome is oncely.Outcome.PROCESSED
    assert store.get("billing", "a") is not None and store.get("billing", "c") is not None


@pytest.mark.parametrize("how", ["statement", "method"])
def test_r7_a_handler_that_rolls_back_and_writes_on_commits_nothing(
    store: MySQLStore, table: str, how: str
) -> None:
    """A handler must not end its transaction; one that rolls it back (by a ROLLBACK
    statement or the driver's rollback()) and writes on took the claim with it: the writes
    after are rolled back too, and TransactionEnded says so."""
    sql(f"CREATE TABLE `{table}_scratch` (id INT PRIMARY KEY, v INT) ENGINE=InnoDB")
    sql(f"INSERT INTO `{table}_scratch` VALUES (1, 0)")
    inbox = oncely.Inbox(store, consumer="billing")

    def handler(conn: Any, payload: object) -> None:
        with conn.cursor() as cursor:
            if how == "statement":
                cursor.execute("ROLLBACK")
            else:
                conn.rollback()
            cursor.execute(f"UPDATE `{table}_scratch` SET v = v + 1 WHERE id = 1")

    with pytest.raises(TransactionEnded):
        inbox.handle_in_transaction("order-1", {}, handler)
    assert _rows(table) == {1: 0}
    assert store.get("billing", "order-1") is None


@pytest.mark.parametrize("autocommit", [True, False])
def test_r7_in_a_callers_transaction_the_refusal_says_what_autocommit_let_through(
    store: MySQLStore, table: str, autocommit: bool
) -> None:
    """In a transaction of the caller's (``tx=``) oncely cannot run the connection with
    autocommit off. On one with autocommit on, after ``BEGIN``, a write made once the
    transaction ended (a deadlock the handler caught, here a ROLLBACK) commits on its own
    before oncely sees anything: TransactionEnded says so, and that autocommit off prevents
    it. With autocommit off the write waits in a new transaction the caller rolls back."""
    sql(f"CREATE TABLE `{table}_scratch` (id INT PRIMARY KEY, v INT) ENGINE=InnoDB")
    sql(f"INSERT INTO `{table}_scratch` VALUES (1, 0)")
    inbox = oncely.Inbox(store, consumer="billing")

    def handler(conn: Any, payload: object) -> None:
        with conn.cursor() as cursor:
            cursor.execute("ROLLBACK")
            cursor.execute(f"UPDATE `{table}_scratch` SET v = v + 1 WHERE id = 1")

    conn = admin()
    try:
        conn.autocommit(autocommit)
        conn.begin()
        with pytest.raises(TransactionEnded) as raised:
            inbox.handle_in_transaction("order-1", {}, handler, tx=conn)
        conn.rollback()
    finally:
        conn.close()
    assert ("autocommit on" in str(raised.value)) is autocommit
    assert _rows(table) == {1: 1 if autocommit else 0}
    assert store.get("billing", "order-1") is None
