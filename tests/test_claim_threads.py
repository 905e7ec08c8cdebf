"""The manual claim (``Inbox.claim``) under real concurrency: threads racing for one key on
PostgreSQL, Redis and SQLite: exactly one wins, the others
are ``in_flight`` while it works and ``duplicate`` (with its result) after (R8, R10)."""

from __future__ import annotations

import threading
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
import redis

import oncely
from tests.services import POSTGRES_DSN, REDIS_URL, require

THREADS = 8


def _postgres(tmp_path: Path) -> Iterator[oncely.Store]:
    require("PostgreSQL", POSTGRES_DSN, 5432)
    table = f"claim_{uuid.uuid4().hex[:10]}"
    store = oncely.PostgresStore(POSTGRES_DSN, table=table, pool_max=THREADS)
    yield store
    store.close()
    with psycopg.connect(POSTGRES_DSN, autocommit=True) as conn:
        conn.execute(f'DROP TABLE IF EXISTS "{table}", "{table}_meta"')


def _redis(tmp_path: Path) -> Iterator[oncely.Store]:
    require("Redis", REDIS_URL, 6379)
    prefix = f"claim{uuid.uuid4().hex[:10]}"
    store = oncely.RedisStore.from_url(f"{REDIS_URL}?prefix={prefix}")
    yield store
    store.close()
    client = redis.Redis.from_url(REDIS_URL)
    for name in client.scan_iter(match=f"{prefix}*"):
        client.delete(name)
    client.close()


def _sqlite(tmp_path: Path) -> Iterator[oncely.Store]:
    store = oncely.SQLiteStore(tmp_path / "inbox.db")
    yield store
    store.close()


@pytest.fixture(params=[_postgres, _redis, _sqlite], ids=["postgres", "redis", "sqlite"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[oncely.Store]:
    make: Callable[[Path], Iterator[oncely.Store]] = request.param
    yield from make(tmp_path)


def test_r8_r10_threads_racing_for_one_key_one_wins_the_rest_wait_then_see_its_result(
    store: oncely.Store,
) -> None:
    inbox = oncely.Inbox(store, consumer="payments")
    start = threading.Barrier(THREADS)
    outcomes: list[str] = []
    winners: list[oncely.Claimed[object]] = []
    lock = threading.Lock()

    def race() -> None:
        start.wait()
        claimed = inbox.claim("charge-7", {"amount": 70})
        with lock:
            if claimed.won:
                winners.append(claimed)
            else:
                assert claimed.handled is not None
                outcomes.append(claimed.handled.outcome.value)

    threads = [threading.Thread(target=race) for _ in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(winners) == 1
    assert outcomes == ["in_flight"] * (THREADS - 1)
    done = winners[0].complete({"charged": 70})
    assert done.outcome is oncely.Outcome.PROCESSED

    seen: Counter[str] = Counter()
    values: list[object] = []

    def after() -> None:
        claimed = inbox.claim("charge-7", {"amount": 70})
        assert not claimed.won and claimed.handled is not None
        with lock:
            seen[claimed.handled.outcome.value] += 1
            values.append(claimed.handled.value)

    threads = [threading.Thread(target=after) for _ in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert seen == {"duplicate": THREADS}
    assert values == [{"charged": 70}] * THREADS
    inbox.close()
