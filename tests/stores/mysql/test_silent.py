"""A server gone silent (a dead route: the connections held, nothing answered, no reset): a
statement on one of the store's connections is cut at its ``read_timeout``, and a connection
attempt at its ``connect_timeout``, and raise :class:`~oncely.StoreUnavailable` while the
server is still silent, in both twins (R19: a caller is never held for ever by its store).
Statements inside a transaction, ``stats()`` and ``scan()`` are not cut: they may wait long
by nature. The store's TCP connections carry keepalives.

The server is reached through ``tests.brokers.common.Proxy``, which the test makes silent and
then cuts (what it swallowed is lost)."""

from __future__ import annotations

import asyncio
import socket
import threading
from datetime import timedelta

import pytest

import oncely
from oncely.stores.mysql.async_store import AsyncMySQLStore
from oncely.stores.mysql.sync_store import MySQLStore
from tests.backends.mysql import admin, url
from tests.brokers.common import Proxy
from tests.stores.silent import (
    assert_a_sooner_read_timeout_is_kept_while_a_later_one_waits,
    assert_cut_while_silent,
)


async def test_r19_a_statement_on_a_silent_connection_is_cut_at_the_read_timeout(
    table: str,
) -> None:
    """A store whose ``read_timeout`` is sooner than another's, waiting, is cut at its own,
    while the server is silent (the check is the PostgreSQL store's too). Before, both
    waited until the relay cut their connections."""
    await assert_a_sooner_read_timeout_is_kept_while_a_later_one_waits(url(table), MySQLStore)


async def test_r19_the_asyncio_store_is_cut_at_its_read_timeout_too(table: str) -> None:
    """The asyncio twin (aiomysql, which has no read timeout of its own) shares the
    watchdog: a claim on a silent connection raises ``StoreUnavailable`` at ``read_timeout``
    (1 s here) while the server is still silent, without a caller's own timeout."""
    async with Proxy(url(table, read_timeout=1)) as proxy:
        store = oncely.open_async(proxy.url)
        assert isinstance(store, AsyncMySQLStore)
        try:
            assert await store.get("c", "k") is None
            proxy.silent = True
            told = asyncio.create_task(
                store.claim(
                    "c", "k", fingerprint=None, token="t1", lease_ms=30_000, keep_ms=60_000,
                    takeover=False,
                )
            )  # fmt: skip
            await assert_cut_while_silent(proxy, told, r"no answer .*read_timeout")
            proxy.silent = False
            proxy.cut()
            for _ in range(50):  # the pool opens a new connection
                try:
                    assert await store.get("c", "k") is None  # the claim never reached it
                    break
                except oncely.StoreUnavailable:
                    await asyncio.sleep(0.2)
        finally:
            proxy.silent = False
            proxy.cut()
            await store.aclose()


@pytest.mark.parametrize("twin", ["sync", "asyncio"])
async def test_r19_a_connection_attempt_to_a_silent_server_is_cut_at_the_connect_timeout(
    table: str, twin: str
) -> None:
    """A new connection to a server gone silent: the TCP connect succeeds (the relay
    accepts), the server's greeting never comes. Both drivers bound only the TCP connect by
    their ``connect_timeout``; the handshake is now cut at it too (1 s here), and the store
    raises ``StoreUnavailable`` while the server is still silent (before, it waited for the
    greeting until the relay cut the connection)."""
    async with Proxy(url(table, connect_timeout=1)) as proxy:
        proxy.silent = True
        if twin == "sync":
            store = oncely.open(proxy.url)
            attempt = asyncio.create_task(asyncio.to_thread(store.get, "c", "k"))
        else:
            astore = oncely.open_async(proxy.url)
            attempt = asyncio.create_task(astore.get("c", "k"))
        try:
            await assert_cut_while_silent(
                proxy,
                attempt,
                r"no answer .*connect_timeout",
                what="the connection attempt waited past its connect_timeout",
            )
        finally:
            proxy.silent = False
            proxy.cut()
            if twin == "sync":
                store.close()
            else:
                await astore.aclose()


