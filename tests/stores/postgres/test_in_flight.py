"""The snapshot trap (R8): a claim that waits for another transaction's uncommitted claim
sees how it ends, whether that transaction commits or rolls back.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest

import oncely
from oncely.stores import ClaimStatus
from oncely.stores.postgres.async_store import AsyncPostgresStore
from oncely.stores.postgres.dialect import PostgresDialect
from oncely.stores.postgres.sync_io import fetchall
from oncely.stores.postgres.sync_store import PostgresStore
from tests.services import POSTGRES_DSN
from tests.stores.postgres.helpers import KEEP_MS, LEASE_MS, _claim, _sql


class _Abort(Exception):
    pass


def _wait_for_lock_wait(table: str) -> None:
    """Return once some session waits on a lock in a statement on ``table`` (fail after 10 s:
    without the wait the test would prove nothing)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        rows = _sql(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
            "AND query LIKE %s",
            f"%{table}%",
        )
        if rows[0][0]:
            return
        time.sleep(0.01)
    raise AssertionError("the second claim never waited for the first one's transaction")


@pytest.mark.parametrize("first", ["commits", "rolls back"])
@pytest.mark.parametrize("second", ["claim", "claim_in"])
def test_r8_a_claim_waits_for_an_uncommitted_claim_and_sees_how_it_ends(
    store: PostgresStore, table: str, first: str, second: str
) -> None:
    """Connection A inserts the marker in an open transaction; connection B claims the same
    key from another thread and blocks on it. A commits: B answers EXISTING with A's record
    (the READ COMMITTED trap: B's first statement sees no row at all, so the store asks
    again). A rolls back: B's insert goes ahead (NEW)."""
    store.migrate()
    answers: dict[str, Any] = {}

    def claim_b() -> None:
        try:
            if second == "claim":
                answers["b"] = _claim(store, token="B")
            else:
                with store.transaction() as tx:
                    answers["b"] = store.claim_in(
                        tx, "c", "k", fingerprint="f", token="B", keep_ms=KEEP_MS, takeover=True
                    )
        except Exception as exc:
            answers["b"] = exc

    b = threading.Thread(target=claim_b)
    ending = pytest.raises(_Abort) if first == "rolls back" else _nothing()
    with ending, store.transaction() as a:
        won = store.claim_in(
            a, "c", "k", fingerprint="f", token="A", keep_ms=KEEP_MS, takeover=True
        )
        assert won.status is ClaimStatus.NEW
        b.start()
        _wait_for_lock_wait(table)
        if first == "rolls back":
            raise _Abort
    b.join(10)
    got = answers["b"]
    assert isinstance(got, oncely.stores.Claim), got
    record = store.get("c", "k")
    if first == "commits":
        assert got.status is ClaimStatus.EXISTING and got.record == won.record == record
    else:
        assert got.status is ClaimStatus.NEW and got.record.token == "B" and got.record == record


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def test_r8_the_trap_is_real_one_claim_statement_alone_returns_nothing(
    store: PostgresStore, table: str
) -> None:
    """Why the store looks again: the claim statement that waited for a concurrent insert
    which then committed returns no row (its snapshot predates the commit)."""
    store.migrate()
    dialect = PostgresDialect("public", table)
    params = {
        "now": None, "consumer": "c", "key": "k", "status": "in_progress", "fingerprint": None,
        "token": "B", "lease": LEASE_MS, "span": KEEP_MS, "error": None,
    }  # fmt: skip
    rows: list[Any] = []

    def claim_b() -> None:
        with psycopg.connect(POSTGRES_DSN, autocommit=True) as conn:
            rows.append(fetchall(conn, dialect.claim, params))

    b = threading.Thread(target=claim_b)
    with store.transaction() as a:
        store.claim_in(a, "c", "k", fingerprint=None, token="A", keep_ms=KEEP_MS, takeover=False)
        b.start()
        _wait_for_lock_wait(table)
    b.join(10)
    assert rows == [[]]
    assert _claim(store, token="B2").record.token == "A"  # the store's claim looks again


async def test_r8_async_claim_waits_for_an_uncommitted_claim(table: str) -> None:
    store = AsyncPostgresStore(POSTGRES_DSN, table=table, pool_max=4)
    await store.migrate()
    async with store.transaction() as a:
        won = await store.claim_in(
            a, "c", "k", fingerprint=None, token="A", keep_ms=KEEP_MS, takeover=False
        )
        pending = asyncio.ensure_future(_claim_async(store))
        await asyncio.to_thread(_wait_for_lock_wait, table)
    got = await asyncio.wait_for(pending, 10)
    assert got.status is ClaimStatus.EXISTING and got.record == won.record
    await store.aclose()


async def _claim_async(store: AsyncPostgresStore) -> oncely.stores.Claim:
    return await store.claim(
        "c", "k", fingerprint=None, token="B", lease_ms=LEASE_MS, keep_ms=KEEP_MS, takeover=True
    )
