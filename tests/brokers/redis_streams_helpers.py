"""What the Redis Streams end-to-end tests (``test_redis_streams_*.py``) share: fast
consumer settings, a transport, consumer and producer with the tests' group, and the group's
state read back (pending, lag, dead letters). Their fixtures (``admin``, ``stream``, ``pg``,
``rstore``) are in ``conftest.py``.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from datetime import timedelta
from typing import Any

import redis

import oncely
from oncely.brokers import Backoff, BrokerConsumer, ConsumerSettings
from oncely.brokers.redis_streams import RedisStreams, RedisStreamsProducer
from tests.services import REDIS_URL

GROUP = "billing"
MS = timedelta(milliseconds=1)

FAST = ConsumerSettings(
    concurrency=4,
    requeue_delay=100 * MS,
    backoff=Backoff(first=50 * MS, factor=1, most=50 * MS),
    poll=200 * MS,
    reconnect=Backoff(first=50 * MS, most=500 * MS),
    shutdown_grace=timedelta(seconds=10),
)


def settings(**changes: Any) -> ConsumerSettings:
    return dataclasses.replace(FAST, **changes)


def transport(stream: str, url: str = REDIS_URL, **options: Any) -> RedisStreams:
    options.setdefault("claim_every", 100 * MS)
    return RedisStreams(url, stream, group=GROUP, **options)


def consumer(
    stream: str,
    store: oncely.AsyncStore,
    handler: Any,
    *,
    mode: str,
    url: str = REDIS_URL,
    consumer_settings: ConsumerSettings = FAST,
    **options: Any,
) -> BrokerConsumer:
    inbox = oncely.AsyncInbox(store, consumer="billing")
    return BrokerConsumer(
        transport(stream, url, **options),
        inbox,
        handler,
        mode=mode,  # type: ignore[arg-type]
        settings=consumer_settings,
    )


async def publish(
    stream: str,
    key: str,
    body: object,
    *,
    times: int = 1,
    url: str = REDIS_URL,
    **options: Any,
) -> None:
    producer = RedisStreamsProducer(url, stream)
    raw = body if isinstance(body, bytes) else oncely_json(body)
    try:
        for _ in range(times):
            await producer.publish(raw, message_id=key, **options)
    finally:
        await producer.close()


def oncely_json(body: object) -> bytes:
    return json.dumps(body).encode()


def group_state(admin: redis.Redis, stream: str) -> tuple[int, int | None] | None:
    """(pending entries, entries not yet delivered to the group); None before the group."""
    if not admin.exists(stream):
        return None
    for info in admin.xinfo_groups(stream):
        if info["name"] == GROUP.encode():
            return int(info["pending"]), info["lag"]
    return None


def settled(admin: redis.Redis, stream: str) -> bool:
    return group_state(admin, stream) == (0, 0)


def assert_settled(admin: redis.Redis, stream: str) -> None:
    """Nothing pending, nothing unread: every entry of the stream was delivered and acked."""
    assert admin.xpending(stream, GROUP)["pending"] == 0
    assert group_state(admin, stream) == (0, 0)


def dead_letters(admin: redis.Redis, stream: str) -> list[dict[str, str]]:
    return [
        {k.decode(): v.decode("utf-8", "replace") for k, v in fields.items()}
        for _id, fields in admin.xrange(f"{stream}.dead")
    ]


def total(*consumers: BrokerConsumer) -> Counter[str]:
    counts: Counter[str] = Counter()
    for each in consumers:
        counts.update(each.counts)
    return counts


def consumers_in_group(admin: redis.Redis, stream: str) -> int:
    if group_state(admin, stream) is None:
        return 0
    return len(admin.xinfo_consumers(stream, GROUP))


async def _fetch_into(reader: RedisStreams, into: list[Any]) -> bool:
    into.extend(await reader.fetch(4, 50 * MS))
    return bool(into)
