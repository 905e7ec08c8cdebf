"""A result larger than the server's ``max_allowed_packet`` (R1, R10): the store learns the
bound when it connects, and a result over it is completed without it, as one over
``Limits.max_result_bytes`` is, instead of being sent and refused after the handler ran.

Sent anyway, MariaDB drops the connection ("server has gone away"): the completion failed as
if the store were down, the next delivery found the claim ``in_flight``, and once the lease
lapsed the handler ran a second time. The session value cannot be set smaller per connection
(MariaDB and MySQL keep it read-only), so these tests send a result just over the server's own.
"""

from __future__ import annotations

from typing import Any

import aiomysql
import pytest

import oncely
from oncely import Outcome
from oncely.errors import ResultTooLarge, ResultUnavailable
from oncely.stores.mysql.async_store import AsyncMySQLStore
from oncely.stores.mysql.errors import parse_url
from oncely.stores.mysql.sync_store import MySQLStore
from tests.backends.mysql import admin, sql, url
from tests.services import MYSQL_URL
from tests.stores.mysql.helpers import KEEP_MS

_LIMITS = oncely.Limits(max_result_bytes=256 * 1024 * 1024)  # raised far above the packet


def _packet() -> int:
    return int(sql("SELECT @@GLOBAL.max_allowed_packet")[0][0])


def _over() -> str:
    """A result whose JSON is just over what one statement can carry."""
    return "x" * (_packet() + 1)


def _assert_not_kept(first: Any, runs: list[int], repeat: Any) -> None:
    assert first.outcome is Outcome.PROCESSED
    assert first.reason is not None and first.reason.startswith("result not stored")
    assert "max_allowed_packet" in first.reason
    assert first.record.result is None
    assert repeat.outcome is Outcome.DUPLICATE
    assert repeat.reason is not None and repeat.reason.startswith("result not stored")
    assert runs == [1]


def test_r10_a_result_over_max_allowed_packet_is_not_kept_and_not_run_again(
    store: MySQLStore, caplog: pytest.LogCaptureFixture
) -> None:
    inbox = oncely.Inbox(store, consumer="billing", limits=_LIMITS)
    runs: list[int] = []
    big = _over()

    def handler(payload: object) -> str:
        runs.append(1)
        return big

    first = inbox.handle("k", {"n": 1}, handler)
    assert first.value == big  # the caller still gets what the handler returned
    assert "max_allowed_packet" in caplog.text
    _assert_not_kept(first, runs, inbox.handle("k", {"n": 1}, handler))

    @inbox.idempotent(key=lambda n: "d")
    def decorated(n: int) -> str:
        runs.append(1)
        return big

    decorated(1)
    with pytest.raises(ResultUnavailable, match="max_allowed_packet"):
        decorated(1)
    assert runs == [1, 1]


def test_r10_a_result_within_the_room_is_kept_whole(store: MySQLStore) -> None:
    inbox = oncely.Inbox(store, consumer="billing", limits=_LIMITS)
    inbox.handle("warm", None, lambda p: None)  # the store connects, and learns the bound
    room = store.result_room()
    assert room is not None and room[0] > 0
    fits = "y" * (room[0] - 2)  # its JSON is exactly the room
    first = inbox.handle("k", None, lambda p: fits)
    assert first.outcome is Outcome.PROCESSED and first.reason is None
    repeat = inbox.handle("k", None, lambda p: "again")
    assert repeat.outcome is Outcome.DUPLICATE and repeat.value == fits


def test_r10_the_room_follows_the_servers_max_allowed_packet(store: MySQLStore) -> None:
    store.get("billing", "absent")  # one connection opened
    room = store.result_room()
    assert room is not None
    packet = _packet()
    assert f"{packet} bytes" in room[1]
    assert 0 < room[0] < packet // 2


