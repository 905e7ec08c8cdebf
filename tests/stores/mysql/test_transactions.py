"""Joining a caller's transaction (R7): the transaction flag followed, the marker
committed with the caller's writes, savepoints that roll back only their own.
"""

from __future__ import annotations

from typing import Any

import aiomysql
import pytest

import oncely
from oncely import Outcome
from oncely.errors import (
    TransactionRequired,
)
from oncely.stores import ClaimStatus
from oncely.stores.mysql.async_store import AsyncMySQLStore
from oncely.stores.mysql.errors import parse_url
from oncely.stores.mysql.sync_store import MySQLStore
from tests.backends.mysql import admin, sql, url
from tests.services import MYSQL_URL
from tests.stores.mysql.helpers import KEEP_MS

# --------------------------------------------------------------------------- transactions


def test_r7_check_transaction_follows_the_servers_transaction_flag(store: MySQLStore) -> None:
    conn = admin()  # autocommit on
    try:
        with pytest.raises(TransactionRequired):
            store.check_transaction(conn)
        conn.begin()
        store.check_transaction(conn)
        conn.commit()
        with pytest.raises(TransactionRequired):
            store.check_transaction(conn)
        with conn.cursor() as cursor:
            cursor.execute("START TRANSACTION")
        store.check_transaction(conn)
        conn.rollback()
        conn.autocommit(False)  # the next statement opens a transaction the caller commits
        store.check_transaction(conn)
    finally:
        conn.close()
    with pytest.raises(TransactionRequired):
        store.check_transaction(object())


def test_r7_the_marker_commits_with_the_callers_writes(store: MySQLStore, table: str) -> None:
    sql(f"CREATE TABLE `{table}_ledger` (k VARCHAR(64) NOT NULL) ENGINE=InnoDB")
    inbox = oncely.Inbox(store, consumer="billing")

    def book(tx: Any, payload: dict[str, str]) -> str:
        with tx.cursor() as cursor:
            cursor.execute(f"INSERT INTO `{table}_ledger` (k) VALUES (%s)", (payload["k"],))
            cursor.execute("SELECT CONNECTION_ID()")
            return str(cursor.fetchone()[0])

    conn = admin()
    conn.autocommit(False)  # PyMySQL's own default: a transaction opens implicitly
    try:
        first = inbox.handle_in_transaction("k", {"k": "k"}, book, tx=conn)
        with conn.cursor() as cursor:
            cursor.execute("SELECT CONNECTION_ID()")
            assert first.value == str(cursor.fetchone()[0])  # the handler got our connection
        assert first.outcome is Outcome.PROCESSED and store.get("billing", "k") is None
        conn.commit()
        assert sql(f"SELECT count(*) FROM `{table}_ledger`") == [(1,)]
        assert inbox.handle_in_transaction("k", {"k": "k"}, book).outcome is Outcome.DUPLICATE
    finally:
        conn.close()


def test_nested_savepoints_roll_back_only_their_own_writes(store: MySQLStore, table: str) -> None:
    sql(f"CREATE TABLE `{table}_ledger` (k VARCHAR(64) NOT NULL) ENGINE=InnoDB")
    inbox = oncely.Inbox(store, consumer="billing")

    def write(tx: Any, key: str) -> None:
        with tx.cursor() as cursor:
            cursor.execute(f"INSERT INTO `{table}_ledger` (k) VALUES (%s)", (key,))

    def inner_fails(tx: Any, payload: object) -> None:
        raise ValueError("inner")

    def outer(tx: Any, payload: object) -> str:
        write(tx, "outer")
        failed = inbox.handle_in_transaction("inner", {"i": 1}, inner_fails, tx=tx)
        assert failed.outcome is Outcome.FAILED
        write(tx, "after")
        return "ok"

    with store.transaction() as tx:
        assert inbox.handle_in_transaction("outer", {"o": 1}, outer, tx=tx).ok
    assert sorted(sql(f"SELECT k FROM `{table}_ledger`")) == [("after",), ("outer",)]
    assert store.get("billing", "inner") is None and store.get("billing", "outer") is not None


