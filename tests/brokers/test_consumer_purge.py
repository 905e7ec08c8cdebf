"""A consumer can run the purge service beside its loop (R13): expired records go while it
consumes, and the service stops with the consumer."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from pathlib import Path

import pytest

import oncely
from oncely.brokers import BrokerConsumer, ConsumerSettings
from oncely.errors import ConfigurationError
from oncely.testing import MemoryBroker


async def test_r13_a_consumer_with_purge_every_purges_while_it_consumes(tmp_path: Path) -> None:
    store = oncely.AsyncSQLiteStore(tmp_path / "inbox.db")
    for i in range(25):
        await store.claim("orders", f"old-{i}", fingerprint=None, token=f"t{i}",
                          lease_ms=60_000, keep_ms=60_000, takeover=False)  # fmt: skip
        await store.complete("orders", f"old-{i}", token=f"t{i}", result=None, keep_ms=1)
    await asyncio.sleep(0.01)
    assert (await store.stats()).expired == 25
    inbox = oncely.AsyncInbox(store, consumer="orders")
    broker = MemoryBroker()
    broker.publish(b'{"n": 1}', message_id="new-1")

    async def handler(payload: object) -> None:
        return None

    settings = ConsumerSettings(purge_every=timedelta(milliseconds=50))
    consumer = BrokerConsumer(broker, inbox, handler, settings=settings)
    task = asyncio.create_task(consumer.run())
    try:
        for _ in range(200):
            if (await store.stats()).expired == 0 and broker.acked == 1:
                break
            await asyncio.sleep(0.05)
        assert (await store.stats()).expired == 0
        assert await store.get("orders", "new-1") is not None
    finally:
        consumer.stop()
        await asyncio.wait_for(task, 10)  # the purge service stopped with it
    await store.aclose()


def test_purge_every_must_be_positive() -> None:
    with pytest.raises(ConfigurationError, match="purge_every"):
        ConsumerSettings(purge_every=timedelta(0))
