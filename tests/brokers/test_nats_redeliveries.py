"""NATS JetStream end to end, against a real nats-server: every scenario ends with each logical
message's effect applied exactly once (a ledger row per effect, no unique constraint), nothing
lost, and the durable consumer holding nothing pending or unacknowledged.

Two inbox flavours: the transactional mode on PostgreSQL (the ledger row is written in the
marker's transaction) and the two-phase mode on Redis.

Here the redeliveries: an ack wait shorter than the handler, two consumers receiving copies at
once, retries up to the delivery limit (the loop's and the broker's), ``in_flight`` given back
and never acknowledged.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from datetime import timedelta
from typing import Any

import nats
import pytest

import oncely
from oncely.brokers import BrokerConsumer, cloudevent_headers
from tests.brokers.common import running, wait_until
from tests.brokers.nats_helpers import World, body, read_stream, settings

# ---------------------------------------------------------------------------- b. ack wait


@pytest.mark.slow
async def test_b_ack_wait_shorter_than_the_handler_is_extended(world: World) -> None:
    """ack_wait is 1s and the handler takes 3s: ``+WPI`` every ack_wait/3 keeps JetStream from
    redelivering it to the other consumer, so the message is delivered once."""
    producer = world.producer()
    await producer.publish(body("slow-1"), message_id="slow-1")
    inbox = world.pg_inbox()

    async def slow(tx: Any, payload: dict[str, Any]) -> None:
        await asyncio.sleep(3)
        await world.in_tx(tx, payload)

    consumers = [
        BrokerConsumer(
            world.transport(ack_wait=timedelta(seconds=1)),
            inbox,
            slow,
            mode="transactional",
            settings=settings(),
        )
        for _ in range(2)
    ]
    async with running(consumers[0]), running(consumers[1]):
        await wait_until(world.has(1), what="the slow message")
        await wait_until(world.settled, what="nothing pending")
    nc = await nats.connect(world.url)
    try:
        info = await nc.jetstream().consumer_info(world.stream, world.group)
    finally:
        await nc.close()
    assert info.delivered.consumer_seq == 1  # delivered once: never redelivered meanwhile
    total = consumers[0].counts + consumers[1].counts
    assert total == Counter({"processed": 1})
    assert world.ledger.counts() == {"slow-1": 1}


# ---------------------------------------------------------------------------- c. two consumers


async def test_c_r8_two_consumers_get_copies_at_once(world: World) -> None:
    """Two copies of each event (two relays, distinct Nats-Msg-Id, same CloudEvents source and
    id) reach two consumers on separate connections at the same time: one effect each."""
    producer = world.producer()
    events = [f"evt-{i}" for i in range(4)]
    for event in events:
        headers = cloudevent_headers(source="/relay", event_type="order", event_id=event)
        for relay in ("a", "b"):
            await producer.publish(body(event), message_id=f"{relay}-{event}", headers=headers)
    inbox = world.redis_inbox()

    async def slow(payload: dict[str, Any]) -> None:
        await asyncio.sleep(0.5)
        await world.apply(payload)

    consumers = [
        BrokerConsumer(
            world.transport(),
            inbox,
            slow,
            key=oncely.CloudEventsKey(),
            settings=settings(concurrency=2),
        )
        for _ in range(2)
    ]
    async with running(consumers[0]), running(consumers[1]):
        await wait_until(world.has(len(events)), what="every event")
        await wait_until(world.settled, what="nothing pending")
    total = consumers[0].counts + consumers[1].counts
    assert total["processed"] == len(events)
    assert total["duplicate"] == len(events)
    assert total["in_flight"] >= 1  # copies really were handled at the same time
    assert world.ledger.counts() == dict.fromkeys(events, 1)


# ---------------------------------------------------------------------------- e. retries


async def test_e_failing_handler_retried_then_dead_lettered(world: World) -> None:
    producer = world.producer()
    await producer.publish(body("always"), message_id="always")
    await producer.publish(body("once"), message_id="once")
    attempts: Counter[str] = Counter()

    async def handler(payload: dict[str, Any]) -> None:
        attempts[payload["id"]] += 1
        if payload["id"] == "always" or attempts["once"] == 1:
            raise RuntimeError(f"downstream down for {payload['id']}")
        await world.apply(payload)

    consumer = BrokerConsumer(
        world.transport(),
        world.redis_inbox(),
        handler,
        settings=settings(max_deliveries=3),
    )
    async with running(consumer):
        await wait_until(world.has(1), what="the flaky message")
        await wait_until(lambda: consumer.counts["dead_lettered_after_retries"] == 1)
        await wait_until(world.settled, what="nothing pending")
    assert attempts == {"always": 3, "once": 2}
    assert world.ledger.counts() == {"once": 1}
    [(headers, data)] = await read_stream(world.url, world.dead_stream)
    assert headers["Oncely-Message-Id"] == "always" and json.loads(data) == {"id": "always"}
    assert headers["x-oncely-outcome"] == "rejected"
    assert "failed on all 3 deliveries" in headers["x-oncely-reason"]
    assert "downstream down for always" in headers["x-oncely-reason"]
    assert headers["x-oncely-deliveries"] == "3"


async def test_e_r13_broker_max_deliver_below_the_loop_limit_dead_letters(
    world: World,
) -> None:
    """The consumer's max_deliver (2) is below ConsumerSettings.max_deliveries (5): on the
    broker's last delivery a give-back dead-letters instead of stranding the message."""
    producer = world.producer()
    await producer.publish(body("stuck"), message_id="stuck")

    async def handler(payload: dict[str, Any]) -> None:
        raise RuntimeError("always")

    consumer = BrokerConsumer(
        world.transport(max_deliver=2), world.redis_inbox(), handler, settings=settings()
    )
    async with running(consumer):
        await wait_until(lambda: consumer.counts["failed"] == 2, what="two failures")
        await wait_until(world.settled, what="nothing pending")
    [(headers, _data)] = await read_stream(world.url, world.dead_stream)
    assert "max_deliver" in headers["x-oncely-reason"]
    assert headers["x-oncely-deliveries"] == "2"
    assert world.ledger.counts() == {}


