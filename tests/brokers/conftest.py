"""Fixtures the broker end-to-end tests share: the ledger every broker's tests use, then each
broker's own (used by several of its ``test_<broker>_*.py`` modules)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from datetime import timedelta

import pytest
import redis
import redis.asyncio

import oncely
from tests.brokers.common import Ledger, drop_store_table, pg_store, require_postgres, unique
from tests.brokers.nats_helpers import World, delete_streams, drop_redis_prefix, need_services
from tests.brokers.rabbitmq_helpers import CONSUMER, Rabbit, _require_rabbitmq
from tests.services import NATS_URL, REDIS_URL, require


@pytest.fixture
def ledger() -> Iterator[Ledger]:
    """A fresh PostgreSQL ledger of effects, dropped after the test."""
    require_postgres()
    book = Ledger()
    book.create()
    yield book
    book.drop()


# ---------------------------------------------------------------------- RabbitMQ


@pytest.fixture
async def rabbit() -> AsyncIterator[Rabbit]:
    _require_rabbitmq()
    found = Rabbit(unique("rmq"))
    try:
        yield found
    finally:
        await found.delete()


@pytest.fixture
async def pg_inbox() -> AsyncIterator[oncely.AsyncInbox]:
    """Transactional mode: the marker and the ledger row commit together (R7)."""
    require_postgres()
    table = unique("inbox")
    inbox = oncely.AsyncInbox(pg_store(table), consumer=CONSUMER)
    try:
        yield inbox
    finally:
        await inbox.aclose()
        drop_store_table(table)
        drop_store_table(f"{table}_meta")


@pytest.fixture
async def redis_inbox() -> AsyncIterator[oncely.AsyncInbox]:
    """Two-phase mode on Redis with a short lease the heartbeat keeps renewing (R10)."""
    require("Redis", REDIS_URL, 6379)
    prefix = unique("rmq")
    store = oncely.AsyncRedisStore.from_url(f"{REDIS_URL}?prefix={prefix}")
    inbox = oncely.AsyncInbox(
        store, consumer=CONSUMER, lease=oncely.Lease(duration=timedelta(seconds=1))
    )
    try:
        yield inbox
    finally:
        await inbox.aclose()
        client = redis.asyncio.Redis.from_url(REDIS_URL)
        async with client:
            keys = [key async for key in client.scan_iter(match=f"{prefix}:*")]
            if keys:
                await client.delete(*keys)


# ---------------------------------------------------------------------- Redis Streams


@pytest.fixture
def admin() -> Iterator[redis.Redis]:
    require("Redis", REDIS_URL, 6379)
    client = redis.Redis.from_url(REDIS_URL)
    yield client
    client.close()


@pytest.fixture
def stream(admin: redis.Redis) -> Iterator[str]:
    name = unique("rs")
    yield name
    admin.delete(name, f"{name}.dead")


@pytest.fixture
async def pg() -> AsyncIterator[oncely.AsyncPostgresStore]:
    require_postgres()
    table = unique("inbox")
    store = pg_store(table)
    yield store
    await store.aclose()
    drop_store_table(table)


@pytest.fixture
async def rstore(admin: redis.Redis) -> AsyncIterator[oncely.AsyncRedisStore]:
    prefix = unique("rsinbox")
    store = oncely.AsyncRedisStore.from_url(f"{REDIS_URL}?prefix={prefix}")
    yield store
    await store.aclose()
    keys = list(admin.scan_iter(match=f"{prefix}*", count=500))
    if keys:
        admin.delete(*keys)


# ---------------------------------------------------------------------- NATS JetStream


@pytest.fixture
async def world() -> AsyncIterator[World]:
    need_services()
    w = World(NATS_URL, unique("oncely_nats"))
    w.ledger.create()
    try:
        yield w
    finally:
        for closer in w.closers:
            await closer.close()
        for inbox in w.inboxes:
            await inbox.aclose()
        await delete_streams(w.url, w.base)
        w.ledger.drop()
        for table in w.tables:
            drop_store_table(table)
        for prefix in w.prefixes:
            await drop_redis_prefix(prefix)
