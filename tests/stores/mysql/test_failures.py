"""Failures translated (a closed port, a wrong password, an unknown database, a closed
store) and a pool that keeps only healthy connections.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
import uuid
from collections.abc import Callable

import pymysql
import pytest

from oncely.errors import (
    StoreError,
    StoreUnavailable,
)
from oncely.stores import ClaimStatus
from oncely.stores.mysql.async_store import AsyncMySQLStore
from oncely.stores.mysql.errors import describe_error, parse_url
from oncely.stores.mysql.sync_store import MySQLStore
from tests.backends.mysql import admin, sql, url
from tests.services import MYSQL_URL
from tests.stores.mysql.helpers import KEEP_MS, LEASE_MS, _claim, _free_port, _in_thread


def test_a_closed_port_is_unavailable_at_once(server: None) -> None:
    port = _free_port()
    store = MySQLStore.from_url(f"mysql://root@127.0.0.1:{port}/test?connect_timeout=2")
    with pytest.raises(StoreUnavailable, match=r"connecting to mysql://root@127\.0\.0\.1"):
        store.get("c", "k")
    store.close()


def test_a_wrong_password_is_an_error_that_does_not_show_it(table: str) -> None:
    s = parse_url(MYSQL_URL).settings
    user = f"oncely_{uuid.uuid4().hex[:8]}"
    sql(f"CREATE USER '{user}'@'%' IDENTIFIED BY 'right-one'")
    try:
        store = MySQLStore.from_url(
            f"mysql://{user}:wrong-one@{s.host}:{s.port}/{s.database}?table={table}"
        )
        with pytest.raises(StoreError) as failed:
            store.get("c", "k")
        assert not isinstance(failed.value, StoreUnavailable)  # retrying will not help
        assert "wrong-one" not in str(failed.value) and "***" in str(failed.value)
        store.close()
    finally:
        sql(f"DROP USER '{user}'@'%'")


def test_an_unknown_database_is_an_error(server: None) -> None:
    s = parse_url(MYSQL_URL).settings
    url = f"mysql://{s.user}@{s.host}:{s.port}/no_such_db_{os.getpid()}"
    store = MySQLStore.from_url(url)
    with pytest.raises(StoreError) as failed:
        store.get("c", "k")
    store.close()
    # A sentence naming the store, not PyMySQL's (code, message) tuple.
    assert str(failed.value) == (
        f"connecting to {url}: MariaDB/MySQL error 1049: Unknown database "
        f"'no_such_db_{os.getpid()}'"
    )


def test_driver_errors_read_as_sentences() -> None:
    assert describe_error(pymysql.OperationalError(1049, "Unknown database 'x'")) == (
        "MariaDB/MySQL error 1049: Unknown database 'x'"
    )
    assert describe_error(OSError("reset by peer")) == "reset by peer"
    assert describe_error(pymysql.InterfaceError()) == "InterfaceError"


def _session_ids(store: MySQLStore, count: int) -> list[int]:
    """The connection ids of ``count`` pooled connections (all held at once, then returned)."""
    blocks = [store.transaction() for _ in range(count)]
    txs = [block.__enter__() for block in blocks]
    try:
        ids = []
        for tx in txs:
            with tx.cursor() as cursor:
                cursor.execute("SELECT CONNECTION_ID()")
                ids.append(int(cursor.fetchone()[0]))
        return ids
    finally:
        for block in reversed(blocks):
            block.__exit__(None, None, None)


def test_the_pool_drops_connections_the_server_killed(table: str) -> None:
    store = MySQLStore.from_url(url(table, pool_size=2))
    try:
        _claim(store, "k1", "t1")
        for session in _session_ids(store, 2):
            sql(f"KILL CONNECTION {session}")
        assert _claim(store, "k2", "t2").status is ClaimStatus.NEW  # no error surfaces
        record = store.get("billing", "k1")
        assert record is not None and record.token == "t1"
    finally:
        store.close()


async def test_the_async_pool_drops_connections_the_server_killed(table: str) -> None:
    store = AsyncMySQLStore.from_url(url(table, pool_size=2))
    try:
        await store.claim(
            "billing", "k1", fingerprint=None, token="t1", lease_ms=LEASE_MS, keep_ms=KEEP_MS,
            takeover=False,
        )  # fmt: skip
        async with store.transaction() as t1, store.transaction() as t2:
            ids = []
            for tx in (t1, t2):
                cursor = await tx.cursor()
                await cursor.execute("SELECT CONNECTION_ID()")
                ids.append(int((await cursor.fetchone())[0]))
                await cursor.close()
        for session in ids:
            sql(f"KILL CONNECTION {session}")
        await asyncio.sleep(0.05)  # let the event loop read the end of file
        record = await store.get("billing", "k1")
        assert record is not None and record.token == "t1"
    finally:
        await store.aclose()


def test_a_connection_left_without_autocommit_is_not_pooled_again(table: str) -> None:
    """A handler that turned autocommit off on the store's connection: were it pooled again,
    the next two-phase claim on it would wait for a COMMIT that never comes."""
    store = MySQLStore.from_url(url(table, pool_size=1))
    try:
        with store.transaction() as tx:
            tx.autocommit(False)
        _claim(store, "k", "t1")
        assert sql(f"SELECT token FROM `{table}`") == [(b"t1",)]  # committed: seen elsewhere
    finally:
        store.close()


def test_a_closed_store_refuses_work(store: MySQLStore) -> None:
    store.close()
    with pytest.raises(StoreError, match="closed"):
        store.get("c", "k")


def _schema_lock(table: str) -> str:
    return "oncely-schema-" + hashlib.sha256(f"test.{table}".encode()).hexdigest()[:40]


def _kill_the_migrator_in_its_lock(table: str, run: Callable[[], object]) -> BaseException:
    """Run a migration (``run``) that blocks, inside its schema lock (GET_LOCK), on a row lock
    of the version table this test holds, then KILL its session: its RELEASE_LOCK fails for
    real (the connection is gone). The migration's error."""
    lock = _schema_lock(table)
    holder = admin()
    try:
        with holder.cursor() as cursor:
            cursor.execute("BEGIN")
            cursor.execute(f"SELECT * FROM `{table}_meta` FOR UPDATE")
            thread, out = _in_thread(run)
            session = None
            deadline = time.monotonic() + 20
            while session is None and time.monotonic() < deadline:
                time.sleep(0.05)
                session = sql("SELECT IS_USED_LOCK(%s)", (lock,))[0][0]
            assert session is not None, "the migration never took its schema lock"
            sql(f"KILL CONNECTION {int(session)}")
            thread.join(20)
            cursor.execute("ROLLBACK")
    finally:
        holder.close()
    assert "error" in out, out
    error: BaseException = out["error"]
    return error