def test_r10_a_batch_completes_the_result_that_fits_and_not_the_other(
    store: MySQLStore,
) -> None:
    inbox = oncely.Inbox(store, consumer="billing", limits=_LIMITS)
    big = _over()
    runs: list[str] = []

    def handler(payload: str) -> str:
        runs.append(payload)
        return big if payload == "big" else payload

    items = [("a", "a"), ("big", "big"), ("c", "c")]
    first = inbox.handle_batch(items, handler)
    assert [h.outcome for h in first] == [Outcome.PROCESSED] * 3
    assert first[1].reason is not None and "max_allowed_packet" in first[1].reason
    again = inbox.handle_batch(items, handler)
    assert [h.outcome for h in again] == [Outcome.DUPLICATE] * 3
    assert again[0].value == "a" and again[2].value == "c"
    assert again[1].reason is not None and again[1].reason.startswith("result not stored")
    assert runs == ["a", "big", "c"]


def test_r7_in_its_own_transaction_a_result_over_the_packet_fails_it(
    store: MySQLStore, table: str
) -> None:
    """As a result over max_result_bytes: the transaction rolls back, the handler's writes
    with it, and the outcome is ``failed`` with :class:`~oncely.ResultTooLarge` (nothing
    happened, so nothing is lost), not a store outage."""
    inbox = oncely.Inbox(store, consumer="billing", limits=_LIMITS)
    sql(f"CREATE TABLE `{table}_ledger` (k VARCHAR(32) PRIMARY KEY)")
    big = _over()

    def handler(tx: Any, payload: object) -> str:
        with tx.cursor() as cursor:
            cursor.execute(f"INSERT INTO `{table}_ledger` VALUES ('k')")
        return big

    done = inbox.handle_in_transaction("k", None, handler)
    assert done.outcome is Outcome.FAILED
    assert isinstance(done.error, ResultTooLarge)
    assert store.get("billing", "k") is None
    assert sql(f"SELECT k FROM `{table}_ledger`") == []


def test_r7_a_callers_connection_is_checked_against_its_own_packet(store: MySQLStore) -> None:
    conn = admin()
    try:
        conn.begin()
        store.claim_in(
            conn, "billing", "k", fingerprint=None, token="t1", keep_ms=KEEP_MS, takeover=False
        )
        with pytest.raises(ResultTooLarge, match="max_allowed_packet"):
            store.set_result_in(conn, "billing", "k", token="t1", result=b"z" * _packet())
        store.set_result_in(conn, "billing", "k", token="t1", result=b"small")
        conn.commit()
    finally:
        conn.close()
    record = store.get("billing", "k")
    assert record is not None and record.result == b"small"


# --------------------------------------------------------------------------- asyncio


async def test_r10_async_a_result_over_max_allowed_packet_is_not_kept(table: str) -> None:
    store = AsyncMySQLStore.from_url(url(table))
    try:
        inbox = oncely.AsyncInbox(store, consumer="billing", limits=_LIMITS)
        runs: list[int] = []
        big = _over()

        async def handler(payload: object) -> str:
            runs.append(1)
            return big

        first = await inbox.handle("k", None, handler)
        _assert_not_kept(first, runs, await inbox.handle("k", None, handler))
        batch = await inbox.handle_batch([("a", None), ("b", None)], handler)
        assert [h.outcome for h in batch] == [Outcome.PROCESSED] * 2
        assert all(h.reason and "max_allowed_packet" in h.reason for h in batch)
    finally:
        await store.aclose()


async def test_r7_async_a_result_over_the_packet_fails_the_transaction(table: str) -> None:
    store = AsyncMySQLStore.from_url(url(table))
    s = parse_url(MYSQL_URL).settings
    conn = await aiomysql.connect(
        host=s.host, port=s.port, user=s.user, password=s.password or "", db=s.database,
        autocommit=True, charset="utf8mb4",
    )  # fmt: skip
    try:
        inbox = oncely.AsyncInbox(store, consumer="billing", limits=_LIMITS)
        big = _over()

        async def handler(tx: Any, payload: object) -> str:
            return big

        done = await inbox.handle_in_transaction("own", None, handler)
        assert done.outcome is Outcome.FAILED and isinstance(done.error, ResultTooLarge)
        await conn.begin()
        joined = await inbox.handle_in_transaction("joined", None, handler, tx=conn)
        assert joined.outcome is Outcome.FAILED and isinstance(joined.error, ResultTooLarge)
        await conn.commit()
        assert await store.get("billing", "own") is None
        assert await store.get("billing", "joined") is None
    finally:
        conn.close()
        await store.aclose()
