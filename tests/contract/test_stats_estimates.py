"""``stats(exact=False)``: every store's estimates are close to the exact counts (R13).

On every store (real servers, no mocks), a few thousand records of three consumers, their
expiries spread over 300 minutes, with a share completed or failed and 1,200 expired: after
``ANALYZE`` where the database needs it, the estimates of each consumer's live records, of the
live total and of the expired records are within a tolerance of what ``stats()`` counts, and
what an estimate counted outright (a small consumer; on SQLite the expired and the total) it
says it counted. The
tolerances are those of each method: PostgreSQL's planner has seen every row (ANALYZE samples
all of a small table); SQLite counts its rows exactly and samples minutes of its purge index
for the split; MariaDB's ``TABLE_ROWS`` is InnoDB's estimate; Redis samples 2,000 random keys
and DynamoDB reads one segment of its ``Scan`` (a share of the table by a hash of each
partition key), four standard errors of the sample each. No wall-clock time is asserted. A
PostgreSQL table that was never analyzed is sampled and says so; a store without estimates
(memory) answers exactly.
"""

from __future__ import annotations

import inspect
import math
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

import oncely
from oncely import FakeClock, Status
from oncely.stores import ClaimRequest
from tests.backends import Backend, Scope
from tests.backends.postgres import table_name
from tests.services import POSTGRES_DSN

HOUR = 3_600_000
MINUTES = 300
PER_MINUTE = {"big": 10, "mid": 5}  # 3,000 and 1,500 records
SMALL = 20  # the "few" consumer: fewer than the estimates count outright
EXPIRED = 1200  # of "big" and "mid", expired by the time stats are read


def _load(store: oncely.Store, clock: FakeClock) -> None:
    for minute in range(MINUTES):
        for consumer, n in PER_MINUTE.items():
            requests = [
                ClaimRequest(f"{consumer}-{minute}-{i}", None, f"t-{consumer}-{minute}-{i}")
                for i in range(n)
            ]
            store.claim_many(
                consumer, requests, lease_ms=60_000, keep_ms=HOUR + minute * 60_000,
                takeover=False,
            )  # fmt: skip
    few = [ClaimRequest(f"few-{i}", None, f"t-few-{i}") for i in range(SMALL)]
    store.claim_many("few", few, lease_ms=60_000, keep_ms=HOUR, takeover=False)
    # Expired in each larger consumer in proportion to its records: PostgreSQL's planner
    # assumes as much (it knows each column's distribution, not the pair's).
    for start in range(0, EXPIRED, 400):
        gone = [ClaimRequest(f"gone-{i}", None, f"t-gone-{i}") for i in range(start, start + 400)]
        consumer = "big" if start < EXPIRED * 2 // 3 else "mid"
        store.claim_many(consumer, gone, lease_ms=1000, keep_ms=1000, takeover=False)
    for i in range(150):
        key = f"mid-{i}-0"
        store.complete("mid", key, token=f"t-{key}", result=b"r", keep_ms=2 * HOUR)
    for i in range(150, 200):
        key = f"mid-{i}-0"
        store.fail("mid", key, token=f"t-{key}", error="poison", keep_ms=2 * HOUR)
    clock.advance(timedelta(minutes=3))  # the short ones are in minutes that ended


def _analyze(backend: Backend, store: Any) -> None:
    if backend.name == "postgres":
        with psycopg.connect(POSTGRES_DSN, autocommit=True) as conn:
            conn.execute(f'ANALYZE "{store.table.split(".")[1]}"')
    elif backend.name == "mysql":
        from tests.backends.mysql import sql

        sql(f"ANALYZE TABLE `{store.table}`")


def _redis_size(store: Any) -> int:
    """DBSIZE, as the store scales by it (on a cluster: its primaries' added up)."""
    client: Any = store._client
    if hasattr(client, "get_primaries"):
        return sum(int(client.dbsize(target_nodes=n)) for n in client.get_primaries())
    return int(client.dbsize())


def _sampled(backend: Backend) -> bool:
    """Whether the store's estimate is a sample (which counts nothing outright)."""
    return backend.name.startswith("redis") or backend.name == "dynamodb"


