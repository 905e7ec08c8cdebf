"""NATS JetStream end to end, against a real nats-server: every scenario ends with each logical
message's effect applied exactly once (a ledger row per effect, no unique constraint), nothing
lost, and the durable consumer holding nothing pending or unacknowledged.

Two inbox flavours: the transactional mode on PostgreSQL (the ledger row is written in the
marker's transaction) and the two-phase mode on Redis.

Here the basics: configuration, producer retries dropped by the stream's duplicate window and,
after it, answered ``duplicate`` by the inbox, conflicts, poison, undecodable and id-less
messages read back from the dead-letter stream.
"""

from __future__ import annotations

import asyncio
import json
from datetime import timedelta
from typing import Any

import nats
import pytest

import oncely
from oncely.brokers import BrokerConsumer, cloudevent_headers, open_producer, open_transport
from oncely.brokers.nats import JetStream, JetStreamProducer
from tests.brokers.common import running, wait_until
from tests.brokers.nats_helpers import World, body, consumer_state, read_stream, settings
from tests.services import NATS_URL

# ---------------------------------------------------------------------------- configuration


def test_registry_opens_jetstream_for_nats_urls() -> None:
    transport = open_transport(
        "nats://127.0.0.1:4222?max_deliver=7", "a.b", group="g", ack_wait=timedelta(seconds=9)
    )
    assert isinstance(transport, JetStream)
    assert transport.dead_letter == "a.b.dead"
    assert transport.max_deliver == 7
    assert transport.extend_every == timedelta(seconds=3)
    assert isinstance(open_producer("tls://127.0.0.1:4222", "a.b"), JetStreamProducer)


def test_unknown_url_option_names_the_valid_ones() -> None:
    with pytest.raises(oncely.ConfigurationError, match=r"ack_wait.*max_deliver"):
        open_transport("nats://127.0.0.1:4222?prefetch=3", "a.b", group="g")
    with pytest.raises(oncely.ConfigurationError, match="duplicate_window"):
        open_producer("nats://127.0.0.1:4222?max_deliver=3", "a.b")


def test_dead_letter_subject_inside_the_source_is_refused() -> None:
    with pytest.raises(oncely.ConfigurationError, match="wildcard"):
        JetStream(NATS_URL, "orders.*", group="g")
    with pytest.raises(oncely.ConfigurationError, match="consumed again"):
        JetStream(NATS_URL, "orders.>", group="g", dead_letter="orders.dead")
    JetStream(NATS_URL, "orders.*", group="g", dead_letter="dead.orders")


async def test_existing_stream_capturing_the_dead_letter_subject_is_refused(world: World) -> None:
    nc = await nats.connect(world.url)
    try:
        await nc.jetstream().add_stream(name=f"{world.base}_all", subjects=[f"{world.base}.>"])
    finally:
        await nc.close()
    transport = world.transport()  # dead letter: <base>.orders.dead, inside <base>.>
    with pytest.raises(oncely.ConfigurationError, match="captures the dead-letter subject"):
        await transport.open(1)
    await transport.close()


# ---------------------------------------------------------------------------- a. producer retries


async def test_a_r14_r23_producer_retries_window_then_inbox(world: World) -> None:
    """Within the stream's duplicate window a retry with the same Nats-Msg-Id is dropped by
    JetStream (PubAck.duplicate); a retry after the window is stored again and the inbox
    answers it ``duplicate`` (the window is a complement only, R14)."""
    producer = world.producer(duplicate_window=timedelta(seconds=2))
    first = await producer.send(body("order-1"), message_id="order-1")
    retries = [await producer.send(body("order-1"), message_id="order-1") for _ in range(2)]
    assert not first.duplicate
    assert [ack.duplicate for ack in retries] == [True, True]
    assert {ack.seq for ack in retries} == {first.seq}
    # A retry the window cannot catch: the producer came back after the window had passed.
    late = await producer.send(body("order-1"), message_id="order-1")
    while late.duplicate:
        await asyncio.sleep(0.2)
        late = await producer.send(body("order-1"), message_id="order-1")
    assert late.seq != first.seq
    await producer.publish(body("order-2"), message_id="order-2")

    consumer = BrokerConsumer(
        world.transport(), world.redis_inbox(), world.apply, settings=settings()
    )
    async with running(consumer):
        await wait_until(world.has(2), what="both orders")
        await wait_until(world.settled, what="nothing pending")
    assert world.ledger.counts() == {"order-1": 1, "order-2": 1}
    assert consumer.counts["processed"] == 2
    assert consumer.counts["duplicate"] == 1
    assert await consumer_state(world.url, world.stream, world.group) == (0, 0)