def test_r7_savepoints_left_in_place_never_hide_the_one_to_roll_back_to(
    store: MySQLStore, table: str
) -> None:
    """In one caller transaction: messages that fail between, inside and around successful
    ones (nested handlers, a second store nesting in the first, the caller's own savepoints
    in between) undo exactly their own writes and markers."""
    sql(f"CREATE TABLE `{table}_ledger` (k VARCHAR(64) NOT NULL) ENGINE=InnoDB")
    other = MySQLStore.from_url(url(table))
    inbox = oncely.Inbox(store, consumer="billing")
    second = oncely.Inbox(other, consumer="second")

    def write(tx: Any, key: str) -> None:
        with tx.cursor() as cursor:
            cursor.execute(f"INSERT INTO `{table}_ledger` (k) VALUES (%s)", (key,))

    def book(tx: Any, payload: str) -> None:
        write(tx, payload)
        if payload.startswith("bad"):
            raise ValueError(payload)

    def nested(via: oncely.Inbox, inner_fails: bool, outer_fails: bool) -> Any:
        def outer(tx: Any, payload: str) -> None:
            write(tx, f"{payload}-outer")
            inner_key = f"{'bad-' if inner_fails else ''}{payload}-inner"
            inner = via.handle_in_transaction(inner_key, inner_key, book, tx=tx)
            assert inner.ok is not inner_fails
            write(tx, f"{payload}-after")
            if outer_fails:
                raise ValueError(payload)

        return outer

    conn = admin()
    try:
        conn.begin()
        for key in ("a", "bad-1", "b"):
            inbox.handle_in_transaction(key, key, book, tx=conn)
        assert not inbox.handle_in_transaction("n1", "n1", nested(inbox, False, True), tx=conn).ok
        assert inbox.handle_in_transaction("n2", "n2", nested(inbox, True, False), tx=conn).ok
        assert not inbox.handle_in_transaction("n3", "n3", nested(second, False, True), tx=conn).ok
        assert inbox.handle_in_transaction("n4", "n4", nested(second, True, False), tx=conn).ok
        with conn.cursor() as cursor:
            cursor.execute("SAVEPOINT mine")
        inbox.handle_in_transaction("gone", "gone", book, tx=conn)
        with conn.cursor() as cursor:
            cursor.execute("ROLLBACK TO SAVEPOINT mine")
        inbox.handle_in_transaction("c", "c", book, tx=conn)
        inbox.handle_in_transaction("bad-2", "bad-2", book, tx=conn)
        conn.commit()
    finally:
        conn.close()
        other.close()
    written = {"a", "b", "n2-outer", "n2-after", "n4-outer", "n4-after", "c"}
    assert sorted(sql(f"SELECT k FROM `{table}_ledger`")) == sorted((k,) for k in written)
    assert {r.key for r in store.scan()} == {"a", "b", "n2", "n4", "c"}


async def test_r7_async_check_transaction_and_joined_claims(table: str) -> None:
    store = AsyncMySQLStore.from_url(url(table))
    s = parse_url(MYSQL_URL).settings
    conn = await aiomysql.connect(
        host=s.host, port=s.port, user=s.user, password=s.password or "", db=s.database,
        autocommit=True, charset="utf8mb4",
    )  # fmt: skip
    try:
        with pytest.raises(TransactionRequired):
            store.check_transaction(conn)
        await conn.begin()
        store.check_transaction(conn)
        claim = await store.claim_in(
            conn, "billing", "k\U0001f600", fingerprint=None, token="t1", keep_ms=KEEP_MS,
            takeover=False,
        )  # fmt: skip
        assert claim.status is ClaimStatus.NEW
        await conn.rollback()
        with pytest.raises(TransactionRequired):
            store.check_transaction(conn)
        assert await store.get("billing", "k\U0001f600") is None
    finally:
        conn.close()
        await store.aclose()