def _tolerance(backend: Backend, store: Any, exact: int) -> float:
    """How far an estimate of ``exact`` may be from it on this store."""
    if backend.name == "dynamodb":
        from tests.backends.dynamodb import client

        dynamodb = client()
        try:
            size = dynamodb.describe_table(TableName=store.table)["Table"]["ItemCount"]
        finally:
            dynamodb.close()
        # One of ``segments`` segments read, scaled by ``segments``: each record is in it
        # with probability 1 / segments.
        segments = max(1, math.ceil(size / 4000))
        return 4 * math.sqrt(exact * (segments - 1)) + 2
    if backend.name.startswith("redis"):
        size = max(_redis_size(store), 1)
        p = min(exact / size, 1.0)
        return 4 * size * math.sqrt(p * (1 - p) / 2000) + 2
    relative = {"postgres": 0.10, "sqlite": 0.10, "mysql": 0.25}.get(backend.name, 0.0)
    return relative * exact + 2


def _estimating(backend: Backend, store: Any) -> None:
    if "exact" not in inspect.signature(store.stats).parameters:
        pytest.skip(f"the {backend.name} store predates stats(exact=...)")


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(datetime(2030, 1, 1, tzinfo=UTC))


def test_r13_estimates_are_close_to_the_exact_counts(
    backend: Backend, scope: Scope, clock: FakeClock
) -> None:
    store: Any = backend.make_sync(scope, clock)
    _estimating(backend, store)
    try:
        store.migrate()
        _load(store, clock)
        _analyze(backend, store)
        exact = store.stats()
        estimate = store.stats(exact=False)
    finally:
        store.close()
    assert exact.exact
    assert exact.per_consumer == {"big": 3000, "mid": 1500, "few": SMALL}
    assert exact.expired == EXPIRED
    if backend.name == "memory":
        assert estimate.exact and estimate == exact  # counting is cheap there
        return
    assert not estimate.exact, backend.name
    found = estimate.per_consumer
    assert set(found) == {"big", "mid", "few"} or backend.name.startswith("redis")
    for consumer, n in exact.per_consumer.items():
        if backend.name.startswith("redis") and consumer == "few":
            continue  # 20 of thousands: a sample of 2,000 may well miss them
        got = found.get(consumer, 0)
        assert abs(got - n) <= _tolerance(backend, store, n), (consumer, got, n, estimate)
    assert abs(estimate.total - exact.total) <= _tolerance(backend, store, exact.total)
    assert abs(estimate.expired - EXPIRED) <= _tolerance(backend, store, EXPIRED), estimate
    if not _sampled(backend):
        assert found["few"] == SMALL  # a small consumer is counted outright, and says so
        assert estimate.counted == {"few"}
        # SQLite counts its rows and its 1,200 expired: the live total is exact too.
        assert estimate.counted_expired is (backend.name == "sqlite")
        assert estimate.counted_total is (backend.name == "sqlite")
        if backend.name == "sqlite":
            assert (estimate.total, estimate.expired) == (exact.total, EXPIRED)
    else:  # a sample counts nothing outright
        assert not (estimate.counted or estimate.counted_total or estimate.counted_expired)
    statuses = estimate.per_status
    if statuses is not None:  # PostgreSQL's column statistics, Redis's sample
        assert sum(statuses.values()) == pytest.approx(estimate.total, abs=3)
        done = exact.per_status
        assert done is not None
        for status in Status:
            slack = _tolerance(backend, store, done[status]) + 0.02 * exact.total
            assert abs(statuses[status] - done[status]) <= slack, (status, statuses, done)


def test_r13_estimates_of_an_empty_store(backend: Backend, scope: Scope) -> None:
    store: Any = backend.make_sync(scope, None)
    _estimating(backend, store)
    try:
        store.migrate()
        estimate = store.stats(exact=False)
    finally:
        store.close()
    assert estimate.total == 0 and estimate.expired == 0 and estimate.per_consumer == {}


