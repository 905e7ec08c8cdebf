"""Redis Streams end to end, against a real Redis: every scenario ends with each logical
message's effect applied exactly once (a ledger row per effect, no unique constraint), nothing
lost, and nothing pending in the consumer group (XPENDING 0, lag 0).

Transactional mode runs on PostgreSQL (the effect and the marker in one transaction, R7);
two-phase mode on Redis (a claim, the handler, a completion, R10).

Here the basics: URL options, the entry layout, producer retries, conflicts and poison
dead-lettered with their reasons, a CloudEvents key across producer message ids.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any

import pytest
import redis

import oncely
from oncely.brokers import BrokerConsumer, cloudevent_headers, open_producer, open_transport
from oncely.brokers.redis_streams import RedisStreams, RedisStreamsProducer
from tests.brokers.common import Ledger, running, wait_until
from tests.brokers.redis_streams_helpers import (
    FAST,
    GROUP,
    assert_settled,
    consumer,
    consumers_in_group,
    dead_letters,
    group_state,
    publish,
    settled,
    transport,
)
from tests.services import REDIS_URL

# ---------------------------------------------------------------------- the transport itself


def test_registry_urls_and_options() -> None:
    url = "redis://127.0.0.1:6379/0?ack_wait=2&consumer=c-1&delivery_limit=9&start=new"
    opened = open_transport(url, "orders", group=GROUP)
    assert isinstance(opened, RedisStreams)
    assert opened.ack_wait == timedelta(seconds=2)
    assert opened.extend_every == timedelta(seconds=2) / 3
    assert (opened.consumer, opened.delivery_limit) == ("c-1", 9)
    assert opened.dead_letter_stream == "orders.dead"
    keyword = open_transport(url, "orders", group=GROUP, ack_wait=timedelta(seconds=5))
    assert keyword.ack_wait == timedelta(seconds=5)  # type: ignore[attr-defined]
    first = RedisStreams(REDIS_URL, "orders", group=GROUP)
    assert first.consumer != RedisStreams(REDIS_URL, "orders", group=GROUP).consumer
    assert first.consumer.startswith(f"{socket.gethostname()}-{os.getpid()}-")
    with pytest.raises(oncely.ConfigurationError, match=r"'prefetch'.*known: consumer, ack_wait"):
        open_transport("redis://127.0.0.1/0?prefetch=3", "orders", group=GROUP)
    with pytest.raises(oncely.ConfigurationError, match="R4"):
        RedisStreams(REDIS_URL, "orders", group=GROUP, message_id_field="entry_id")
    with pytest.raises(oncely.ConfigurationError, match="dead-letter"):
        RedisStreams(REDIS_URL, "orders", group=GROUP, dead_letter="orders")
    assert isinstance(
        open_producer("redis://127.0.0.1:6379/0?maxlen=100", "orders"), RedisStreamsProducer
    )
    with pytest.raises(oncely.ConfigurationError, match="known: maxlen"):
        open_producer("redis://127.0.0.1:6379/0?ack_wait=1", "orders")
    assert first.prune_idle_consumers == timedelta(hours=1)
    never = open_transport(f"{REDIS_URL}?prune_idle_consumers=0", "orders", group=GROUP)
    assert never.prune_idle_consumers is None  # type: ignore[attr-defined]
    with pytest.raises(oncely.ConfigurationError, match="prune_idle_consumers"):
        RedisStreams(REDIS_URL, "orders", group=GROUP, prune_idle_consumers=timedelta(0))


async def test_entry_layout_keys_never_come_from_the_entry_id(
    admin: redis.Redis, stream: str
) -> None:
    producer = RedisStreamsProducer(REDIS_URL, stream)
    with pytest.raises(oncely.ConfigurationError, match="collides"):
        await producer.publish(b"{}", message_id="m", headers={"body": "x"})
    ce = cloudevent_headers(source="/orders", event_type="order.paid", event_id="e-1")
    await producer.publish(
        b'{"n": 1}', message_id="m-1", headers={**ce, "tenant": "t1"}, correlation_id="c-9"
    )
    await producer.publish(b'{"n": 1}', message_id="m-1", headers={**ce, "tenant": "t1"})
    await producer.close()
    reader = transport(stream)
    await reader.open(8)
    try:
        first, second = await reader.fetch(8, timedelta(seconds=1))
        for delivery in (first, second):
            env = delivery.envelope
            assert env.body == b'{"n": 1}'
            assert env.message_id == "m-1"
            assert env.headers == {**ce, "tenant": "t1"}
            assert env.delivery_count == delivery.delivery_count == 1
            assert env.transport["content_type"] == "application/json"
            assert env.transport["redelivered"] is False
            assert oncely.MessageIdKey()(env) == "m-1"
            assert oncely.CloudEventsKey()(env) == "/orders e-1"
            assert oncely.HeaderKey("tenant")(env) == "t1"
        # A producer retry is a new entry with a new id; the id is in the transport fields only.
        assert first.envelope.transport["entry_id"] != second.envelope.transport["entry_id"]
        assert first.envelope.correlation_id == "c-9"
        assert second.envelope.correlation_id is None
        assert group_state(admin, stream) == (2, 0)
        await first.ack()
        await second.ack()
    finally:
        await reader.close()
    assert_settled(admin, stream)
    assert consumers_in_group(admin, stream) == 0  # close left the group: it held nothing


# ---------------------------------------------------------------------- required scenarios


async def test_a_producer_retries_have_one_effect(
    admin: redis.Redis, stream: str, ledger: Ledger, pg: oncely.AsyncPostgresStore
) -> None:
    keys = [f"order-{i}" for i in range(5)]
    for key in keys:
        await publish(stream, key, {"k": key}, times=3)

    async def handler(tx: Any, payload: dict[str, str]) -> None:
        await ledger.apply_in(tx, payload["k"], payload)

    worker = consumer(stream, pg, handler, mode="transactional")
    async with running(worker):
        await wait_until(lambda: settled(admin, stream), what="every entry acked")
    assert ledger.counts() == dict.fromkeys(keys, 1)
    assert worker.counts["processed"] == 5
    assert worker.counts["duplicate"] == 10
    assert_settled(admin, stream)


async def test_d_conflicts_and_poison_are_dead_lettered_with_reasons(
    admin: redis.Redis, stream: str, ledger: Ledger, pg: oncely.AsyncPostgresStore
) -> None:
    async def handler(tx: Any, payload: dict[str, Any]) -> None:
        if payload.get("poison"):
            raise oncely.Reject("poison pill: no such account")
        await ledger.apply_in(tx, payload["k"], payload)

    worker = consumer(stream, pg, handler, mode="transactional")
    async with running(worker):
        await publish(stream, "pay-1", {"k": "pay-1", "amount": 10})
        await wait_until(lambda: ledger.counts() == {"pay-1": 1}, what="the first payment")
        await publish(stream, "pay-1", {"k": "pay-1", "amount": 99})  # same id, other body
        await publish(stream, "bad-1", {"k": "bad-1", "poison": True}, headers={"tenant": "t1"})
        await publish(stream, "garbled-1", b"{not json")
        admin.xadd(stream, {"body": b'{"k": "anon"}', "content_type": "application/json"})
        await wait_until(
            lambda: admin.xlen(f"{stream}.dead") == 4 and settled(admin, stream),
            what="four dead letters",
        )
    copies = dead_letters(admin, stream)
    by_id = {copy.get("message_id", "<none>"): copy for copy in copies}
    assert set(by_id) == {"pay-1", "bad-1", "garbled-1", "<none>"}
    for copy in copies:
        assert copy["x-oncely-consumer"] == "billing"
        assert copy["x-oncely-deliveries"] == "1"
        assert copy["content_type"] == "application/json"
    conflict = by_id["pay-1"]
    assert conflict["x-oncely-outcome"] == "key_conflict"
    assert '"amount": 99' in conflict["body"]
    poison = by_id["bad-1"]
    assert poison["x-oncely-outcome"] == "rejected"
    assert "poison pill" in poison["x-oncely-reason"]
    assert poison["tenant"] == "t1"
    garbled = by_id["garbled-1"]
    assert garbled["x-oncely-outcome"] == "rejected"
    assert "undecodable body" in garbled["x-oncely-reason"]
    assert garbled["body"] == "{not json"
    anonymous = by_id["<none>"]
    assert anonymous["x-oncely-outcome"] == "rejected"
    assert "message id" in anonymous["x-oncely-reason"]
    assert ledger.counts() == {"pay-1": 1}
    assert worker.counts["key_conflict"] == 1
    assert worker.counts["rejected"] == 3
    assert_settled(admin, stream)


async def test_cloudevents_key_across_producer_message_ids(
    admin: redis.Redis, stream: str, ledger: Ledger, rstore: oncely.AsyncRedisStore
) -> None:
    ce = cloudevent_headers(source="/shop/orders", event_type="order.paid", event_id="ev-7")
    for attempt in range(3):  # a producer that makes a new message id per attempt
        await publish(stream, f"attempt-{attempt}", {"k": "ev-7"}, headers=ce)

    async def handler(payload: dict[str, str]) -> None:
        await ledger.apply(payload["k"], payload)

    inbox = oncely.AsyncInbox(rstore, consumer="billing")
    worker = BrokerConsumer(
        transport(stream), inbox, handler, key=oncely.CloudEventsKey(), settings=FAST
    )
    async with running(worker):
        await wait_until(lambda: settled(admin, stream), what="every entry acked")
    assert ledger.counts() == {"ev-7": 1}
    assert (worker.counts["processed"], worker.counts["duplicate"]) == (1, 2)
    assert_settled(admin, stream)
