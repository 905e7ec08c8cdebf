"""InnoDB's locking (R8, R9): a claim waits for a first claimer that has not committed
and sees how it ends; deadlocks are retried or reported, and translated.
"""

from __future__ import annotations

import time
from typing import Any

import pymysql
import pytest

import oncely
from oncely import Status
from oncely._core.records import ClaimRequest
from oncely.errors import (
    StoreError,
    StoreUnavailable,
    TransactionRequired,
)
from oncely.stores import ClaimStatus
from oncely.stores.mysql.errors import translate
from oncely.stores.mysql.sync_store import MySQLStore
from tests.backends.mysql import admin, sql
from tests.stores.mysql.helpers import KEEP_MS, LEASE_MS, _claim, _claim_in, _deadlocks, _in_thread


def _wait_for_lock_wait(table: str) -> None:
    """Return once a transaction waits for a row lock in a statement on ``table``
    (InnoDB's own view, so no sleep guesses when the other thread is blocked). InnoDB
    refreshes that view only when it was last read over 0.1 s ago: poll slower than that."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        found = sql(
            "SELECT count(*) FROM information_schema.innodb_trx "
            "WHERE trx_state = 'LOCK WAIT' AND trx_query LIKE %s",
            (f"%{table}%",),
        )
        if found[0][0]:
            return
        time.sleep(0.12)
    raise AssertionError(f"nothing waited for a lock on {table}")


# --------------------------------------------------------------------------- InnoDB locking


@pytest.mark.parametrize("first", ["commit", "rollback"])
@pytest.mark.parametrize("second", ["two_phase", "joined_with_an_older_snapshot"])
def test_r8_a_claim_waits_for_a_first_claimer_that_has_not_committed(
    store: MySQLStore, table: str, first: str, second: str
) -> None:
    """Connection A claims a key in an open transaction; B claims it from another thread and
    blocks on A's row lock. A commits: B finds A's marker. A rolls back: B inserts its own.

    ``joined_with_an_older_snapshot``: B is inside a transaction of its own that read the
    table before A committed. Under REPEATABLE READ a plain SELECT would still show B that
    snapshot, without A's row, although the INSERT saw it; the store's locking read does not.
    """
    a = admin()
    a.begin()
    assert _claim_in(store, a, "k", "A").status is ClaimStatus.NEW

    def claim_b() -> oncely.stores.Claim:
        if second == "two_phase":
            return _claim(store, "k", "B")
        b = admin()
        try:
            b.begin()
            with b.cursor() as cursor:
                cursor.execute(f"SELECT count(*) FROM `{table}`")  # B's snapshot starts here
                assert cursor.fetchone() == (0,)
            claim = _claim_in(store, b, "k", "B")
            b.commit()
            return claim
        finally:
            b.close()

    thread, out = _in_thread(claim_b)
    _wait_for_lock_wait(table)
    getattr(a, first)()
    thread.join(30)
    a.close()
    assert "error" not in out, out
    claim = out["value"]
    if first == "commit":
        assert claim.status is ClaimStatus.EXISTING and claim.record.token == "A"
        assert claim.record.status is Status.COMPLETED
    else:
        assert claim.status is ClaimStatus.NEW and claim.record.token == "B"
    record = store.get("billing", "k")
    assert record is not None and record.token == claim.record.token


def test_r8_a_deadlocked_batch_claim_is_retried_transparently(
    store: MySQLStore, table: str
) -> None:
    """A real deadlock: transaction A holds key k2 and then wants k1; a batch claim of (k1, k2)
    holds k1 and waits for k2. InnoDB rolls back the lighter one, the batch (A has written
    more rows); the store runs it again, and it answers as if A had simply gone first."""
    sql(f"CREATE TABLE `{table}_ledger` (k VARCHAR(64) NOT NULL) ENGINE=InnoDB")
    deadlocks = _deadlocks()
    a = admin()
    a.begin()
    with a.cursor() as cursor:  # A's weight: rows written before the claims
        for i in range(20):
            cursor.execute(f"INSERT INTO `{table}_ledger` (k) VALUES (%s)", (f"w{i}",))
    assert _claim_in(store, a, "k2", "A2").status is ClaimStatus.NEW
    batch = [ClaimRequest("k1", "f", "B1"), ClaimRequest("k2", "f", "B2")]
    thread, out = _in_thread(
        lambda: store.claim_many(
            "billing", batch, lease_ms=LEASE_MS, keep_ms=KEEP_MS, takeover=False
        )
    )
    _wait_for_lock_wait(table)
    assert _claim_in(store, a, "k1", "A1").status is ClaimStatus.NEW  # closes the cycle
    a.commit()
    a.close()
    thread.join(30)
    assert "error" not in out, out
    claims = out["value"]
    assert [(c.status, c.record.token) for c in claims] == [
        (ClaimStatus.EXISTING, "A1"),
        (ClaimStatus.EXISTING, "A2"),
    ]
    assert _deadlocks() > deadlocks


def test_r7_a_deadlock_inside_a_joined_claim_says_the_transaction_is_gone(
    store: MySQLStore, table: str
) -> None:
    """Two callers' transactions claim k1, k2 in opposite orders. InnoDB rolls back the
    lighter one: its claim raises StoreUnavailable saying the whole transaction is gone."""
    sql(f"CREATE TABLE `{table}_ledger` (k VARCHAR(64) NOT NULL) ENGINE=InnoDB")
    heavy, light = admin(), admin()
    heavy.begin()
    light.begin()
    with heavy.cursor() as cursor:
        for i in range(20):
            cursor.execute(f"INSERT INTO `{table}_ledger` (k) VALUES (%s)", (f"w{i}",))
    _claim_in(store, heavy, "k2", "H2")
    _claim_in(store, light, "k1", "L1")
    thread, out = _in_thread(lambda: _claim_in(store, light, "k2", "L2"))
    _wait_for_lock_wait(table)
    assert _claim_in(store, heavy, "k1", "H1").status is ClaimStatus.NEW
    thread.join(30)
    heavy.commit()
    error = out.get("error")
    assert isinstance(error, StoreUnavailable), out
    assert "rolled back the whole transaction" in str(error)
    light.rollback()
    for conn in (heavy, light):
        conn.close()
    assert [r.token for r in store.scan(consumer="billing")] == ["H1", "H2"]


def test_r7_a_claim_after_the_server_ended_the_callers_transaction_leaves_no_marker(
    store: MySQLStore, table: str
) -> None:
    """The driver still reports the transaction a deadlock rolled back (the error packet
    carries no status); a caller that swallowed the error and joins it anyway gets
    TransactionRequired, and the marker that autocommitted meanwhile is taken back."""
    sql(f"CREATE TABLE `{table}_scratch` (id INT PRIMARY KEY, v INT) ENGINE=InnoDB")
    sql(f"INSERT INTO `{table}_scratch` VALUES (1, 0), (2, 0)")
    a, b = admin(), admin()
    a.begin()
    b.begin()

    def bump(conn: Any, row: int) -> None:
        with conn.cursor() as cursor:
            cursor.execute(f"UPDATE `{table}_scratch` SET v = v + 1 WHERE id = %s", (row,))

    bump(a, 1)
    bump(b, 2)
    thread, out = _in_thread(lambda: bump(a, 2))
    _wait_for_lock_wait(f"{table}_scratch")
    try:
        bump(b, 1)
        survivor, victim = b, a
    except pymysql.err.OperationalError as exc:
        code = exc.args[0]
        survivor, victim = a, b
    else:
        code = 1213
    assert code == 1213
    thread.join(30)
    survivor.commit()
    assert victim is b or isinstance(out.get("error"), pymysql.err.OperationalError)
    store.check_transaction(victim)  # the stale status still says "in a transaction"
    with pytest.raises(TransactionRequired, match="ended before the claim"):
        _claim_in(store, victim, "k", "t1")
    assert store.get("billing", "k") is None
    for conn in (a, b):
        conn.close()


def test_translation_of_deadlocks_and_lock_waits() -> None:
    deadlock = pymysql.err.OperationalError(1213, "Deadlock found when trying to get lock")
    wait = pymysql.err.OperationalError(1205, "Lock wait timeout exceeded")
    for exc in (deadlock, wait):
        assert isinstance(translate(exc, "claim"), StoreUnavailable)
    assert "rolled back the whole transaction" in str(translate(deadlock, "x", joined=True))
    assert "still open" in str(translate(wait, "x", joined=True))
    syntax = pymysql.err.ProgrammingError(1064, "You have an error in your SQL syntax")
    translated = translate(syntax, "claim")
    assert type(translated) is StoreError
    assert isinstance(translate(pymysql.err.OperationalError(2013, "Lost"), "x"), StoreUnavailable)
    assert isinstance(translate(ConnectionResetError(104, "reset"), "x"), StoreUnavailable)
