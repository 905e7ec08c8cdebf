"""RabbitMQ end to end, against the real broker: a quorum queue, a dead-letter exchange and
queue, the consumer loop and both inbox flavours (transactional on PostgreSQL, two-phase on
Redis). Here the basics: producer retries, conflicts and poison dead-lettered with their
reasons, the queue's topology, the envelope and the options.

Every scenario ends by checking the facts: each logical message's effect is in the ledger once
(R1, R7, R8), nothing is lost, and after the consumer has gone the queue holds nothing (a
message left unacknowledged would be back in the queue by then).
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import aio_pika
import aiormq
import psycopg
import pytest

import oncely
from oncely.brokers import BrokerConsumer, cloudevent_headers, open_producer, open_transport
from oncely.brokers.rabbitmq import DEFAULT_DELIVERY_LIMIT, RabbitMQ, RabbitMQProducer
from tests.brokers.common import Ledger, running, wait_until
from tests.brokers.rabbitmq_helpers import (
    CONSUMER,
    FAST,
    Rabbit,
    _equals,
    body,
    transactional,
    transport,
)
from tests.services import RABBITMQ_URL

pytestmark = pytest.mark.services


# ---------------------------------------------------------------------- a. producer retries


async def test_r1_r2_producer_retries_are_duplicates_and_all_acked(
    rabbit: Rabbit, ledger: Ledger, pg_inbox: oncely.AsyncInbox
) -> None:
    producer = open_producer(RABBITMQ_URL, rabbit.queue)
    try:
        for _attempt in range(3):  # the producer "retries" each publish with the same id
            for n in range(5):
                await producer.publish(body(f"m{n}"), message_id=f"{rabbit.queue}-m{n}")
    finally:
        await producer.close()
    consumer = BrokerConsumer(
        transport(rabbit), pg_inbox, transactional(ledger), mode="transactional", settings=FAST
    )
    async with running(consumer):
        await wait_until(
            lambda: consumer.counts["processed"] + consumer.counts["duplicate"] == 15,
            what="all 15 copies to be settled",
        )
    assert ledger.counts() == {f"m{n}": 1 for n in range(5)}
    assert consumer.counts["processed"] == 5
    assert consumer.counts["duplicate"] == 10
    await rabbit.assert_settled()
    assert await rabbit.dead_count() == 0


# ---------------------------------------------------------------------- d. dead letters


async def test_r20_conflicts_and_poison_are_dead_lettered_with_reasons(
    rabbit: Rabbit, ledger: Ledger, pg_inbox: oncely.AsyncInbox
) -> None:
    async def apply(tx: psycopg.AsyncConnection[Any], payload: Any) -> None:
        if payload.get("poison"):
            raise oncely.Reject("the order has no customer")
        await ledger.apply_in(tx, payload["n"], payload)

    producer = open_producer(RABBITMQ_URL, rabbit.queue)
    consumer = BrokerConsumer(
        transport(rabbit), pg_inbox, apply, mode="transactional", settings=FAST
    )
    q = rabbit.queue
    try:
        async with running(consumer):
            await producer.publish(body("conf", v=1), message_id=f"{q}-conf")
            await wait_until(lambda: consumer.counts["processed"] == 1, what="the first order")
            # Same id, different content: a key conflict (R20 step 6).
            await producer.publish(
                body("conf", v=2), message_id=f"{q}-conf", headers={"x-app": "billing"}
            )
            await producer.publish(body("poison", poison=True), message_id=f"{q}-poison")
            await producer.publish(b"{not json", message_id=f"{q}-garbage")
            await rabbit.publish_without_message_id(body("anonymous"))
            await wait_until(
                lambda: _equals(rabbit.dead_count(), 4), what="four dead-lettered messages"
            )
    finally:
        await producer.close()
    dead = {
        json.loads(m.body)["n"] if m.body != b"{not json" else "garbage": m
        for m in await rabbit.drain_dead()
    }
    assert set(dead) == {"conf", "poison", "garbage", "anonymous"}
    assert dead["conf"].message_id == f"{q}-conf"
    assert dead["poison"].message_id == f"{q}-poison"
    assert dead["garbage"].message_id == f"{q}-garbage"

    def fields(name: str) -> dict[str, Any]:
        return dict(dead[name].headers)

    conflict = fields("conf")
    assert conflict["x-oncely-outcome"] == "key_conflict"
    assert conflict["x-app"] == "billing"  # the original headers travel with the copy
    assert conflict["x-oncely-consumer"] == CONSUMER
    assert json.loads(dead["conf"].body) == {"n": "conf", "v": 2}
    poison = fields("poison")
    assert poison["x-oncely-outcome"] == "rejected"
    assert "the order has no customer" in poison["x-oncely-reason"]
    garbage = fields("garbage")
    assert garbage["x-oncely-outcome"] == "rejected"
    assert "undecodable" in garbage["x-oncely-reason"]
    assert dead["garbage"].body == b"{not json"
    anonymous = fields("anonymous")
    assert anonymous["x-oncely-outcome"] == "rejected"
    assert "message id" in anonymous["x-oncely-reason"]
    assert ledger.counts() == {"conf": 1}
    await rabbit.assert_settled()
    assert await rabbit.dead_count() == 0


# ---------------------------------------------------------------------- topology and options


async def test_queue_is_quorum_with_dead_letter_exchange_and_delivery_limit(
    rabbit: Rabbit,
) -> None:
    made = transport(rabbit)
    await made.open(2)
    try:
        connection = await aio_pika.connect(RABBITMQ_URL)
        async with connection:
            # Redeclaring with exactly these arguments succeeds; anything else is refused.
            channel = await connection.channel()
            await channel.declare_queue(
                rabbit.queue,
                durable=True,
                arguments={
                    "x-queue-type": "quorum",
                    "x-dead-letter-exchange": rabbit.dead,
                    "x-delivery-limit": DEFAULT_DELIVERY_LIMIT,
                },
            )
            with pytest.raises(aiormq.exceptions.ChannelPreconditionFailed):
                await channel.declare_queue(
                    rabbit.queue, durable=True, arguments={"x-queue-type": "classic"}
                )
        # A transport configured differently is told so, not left guessing.
        other = RabbitMQ(RABBITMQ_URL, rabbit.queue, delivery_limit=7)
        with pytest.raises(oncely.ConfigurationError, match="other arguments"):
            await other.open(1)
        await other.close()
    finally:
        await made.close()


async def test_envelope_carries_producer_id_and_cloudevents_never_the_delivery_tag(
    rabbit: Rabbit,
) -> None:
    made = transport(rabbit)
    producer = open_producer(RABBITMQ_URL, rabbit.queue)
    await made.open(1)
    try:
        ce = cloudevent_headers(source="/orders", event_type="order.placed", event_id="o-1")
        await producer.publish(
            body("ce"), message_id="producer-id-1", headers=ce, correlation_id="corr-9"
        )
        (delivery,) = await made.fetch(1, timedelta(seconds=10))
        envelope = delivery.envelope
        assert envelope.message_id == "producer-id-1"
        assert envelope.correlation_id == "corr-9"
        assert oncely.CloudEventsKey()(envelope) == "/orders o-1"
        assert envelope.delivery_count == 1
        assert "x-delivery-count" not in envelope.headers
        described = delivery.describe()
        assert described["redelivered"] is False
        assert isinstance(described["delivery_tag"], int)
        assert envelope.transport["content_type"] == "application/json"
        await delivery.retry(timedelta(0))
        (again,) = await made.fetch(1, timedelta(seconds=10))
        assert again.describe()["redelivered"] is True
        assert again.describe()["x-delivery-count"] == 1
        assert again.delivery_count == 2
        await again.ack()
    finally:
        await producer.close()
        await made.close()
    await rabbit.assert_settled()


def test_url_options_are_checked() -> None:
    with pytest.raises(oncely.ConfigurationError, match="delivery_limit"):
        open_transport(f"{RABBITMQ_URL}?prefetch=3", "q", group="g")
    made = open_transport(
        f"{RABBITMQ_URL}?delivery_limit=0&declare=false&heartbeat=5", "q", group="g"
    )
    assert isinstance(made, RabbitMQ)
    assert made.topology.delivery_limit is None
    assert made.topology.dead_letter == "q.dead"
    assert made.extend_every is None
    with pytest.raises(oncely.ConfigurationError):
        RabbitMQ(RABBITMQ_URL, "q", dead_letter="q")
    with pytest.raises(oncely.ConfigurationError):
        open_producer(f"{RABBITMQ_URL}?delivery_limit=-1", "q")


async def test_producer_refuses_a_message_no_queue_takes(rabbit: Rabbit) -> None:
    producer = RabbitMQProducer(RABBITMQ_URL, rabbit.queue, declare=False)
    try:
        with pytest.raises(oncely.BrokerError, match="no queue"):
            await producer.publish(body("lost"), message_id="m")
    finally:
        await producer.close()