def test_r19_a_statement_in_a_transaction_is_not_cut_while_it_waits_on_a_row_lock(
    store: MySQLStore,
) -> None:
    """``read_timeout`` (1 s) does not cut a transaction's statement waiting (2 s here) on
    another transaction's row lock: it may wait up to ``innodb_lock_wait_timeout``. The same
    kind of wait outside a transaction, on the message path, is cut."""
    quick = MySQLStore.from_url(url(store.table, read_timeout=1))
    holder = admin()
    try:
        assert quick.get("c", "k") is None
        with holder.cursor() as cursor:  # the meta row: both statements below lock it
            cursor.execute("BEGIN")
            cursor.execute(f"SELECT * FROM `{store.table}_meta` FOR UPDATE")
        timer = threading.Timer(2.0, holder.rollback)
        timer.start()
        try:
            with quick.transaction() as tx:
                quick._joined(tx, f"SELECT * FROM `{store.table}_meta` FOR UPDATE", "lock")
        finally:
            timer.join()
        with holder.cursor() as cursor:
            cursor.execute("BEGIN")
            cursor.execute(f"SELECT * FROM `{store.table}_meta` FOR UPDATE")
        lock = f"SELECT * FROM `{store.table}_meta` FOR UPDATE"
        with pytest.raises(oncely.StoreUnavailable, match=r"no answer .* within 1s"):
            quick._rows("get", lock, {})
        holder.rollback()
    finally:
        holder.close()
        quick.close()


async def test_r19_stats_and_scan_are_not_cut_and_the_message_path_is(table: str) -> None:
    """A statement that takes longer than ``read_timeout`` by nature (``SLEEP(1)``, bound
    0.4 s): the operations ``stats`` and ``scan`` wait for it, a read of the message path is
    cut; in the asyncio twin as in the threaded one."""
    slow = "SELECT SLEEP(1)"
    sync = MySQLStore.from_url(url(table, read_timeout=0.4))
    try:
        for op in ("stats", "scan"):
            assert await asyncio.to_thread(sync._rows, op, slow, {}) == [(0,)]
        with pytest.raises(oncely.StoreUnavailable, match="no answer"):
            await asyncio.to_thread(sync._rows, "get", slow, {})
    finally:
        sync.close()
    store = AsyncMySQLStore.from_url(url(table, read_timeout=0.4))
    try:
        for op in ("stats", "scan"):
            assert await store._rows(op, slow, {}) == [(0,)]
        with pytest.raises(oncely.StoreUnavailable, match="no answer"):
            await store._rows("get", slow, {})
    finally:
        await store.aclose()


async def test_the_store_connections_have_tcp_keepalives(table: str) -> None:
    """A dead peer is found in about 30 s, not the system's two hours: keepalive probes 15 s
    after the last traffic, every 5 s, 3 of them; data unacknowledged for 30 s."""
    expected = {
        socket.TCP_KEEPIDLE: 15,
        socket.TCP_KEEPINTVL: 5,
        socket.TCP_KEEPCNT: 3,
        socket.TCP_USER_TIMEOUT: 30_000,
    }
    sync = MySQLStore.from_url(url(table))
    try:
        conn = sync._acquire()
        try:
            sock = _sync_socket(conn)
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            assert {o: sock.getsockopt(socket.IPPROTO_TCP, o) for o in expected} == expected
        finally:
            sync._release(conn)
    finally:
        sync.close()
    store = AsyncMySQLStore.from_url(url(table))
    try:
        conn = await store._acquire()
        try:
            sock = conn._writer.transport.get_extra_info("socket")
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            assert {o: sock.getsockopt(socket.IPPROTO_TCP, o) for o in expected} == expected
        finally:
            await store._release(conn)
    finally:
        await store.aclose()


def _sync_socket(conn: object) -> socket.socket:
    sock = conn._sock  # type: ignore[attr-defined]
    assert isinstance(sock, socket.socket)
    return sock


def test_read_timeout_from_the_url_and_its_bad_values(server: None) -> None:
    assert MySQLStore.from_url(url("t", read_timeout=2.5))._read_seconds == 2.5
    assert MySQLStore.from_url(url("t", read_timeout=0))._read_seconds is None
    assert MySQLStore.from_url(url("t"))._read_seconds == 10.0
    assert AsyncMySQLStore("test", read_timeout=None)._read_seconds is None
    with pytest.raises(oncely.ConfigurationError, match="read_timeout"):
        oncely.open(url("t", read_timeout=-1))
    with pytest.raises(oncely.ConfigurationError, match="read_timeout"):
        oncely.open(url("t", read_timeout="soon"))
    with pytest.raises(oncely.ConfigurationError, match="read_timeout"):
        MySQLStore("test", read_timeout=timedelta(0))
