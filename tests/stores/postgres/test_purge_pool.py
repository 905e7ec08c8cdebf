"""The purge service on a store built on a caller's own psycopg pool (R13): its lead is a
session advisory lock held on one of the pool's connections for the whole run, so the run's
batches go on that same connection (with ``max_size=1`` a second one never comes, and the
claims would starve meanwhile); and a lead whose unlock fails is never handed back to the
pool still held, where the pool's next borrower would keep every other process from leading.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta

import pytest
from psycopg_pool import AsyncConnectionPool, ConnectionPool

import oncely
from oncely.stores.async_purging import AsyncPurgeService
from oncely.stores.postgres.sync_store import PostgresStore
from oncely.stores.sync_purging import PurgeService
from tests.services import POSTGRES_DSN
from tests.stores.postgres.helpers import _sql

EXPIRED = 30


def _pool(**kwargs: object) -> ConnectionPool:
    # The caller's pool, as a user builds it: autocommit off, a short wait for a connection.
    return ConnectionPool(POSTGRES_DSN, min_size=1, max_size=1, timeout=2, open=True,
                          kwargs=kwargs)  # fmt: skip


def _expire(store: PostgresStore) -> None:
    for i in range(EXPIRED):
        store.claim("c", f"k{i}", fingerprint=None, token=f"t{i}", lease_ms=60_000,
                    keep_ms=60_000, takeover=False)  # fmt: skip
        store.complete("c", f"k{i}", token=f"t{i}", result=None, keep_ms=1)
    time.sleep(0.01)


def test_r13_the_purge_runs_on_a_one_connection_pool_of_the_callers(table: str) -> None:
    pool = _pool()
    store = PostgresStore(pool, table=table)
    try:
        store.migrate()
        _expire(store)
        service = PurgeService(store, every=timedelta(minutes=1), batch_size=7, pause=0)
        run = service.run_once()
        assert run.leader and run.deleted == EXPIRED and run.batches >= 4
        # The lead was let go and the pool's connection is back: claims go on.
        assert store.claim("c", "after", fingerprint=None, token="a", lease_ms=60_000,
                           keep_ms=60_000, takeover=False).won  # fmt: skip
        assert PurgeService(store, every=timedelta(minutes=1)).run_once().leader
    finally:
        store.close()
        pool.close()


@pytest.fixture
def shadow() -> Iterator[str]:
    """A schema whose ``pg_advisory_unlock(bigint)``, found first on a search_path that
    names it before pg_catalog, fails: an unlock the server refuses, for real."""
    schema = f"oncely_shadow_{uuid.uuid4().hex[:10]}"
    _sql(f"CREATE SCHEMA {schema}")
    _sql(
        f"CREATE FUNCTION {schema}.pg_advisory_unlock(bigint) RETURNS boolean LANGUAGE plpgsql "
        "AS $$ BEGIN RAISE EXCEPTION 'unlock refused'; END $$"
    )
    try:
        yield schema
    finally:
        _sql(f"DROP SCHEMA {schema} CASCADE")


def test_r13_a_lead_whose_unlock_fails_is_not_returned_to_the_pool_held(
    table: str, shadow: str
) -> None:
    pool = _pool(options=f"-c search_path={shadow},pg_catalog")
    store = PostgresStore(pool, table=table)
    other = PostgresStore(POSTGRES_DSN, table=table)  # another process of the fleet
    try:
        store.migrate()
        _expire(store)
        # Saying the unlock failed would be fine; keeping the lead is not.
        with contextlib.suppress(oncely.StoreError):
            PurgeService(store, every=timedelta(minutes=1), pause=0).run_once()
        # Nobody holds the lead any more: the connection that held it was closed, not lent
        # out again with the lock on it.
        assert PurgeService(other, every=timedelta(minutes=1)).run_once().leader
        assert store.claim("c", "after", fingerprint=None, token="a", lease_ms=60_000,
                           keep_ms=60_000, takeover=False).won  # fmt: skip
    finally:
        store.close()
        other.close()
        pool.close()


async def test_r13_the_asyncio_purge_runs_on_a_one_connection_pool_of_the_callers(
    table: str,
) -> None:
    pool = AsyncConnectionPool(POSTGRES_DSN, min_size=1, max_size=1, timeout=2, open=False)
    await pool.open()
    store = oncely.AsyncPostgresStore(pool, table=table)
    try:
        await store.migrate()
        for i in range(EXPIRED):
            await store.claim("c", f"k{i}", fingerprint=None, token=f"t{i}", lease_ms=60_000,
                              keep_ms=60_000, takeover=False)  # fmt: skip
            await store.complete("c", f"k{i}", token=f"t{i}", result=None, keep_ms=1)
        await asyncio.sleep(0.01)
        service = AsyncPurgeService(store, every=timedelta(minutes=1), batch_size=7, pause=0)
        run = await service.run_once()
        assert run.leader and run.deleted == EXPIRED and run.batches >= 4
        assert (await AsyncPurgeService(store, every=timedelta(minutes=1)).run_once()).leader
    finally:
        await store.aclose()
        await pool.close()
