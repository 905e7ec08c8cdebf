"""What the NATS JetStream end-to-end tests (``test_nats_*.py``) share: fast consumer
settings, the durable consumer's state and a stream's messages read back, and ``World``, one
test's names, stores and clean-up. Its fixture (``world``) is in ``conftest.py``.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import nats
import nats.js.errors
import redis.asyncio as aioredis

import oncely
from oncely.brokers import Backoff, ConsumerSettings
from oncely.brokers.nats import JetStream, JetStreamProducer
from tests.brokers.common import Ledger, pg_store, require_postgres, unique
from tests.services import NATS_URL, REDIS_URL, require

FAST = Backoff(first=timedelta(milliseconds=50), most=timedelta(milliseconds=200))


def settings(**overrides: Any) -> ConsumerSettings:
    """Short delays so the scenarios run in seconds (never asserted as times)."""
    base: dict[str, Any] = {
        "concurrency": 4,
        "requeue_delay": timedelta(milliseconds=200),
        "backoff": FAST,
        "poll": timedelta(milliseconds=300),
        "reconnect": Backoff(first=timedelta(milliseconds=100), most=timedelta(milliseconds=500)),
        "shutdown_grace": timedelta(seconds=10),
    }
    base.update(overrides)
    return ConsumerSettings(**base)


def body(key: str, **fields: object) -> bytes:
    return json.dumps({"id": key, **fields}).encode()


async def consumer_state(url: str, stream: str, group: str) -> tuple[int, int]:
    """``(num_ack_pending, num_pending)`` of the durable consumer, as the server holds them."""
    nc = await nats.connect(url)
    try:
        info = await nc.jetstream().consumer_info(stream, group)
        return info.num_ack_pending, info.num_pending
    finally:
        await nc.close()


async def settled(url: str, stream: str, group: str) -> bool:
    try:
        return await consumer_state(url, stream, group) == (0, 0)
    except nats.js.errors.NotFoundError:
        return False  # not declared yet


async def read_stream(url: str, stream: str) -> list[tuple[dict[str, str], bytes]]:
    """Every message stored in ``stream``: its headers and body."""
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        info = await js.stream_info(stream)
        found = []
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            with contextlib.suppress(nats.js.errors.NotFoundError):
                msg = await js.get_msg(stream, seq)
                found.append((dict(msg.headers or {}), msg.data or b""))
        return found
    finally:
        await nc.close()


async def delete_streams(url: str, prefix: str) -> None:
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        for info in await js.streams_info():
            if info.config.name and info.config.name.startswith(prefix):
                await js.delete_stream(info.config.name)
    finally:
        await nc.close()


async def drop_redis_prefix(prefix: str) -> None:
    client = aioredis.from_url(REDIS_URL)
    try:
        async for name in client.scan_iter(match=f"{prefix}:*"):
            await client.unlink(name)
    finally:
        await client.aclose()


@dataclass
class World:
    """One test's names (subject, group, stores) and what to clean up after it."""

    url: str
    base: str
    ledger: Ledger = field(default_factory=Ledger)
    tables: list[str] = field(default_factory=list)
    prefixes: list[str] = field(default_factory=list)
    inboxes: list[oncely.AsyncInbox] = field(default_factory=list)
    closers: list[Any] = field(default_factory=list)

    @property
    def subject(self) -> str:
        return f"{self.base}.orders"

    @property
    def stream(self) -> str:
        return f"{self.base}_orders"

    @property
    def dead_stream(self) -> str:
        return f"{self.base}_orders_dead"

    group = "billing"

    def transport(self, **options: Any) -> JetStream:
        options.setdefault("ack_wait", timedelta(seconds=5))
        return JetStream(self.url, self.subject, group=self.group, **options)

    def producer(self, **options: Any) -> JetStreamProducer:
        producer = JetStreamProducer(self.url, self.subject, **options)
        self.closers.append(producer)
        return producer

    def pg_inbox(self) -> oncely.AsyncInbox:
        """Transactional mode: the ledger row shares the marker's transaction."""
        table = unique("inbox_nats")
        self.tables.append(table)
        inbox = oncely.AsyncInbox(pg_store(table), consumer=self.group)
        self.inboxes.append(inbox)
        return inbox

    def redis_inbox(self) -> oncely.AsyncInbox:
        """Two-phase mode on Redis (a claim, the handler, a completion)."""
        prefix = unique("oncely_nats")
        self.prefixes.append(prefix)
        inbox = oncely.AsyncInbox(
            oncely.AsyncRedisStore.from_url(f"{REDIS_URL}?prefix={prefix}"), consumer=self.group
        )
        self.inboxes.append(inbox)
        return inbox

    async def in_tx(self, tx: Any, payload: dict[str, Any]) -> None:
        await self.ledger.apply_in(tx, payload["id"], payload)

    async def apply(self, payload: dict[str, Any]) -> None:
        await self.ledger.apply(payload["id"], payload)

    async def settled(self) -> bool:
        return await settled(self.url, self.stream, self.group)

    def has(self, n: int) -> Callable[[], bool]:
        return lambda: len(self.ledger.counts()) >= n


def need_services() -> None:
    require("NATS", NATS_URL, 4222)
    require("Redis", REDIS_URL, 6379)
    require_postgres()