# ---------------------------------------------------------------------------- g. in_flight


async def test_g_r10_in_flight_is_given_back_not_acked(world: World) -> None:
    """Another worker holds the claim: the delivery is ``in_flight``, given back with a delay
    (redelivered, never acknowledged) until the holder finishes; then it is a duplicate."""
    producer = world.producer()
    inbox = world.redis_inbox()
    release = asyncio.Event()

    async def holder(payload: dict[str, Any]) -> None:
        await release.wait()
        await world.apply(payload)

    payload = {"id": "held"}
    other = asyncio.create_task(inbox.handle("held", payload, holder))
    await wait_until(
        lambda: _claimed(inbox, "held"), what="the other worker's claim"
    )  # claim taken before the message arrives
    await producer.publish(json.dumps(payload).encode(), message_id="held")
    consumer = BrokerConsumer(world.transport(), inbox, world.apply, settings=settings())
    async with running(consumer):
        await wait_until(lambda: consumer.counts["in_flight"] >= 2, what="two give-backs")
        nc = await nats.connect(world.url)
        try:
            info = await nc.jetstream().consumer_info(world.stream, world.group)
        finally:
            await nc.close()
        assert info.ack_floor.stream_seq == 0  # never acknowledged while the claim is held
        assert info.num_ack_pending + info.num_pending == 1
        assert info.delivered.consumer_seq >= 2  # given back and delivered again
        release.set()
        assert (await other).outcome is oncely.Outcome.PROCESSED
        await wait_until(lambda: consumer.counts["duplicate"] == 1, what="the duplicate")
        await wait_until(world.settled, what="nothing pending")
    assert consumer.counts["processed"] == 0
    assert world.ledger.counts() == {"held": 1}


async def _claimed(inbox: oncely.AsyncInbox, key: str) -> bool:
    return await inbox.get(key) is not None
