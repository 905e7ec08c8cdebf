"""MariaDB / MySQL store schema and data: the table layout, migrations, keys as exact
bytes, and time read from the server.
"""

from __future__ import annotations

import threading

import pytest

import oncely
from oncely import Outcome
from oncely.errors import (
    KeyTooLong,
    SchemaMissing,
    SchemaTooNew,
)
from oncely.stores import ClaimStatus
from oncely.stores.mysql.dialect import MAX_KEY_BYTES
from oncely.stores.mysql.sync_store import MySQLStore
from tests.backends.mysql import admin, drop_tables, sql, url
from tests.stores.mysql.helpers import LEASE_MS, _claim, _claim_in, _in_thread, _server_ms

# --------------------------------------------------------------------------- schema


def test_the_table_is_innodb_with_varbinary_keys(store: MySQLStore, table: str) -> None:
    rows = sql(
        "SELECT engine, row_format FROM information_schema.tables "
        "WHERE table_schema = DATABASE() AND table_name = %s",
        (table,),
    )
    assert rows == [("InnoDB", "Dynamic")]
    columns = dict(
        sql(
            "SELECT column_name, column_type FROM information_schema.columns "
            "WHERE table_schema = DATABASE() AND table_name = %s",
            (table,),
        )
    )
    assert columns["consumer"] == "varbinary(800)"
    assert columns["key"] == f"varbinary({MAX_KEY_BYTES})"
    assert columns["created_ms"] == "bigint(20)" and columns["result"] == "longblob"
    assert sql(f"SELECT value FROM `{table}_meta` WHERE name = 'schema_version'") == [("2",)]


def test_missing_tables_are_a_clear_error_when_migration_is_off(table: str) -> None:
    store = MySQLStore.from_url(url(table, migrate="false"))
    try:
        with pytest.raises(SchemaMissing, match="oncely migrate"):
            store.get("c", "k")
        assert store.schema_version() is None
        assert store.migrate() == 2 and store.schema_version() == 2
        assert store.get("c", "k") is None
    finally:
        store.close()


def test_tables_dropped_under_a_running_store_are_reported(store: MySQLStore, table: str) -> None:
    _claim(store, "k", "t1")
    drop_tables(table)
    with pytest.raises(SchemaMissing, match="oncely migrate"):
        _claim(store, "k2", "t2")


def test_a_newer_schema_is_refused(store: MySQLStore, table: str) -> None:
    sql(f"UPDATE `{table}_meta` SET value = '9' WHERE name = 'schema_version'")
    other = MySQLStore.from_url(url(table))
    try:
        with pytest.raises(SchemaTooNew, match="version 9"):
            other.get("c", "k")
        with pytest.raises(SchemaTooNew):
            other.migrate()
    finally:
        other.close()


def test_migrations_racing_in_threads_all_succeed(table: str) -> None:
    stores = [MySQLStore.from_url(url(table)) for _ in range(6)]
    start = threading.Barrier(len(stores))

    def migrate(store: MySQLStore) -> int:
        start.wait(timeout=10)
        return store.migrate()

    runs = [_in_thread(lambda s=s: migrate(s)) for s in stores]  # type: ignore[misc]
    for thread, _ in runs:
        thread.join(30)
    assert [out.get("value", out.get("error")) for _, out in runs] == [2] * len(stores)
    meta = sql(f"SELECT name, value FROM `{table}_meta` ORDER BY name")
    assert [tuple(row) for row in meta] == [("revision", "3"), ("schema_version", "2")]
    for store in stores:
        store.close()


# --------------------------------------------------------------------------- keys and time


def test_r2_keys_are_exact_bytes(store: MySQLStore) -> None:
    """Case, trailing and leading spaces, accents composed or not, 4-byte characters: each its
    own key (a PAD SPACE or case-insensitive collation would merge some of them)."""
    keys = ["k", "K", "k ", " k", "\u00e9", "e\u0301", "\U0001f600", "\u00df", "ss", "a\tb"]
    for i, key in enumerate(keys):
        assert _claim(store, key, f"t{i}").status is ClaimStatus.NEW, key
    for i, key in enumerate(keys):
        record = store.get("billing", key)
        assert record is not None and (record.key, record.token) == (key, f"t{i}")
    assert [r.key for r in store.scan(consumer="billing", limit=50)] == sorted(keys)


def test_the_longest_keys_and_consumers_round_trip(store: MySQLStore) -> None:
    key = "\U0001f600" * (MAX_KEY_BYTES // 4)  # 2048 bytes of 4-byte characters
    consumer = "\U0001f600" * 200  # the longest consumer name oncely accepts
    claim = _claim(store, key, "t1", consumer=consumer)
    assert claim.status is ClaimStatus.NEW
    assert store.get(consumer, key) == claim.record
    with pytest.raises(KeyTooLong, match="hash_long_keys"):
        _claim(store, key + "x", "t2")
    inbox = oncely.Inbox(store, consumer="billing")  # Limits(max_key_bytes=512) by default
    longest = "\u00e9" * 256
    assert inbox.handle(longest, {"a": 1}, lambda p: "ok").outcome is Outcome.PROCESSED
    assert inbox.handle(longest, {"a": 1}, lambda p: "ok").outcome is Outcome.DUPLICATE


def test_time_comes_from_the_server_whatever_the_session_time_zone(store: MySQLStore) -> None:
    before = _server_ms()
    claim = _claim(store, "two-phase", "t1")
    conn = admin()
    try:
        with conn.cursor() as cursor:
            cursor.execute("SET time_zone = '+05:00'")  # a caller's session in another zone
        conn.begin()
        joined = _claim_in(store, conn, "joined", "t2")
        conn.commit()
    finally:
        conn.close()
    after = _server_ms()
    for made in (claim, joined):
        assert before <= made.now_ms <= after
        assert made.record.created_ms == made.now_ms
    assert claim.record.lease_until_ms == claim.now_ms + LEASE_MS
    seen = _claim(store, "two-phase", "t3")
    assert seen.status is ClaimStatus.EXISTING and claim.now_ms <= seen.now_ms <= _server_ms()