async def test_a_r20_a_reused_id_within_the_window_reaches_the_consumer_as_a_conflict(
    world: World,
) -> None:
    """The window drops a retry (same id, same body), but oncely's producer never lets it
    drop the same id sent with another body: ``Nats-Msg-Id`` carries the body's hash, so the
    reuse is stored and the consumer dead-letters it as a ``key_conflict`` (R20 step 6)
    instead of it vanishing before any consumer sees it."""
    producer = world.producer(duplicate_window=timedelta(minutes=1))
    first = await producer.send(body("order-9", total=10), message_id="order-9")
    retry = await producer.send(body("order-9", total=10), message_id="order-9")
    reuse = await producer.send(body("order-9", total=999), message_id="order-9")
    assert not first.duplicate and retry.duplicate and not reuse.duplicate
    consumer = BrokerConsumer(
        world.transport(), world.redis_inbox(), world.apply, settings=settings()
    )
    async with running(consumer):
        await wait_until(lambda: consumer.counts["key_conflict"] == 1, what="the conflict")
        await wait_until(world.settled, what="nothing pending")
    assert world.ledger.counts() == {"order-9": 1}
    [(headers, data)] = await read_stream(world.url, world.dead_stream)
    assert headers["x-oncely-outcome"] == "key_conflict"
    assert headers["Oncely-Message-Id"] == "order-9" and json.loads(data)["total"] in (10, 999)


# ---------------------------------------------------------------------------- d. dead letters


async def test_d_r20_conflict_poison_undecodable_and_idless_are_dead_lettered(
    world: World,
) -> None:
    producer = world.producer()
    ce = cloudevent_headers(source="/shop", event_type="order", event_id="e1")
    await producer.publish(body("e1", total=10), message_id="m-e1", headers=ce)
    inbox = world.pg_inbox()

    async def handler(tx: Any, payload: dict[str, Any]) -> None:
        if payload.get("poison"):
            raise oncely.Reject("cannot charge a poison order")
        await world.in_tx(tx, payload)

    consumer = BrokerConsumer(
        world.transport(),
        inbox,
        handler,
        mode="transactional",
        key=oncely.FirstOf(oncely.CloudEventsKey(), oncely.MessageIdKey()),
        settings=settings(),
    )
    async with running(consumer):
        await wait_until(world.has(1), what="the first order")
        # The same CloudEvent again with different content: a key conflict.
        await producer.publish(body("e1", total=99), message_id="m-e1-again", headers=ce)
        await producer.publish(body("p1", poison=True), message_id="m-poison")
        await producer.publish(b"{not json", message_id="m-garbage")
        nc = await nats.connect(world.url)
        try:
            await nc.jetstream().publish(world.subject, body("anon"))  # no Nats-Msg-Id
        finally:
            await nc.close()
        await wait_until(lambda: consumer.counts["rejected"] == 3, what="three rejections")
        await wait_until(lambda: consumer.counts["key_conflict"] == 1, what="the conflict")
        await wait_until(world.settled, what="nothing pending")

    dead = await read_stream(world.url, world.dead_stream)
    assert len(dead) == 4
    by_id = {headers.get("Oncely-Message-Id"): (headers, data) for headers, data in dead}
    assert set(by_id) == {"m-e1-again", "m-poison", "m-garbage", None}
    headers, data = by_id["m-e1-again"]
    assert headers["x-oncely-outcome"] == "key_conflict"
    assert headers["x-oncely-reason"]
    assert headers["ce-id"] == "e1" and json.loads(data)["total"] == 99
    headers, data = by_id["m-poison"]
    assert headers["x-oncely-outcome"] == "rejected"
    assert "poison" in headers["x-oncely-reason"]
    assert headers["x-oncely-consumer"] == world.group
    headers, data = by_id["m-garbage"]
    assert headers["x-oncely-outcome"] == "rejected"
    assert "undecodable" in headers["x-oncely-reason"] and data == b"{not json"
    headers, data = by_id[None]
    assert headers["x-oncely-outcome"] == "rejected"
    assert "message id" in headers["x-oncely-reason"] and json.loads(data)["id"] == "anon"
    assert all(h["x-oncely-deliveries"] == "1" for h, _ in dead)
    assert world.ledger.counts() == {"e1": 1}
