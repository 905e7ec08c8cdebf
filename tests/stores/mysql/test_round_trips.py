"""Statements per operation, counted by the server (the session's ``Questions``)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pymysql

import oncely
from oncely._core.records import ClaimRequest
from oncely.stores.mysql.sync_store import MySQLStore
from tests.backends.mysql import admin, sql, url
from tests.stores.mysql.helpers import KEEP_MS, LEASE_MS, _claim, _claim_in, _questions


def _statements(store: MySQLStore, call: Callable[[], object]) -> int:
    """The statements the server counted on the store's only connection while ``call`` ran,
    plus those of the count itself (subtract a baseline)."""
    with store.transaction() as tx:
        first = _questions(tx)
    call()
    with store.transaction() as tx:
        return _questions(tx) - first


def test_r8_a_new_key_is_one_statement_and_a_duplicate_two(table: str) -> None:
    """Counted by the server (the session's ``Questions``) on the store's only connection. A
    batch of new keys is one statement too (its OK packet says every key went in); a batch
    that meets an existing key reads the rows back (two)."""
    store = MySQLStore.from_url(url(table, pool_size=1))
    store.migrate()

    def statements(call: Callable[[], object]) -> int:
        return _statements(store, call)

    try:
        baseline = statements(lambda: None)
        assert statements(lambda: _claim(store, "k", "t1")) - baseline == 1
        assert statements(lambda: _claim(store, "k", "t2")) - baseline == 2
        done = statements(
            lambda: store.complete("billing", "k", token="t1", result=b"r", keep_ms=KEEP_MS)
        )
        assert done - baseline == 2
        batch = [ClaimRequest(f"b{i}", None, f"bt{i}") for i in range(200)]
        many = statements(
            lambda: store.claim_many(
                "billing", batch, lease_ms=LEASE_MS, keep_ms=KEEP_MS, takeover=False
            )
        )
        assert many - baseline == 1
        mixed = [ClaimRequest("b0", None, "bt-again"), ClaimRequest("new", None, "bt-new")]
        again = statements(
            lambda: store.claim_many(
                "billing", mixed, lease_ms=LEASE_MS, keep_ms=KEEP_MS, takeover=False
            )
        )
        assert again - baseline == 2
        with store.transaction() as tx:
            before = _questions(tx)
            _claim_in(store, tx, "joined", "t3")
            assert _questions(tx) - before == 2  # the claim, and this SHOW
    finally:
        store.close()


def test_r7_a_joined_message_adds_its_savepoint_and_claim_and_no_release(
    store: MySQLStore, table: str
) -> None:
    """Counted by the server on the caller's connection: the default savepoint costs one
    statement (SAVEPOINT) besides the claim, one at the end of a successful handler (the
    claim looked for, as a deadlock the handler caught would have rolled it back; no
    RELEASE), and a failing handler adds only the ROLLBACK TO."""
    sql(f"CREATE TABLE `{table}_ledger` (k VARCHAR(64) NOT NULL) ENGINE=InnoDB")
    inbox = oncely.Inbox(store, consumer="billing")

    def book(tx: Any, payload: str) -> None:
        with tx.cursor() as cursor:
            cursor.execute(f"INSERT INTO `{table}_ledger` (k) VALUES (%s)", (payload,))
        if payload.startswith("bad"):
            raise ValueError(payload)

    conn = admin()
    try:
        conn.begin()
        counted = []
        for key in ("a", "bad", "b"):
            before = _questions(conn)
            inbox.handle_in_transaction(key, key, book, tx=conn)
            counted.append(_questions(conn) - before - 1)  # less the SHOW of _questions
        conn.commit()
    finally:
        conn.close()
    # SAVEPOINT, claim, the handler's INSERT, the claim's check; for the failing one the
    # ROLLBACK TO instead of the check; the first message also reads which database the
    # connection is on (once per connection)
    assert counted == [5, 4, 4]
    assert sorted(sql(f"SELECT k FROM `{table}_ledger`")) == [("a",), ("b",)]


def test_r7_the_stores_own_transaction_looks_for_its_claim_only_after_a_doubt(
    table: str,
) -> None:
    """Counted by the server on the store's only connection: a message in oncely's own
    transaction is SET autocommit = 0, the claim, the handler's INSERT and SET autocommit = 1
    (which commits), no look for the claim; a handler that caught an error (as it would a
    deadlock that rolled everything back) costs the look, which finds the claim here."""
    store = MySQLStore.from_url(url(table, pool_size=1))
    store.migrate()
    sql(f"CREATE TABLE `{table}_ledger` (k VARCHAR(64) NOT NULL) ENGINE=InnoDB")
    inbox = oncely.Inbox(store, consumer="billing")

    def statements(call: Callable[[], object]) -> int:
        return _statements(store, call)

    def book(tx: Any, payload: str) -> None:
        with tx.cursor() as cursor:
            cursor.execute(f"INSERT INTO `{table}_ledger` (k) VALUES (%s)", (payload,))

    def shrugs(tx: Any, payload: str) -> None:
        with tx.cursor() as cursor, contextlib.suppress(pymysql.err.OperationalError):
            cursor.execute(f"SELECT no_such_column FROM `{table}_ledger`")
        book(tx, payload)

    try:
        baseline = statements(lambda: None)
        plain = statements(lambda: inbox.handle_in_transaction("a", "a", book))
        assert plain - baseline == 4
        doubted = statements(lambda: inbox.handle_in_transaction("b", "b", shrugs))
        assert doubted - baseline == 6  # and the failed SELECT, and the look
    finally:
        store.close()
    assert sorted(sql(f"SELECT k FROM `{table}_ledger`")) == [("a",), ("b",)]