def test_a_migrator_whose_unlock_failed_is_not_pooled_again(
    table: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A RELEASE_LOCK that fails leaves the session's named lock in doubt: the connection is
    closed (ending the session and the lock with it), never handed back to the pool where it
    could keep the lock for as long as it lives and stop every other migration."""
    store = MySQLStore.from_url(url(table, pool_size=1))
    try:
        store.migrate()
        with caplog.at_level(logging.WARNING, logger="oncely.store"):
            error = _kill_the_migrator_in_its_lock(table, store.migrate)
        assert isinstance(error, StoreError), error
        assert not store._pool._idle, "the connection whose unlock failed went back to the pool"
        assert any("releasing the schema's lock failed" in r.getMessage() for r in caplog.records)
        assert sql("SELECT IS_USED_LOCK(%s)", (_schema_lock(table),)) == [(None,)]
        store.migrate()  # the lock is free: a later migration takes it
    finally:
        store.close()


async def test_an_async_migrator_whose_unlock_failed_is_not_pooled_again(
    table: str, caplog: pytest.LogCaptureFixture
) -> None:
    lock = _schema_lock(table)
    store = AsyncMySQLStore.from_url(url(table, pool_size=1))
    holder = admin()
    try:
        await store.migrate()
        with holder.cursor() as cursor, caplog.at_level(logging.WARNING, logger="oncely.store"):
            cursor.execute("BEGIN")
            cursor.execute(f"SELECT * FROM `{table}_meta` FOR UPDATE")
            migration = asyncio.create_task(store.migrate())
            session = None
            for _ in range(400):
                await asyncio.sleep(0.05)
                session = sql("SELECT IS_USED_LOCK(%s)", (lock,))[0][0]
                if session is not None:
                    break
            assert session is not None, "the migration never took its schema lock"
            sql(f"KILL CONNECTION {int(session)}")
            with pytest.raises(StoreError):
                await migration
            cursor.execute("ROLLBACK")
        assert not store._pool._idle, "the connection whose unlock failed went back to the pool"
        assert any("releasing the schema's lock failed" in r.getMessage() for r in caplog.records)
        assert sql("SELECT IS_USED_LOCK(%s)", (lock,)) == [(None,)]
        await store.migrate()  # the lock is free: a later migration takes it
    finally:
        holder.close()
        await store.aclose()