def test_r13_a_small_purged_table_is_estimated_exactly(
    backend: Backend, scope: Scope, clock: FakeClock
) -> None:
    # Few records, nothing left to purge: every consumer and the expired are counted
    # outright (Redis counts a database this small exactly too).
    store: Any = backend.make_sync(scope, clock)
    _estimating(backend, store)
    try:
        store.migrate()
        for consumer, n in (("a", 7), ("b", 3)):
            requests = [ClaimRequest(f"k{i}", None, f"t{i}") for i in range(n)]
            store.claim_many(consumer, requests, lease_ms=1000, keep_ms=HOUR, takeover=False)
        old = [ClaimRequest(f"old{i}", None, f"o{i}") for i in range(4)]
        store.claim_many("a", old, lease_ms=1000, keep_ms=1000, takeover=False)
        clock.advance(timedelta(minutes=2))
        estimate = store.stats(exact=False)
        assert estimate.per_consumer == {"a": 7, "b": 3}
        assert estimate.expired == 4
        # Counted, not estimated: every number is exact, and the stats say so.
        assert estimate.exact or (
            estimate.counted == {"a", "b"} and estimate.counted_total and estimate.counted_expired
        )
        store.purge_expired()
        assert store.stats(exact=False).expired == 0
    finally:
        store.close()


# ---------------------------------------------------------- PostgreSQL, never analyzed


def test_r13_a_never_analyzed_postgres_table_is_sampled(scope: Scope, clock: FakeClock) -> None:
    from tests.backends import BACKENDS

    backend = BACKENDS["postgres"]
    backend.require()
    store: Any = backend.make_sync(scope, clock)
    try:
        store.migrate()
        table = table_name(scope)
        with psycopg.connect(POSTGRES_DSN, autocommit=True) as conn:
            # Autovacuum would analyze the table at its next visit: not this one.
            conn.execute(f'ALTER TABLE "{table}" SET (autovacuum_enabled = false)')
        _load(store, clock)
        with psycopg.connect(POSTGRES_DSN, autocommit=True) as conn:
            row = conn.execute(
                "SELECT reltuples, (SELECT count(*) FROM pg_stats WHERE tablename = %s) "
                "FROM pg_class WHERE relname = %s",
                (table, table),
            ).fetchone()
        assert row is not None and row[1] == 0  # no column statistics: never analyzed
        exact = store.stats()
        estimate = store.stats(exact=False)
    finally:
        store.close()
    assert not estimate.exact
    assert "never analyzed" in estimate.note and "rough" in estimate.note
    for consumer, n in exact.per_consumer.items():
        # A small table is sampled whole (its pages are fewer than the sample's).
        assert abs(estimate.per_consumer.get(consumer, 0) - n) <= 0.25 * n + 2, estimate
    assert abs(estimate.expired - EXPIRED) <= 0.25 * EXPIRED, estimate
    assert estimate.per_status is not None


def test_r13_async_estimates(backend: Backend, scope: Scope, clock: FakeClock) -> None:
    import asyncio

    async def run() -> None:
        store: Any = backend.make_async(scope, clock)
        try:
            if "exact" not in inspect.signature(store.stats).parameters:
                pytest.skip(f"the {backend.name} store predates stats(exact=...)")
            await store.migrate()
            requests = [ClaimRequest(f"k{i}", None, f"t{i}") for i in range(5)]
            await store.claim_many("a", requests, lease_ms=1000, keep_ms=HOUR, takeover=False)
            estimate = await store.stats(exact=False)
            assert estimate.per_consumer == {"a": 5} and estimate.expired == 0
            assert (await store.stats()).exact
        finally:
            await store.aclose()

    asyncio.run(run())


def test_r13_a_large_consumer_whose_records_all_expired_is_estimated_at_none(
    backend: Backend, scope: Scope, clock: FakeClock
) -> None:
    # More records than are counted outright, every one expired (a consumer retired, or a
    # quiet week): the estimate is no live record, not the one PostgreSQL's planner gives
    # as its least estimate.
    store: Any = backend.make_sync(scope, clock)
    _estimating(backend, store)
    try:
        store.migrate()
        for start in range(0, 1500, 500):
            old = [ClaimRequest(f"old{i}", None, f"o{i}") for i in range(start, start + 500)]
            store.claim_many("gone", old, lease_ms=1000, keep_ms=1000, takeover=False)
        clock.advance(timedelta(minutes=3))
        _analyze(backend, store)
        estimate = store.stats(exact=False)
    finally:
        store.close()
    assert estimate.per_consumer == {} and estimate.total == 0, estimate
    assert abs(estimate.expired - 1500) <= _tolerance(backend, store, 1500), estimate
