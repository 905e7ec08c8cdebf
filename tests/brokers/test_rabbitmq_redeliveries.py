"""RabbitMQ end to end, against the real broker: a quorum queue, a dead-letter exchange and
queue, the consumer loop and both inbox flavours (transactional on PostgreSQL, two-phase on
Redis). Here the redeliveries: two consumers with copies of one message, a failing handler
retried up to the limit, an ``in_flight`` copy requeued and never acked, and the broker's own
delivery limit.

Every scenario ends by checking the facts: each logical message's effect is in the ledger once
(R1, R7, R8), nothing is lost, and after the consumer has gone the queue holds nothing (a
message left unacknowledged would be back in the queue by then).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any, cast

import psycopg
import pytest

import oncely
from oncely.brokers import BrokerConsumer, ConsumerSettings, open_producer
from oncely.brokers.rabbitmq import RabbitMQ, RabbitMQProducer
from tests.brokers.common import Ledger, pg_store, running, wait_until
from tests.brokers.rabbitmq_helpers import (
    CONSUMER,
    FAST,
    Rabbit,
    Watching,
    _equals,
    body,
    released_on_exit,
    transport,
)
from tests.services import RABBITMQ_URL

pytestmark = pytest.mark.services


# ---------------------------------------------------------------------- c. competing consumers


async def test_r8_two_consumers_with_copies_of_one_message_apply_once(
    rabbit: Rabbit, ledger: Ledger, pg_inbox: oncely.AsyncInbox
) -> None:
    """Two consumers on two connections, one message at a time each, every message published
    twice: each consumer holds one copy while the other holds the second."""
    seen = Counter[int]()

    def handler_for(which: int) -> Callable[[psycopg.AsyncConnection[Any], Any], Awaitable[None]]:
        async def apply(tx: psycopg.AsyncConnection[Any], payload: Any) -> None:
            seen[which] += 1
            await ledger.apply_in(tx, payload["n"], payload)
            await asyncio.sleep(0.2)  # the transaction stays open: the other copy waits

        return apply

    one = ConsumerSettings(
        concurrency=1,
        requeue_delay=FAST.requeue_delay,
        backoff=FAST.backoff,
        poll=FAST.poll,
        reconnect=FAST.reconnect,
        shutdown_grace=FAST.shutdown_grace,
    )
    # A second inbox with its own connection pool on the same table, as a second process
    # would have: the dedup record in the shared table is the arbiter (R8).
    table = cast(oncely.AsyncPostgresStore, pg_inbox.store).table.rpartition(".")[2]
    second_inbox = oncely.AsyncInbox(pg_store(table), consumer=CONSUMER)
    first = BrokerConsumer(
        transport(rabbit), pg_inbox, handler_for(1), mode="transactional", settings=one
    )
    second = BrokerConsumer(
        transport(rabbit), second_inbox, handler_for(2), mode="transactional", settings=one
    )
    producer = open_producer(RABBITMQ_URL, rabbit.queue)
    try:
        async with running(first), running(second):
            await wait_until(
                lambda: _equals(rabbit.consumers(), 2), what="both consumers to be reading"
            )
            for n in range(6):
                for _copy in range(2):
                    await producer.publish(body(f"c{n}"), message_id=f"{rabbit.queue}-c{n}")

            def total(name: str) -> int:
                return first.counts[name] + second.counts[name]

            await wait_until(
                lambda: total("processed") + total("duplicate") == 12,
                what="all 12 copies to be settled",
            )
    finally:
        await producer.close()
        await second_inbox.aclose()
    assert ledger.counts() == {f"c{n}": 1 for n in range(6)}
    assert first.counts["processed"] + second.counts["processed"] == 6
    assert sum(first.counts.values()) >= 1 and sum(second.counts.values()) >= 1
    await rabbit.assert_settled()


# ---------------------------------------------------------------------- e. failing handlers


async def test_r13_failing_handler_is_retried_up_to_max_deliveries_then_dead_lettered(
    rabbit: Rabbit, ledger: Ledger, redis_inbox: oncely.AsyncInbox
) -> None:
    calls = Counter[str]()

    async def handler(payload: Any) -> None:
        key = payload["n"]
        calls[key] += 1
        if key == "bad":
            raise RuntimeError("the ledger service is broken")
        if key == "flaky" and calls[key] == 1:
            raise RuntimeError("a passing hiccup")
        await ledger.apply(key, payload)

    watching = Watching(RABBITMQ_URL, rabbit.queue, connection_name=rabbit.consumer_name)
    producer = open_producer(RABBITMQ_URL, rabbit.queue)
    consumer = BrokerConsumer(watching, redis_inbox, handler, settings=FAST)
    try:
        async with running(consumer):
            await producer.publish(body("bad"), message_id=f"{rabbit.queue}-bad")
            await producer.publish(body("flaky"), message_id=f"{rabbit.queue}-flaky")
            await wait_until(
                lambda: _equals(rabbit.dead_count(), 1), what="the broken message dead-lettered"
            )
            await wait_until(lambda: consumer.counts["processed"] == 1, what="the flaky one")
    finally:
        await producer.close()
    assert calls == {"bad": FAST.max_deliveries, "flaky": 2}
    # delivery_count comes from the quorum queue's x-delivery-count header.
    assert watching.counts(f"{rabbit.queue}-bad") == [1, 2, 3]
    assert watching.counts(f"{rabbit.queue}-flaky") == [1, 2]
    (dead,) = await rabbit.drain_dead()
    headers: dict[str, Any] = dict(dead.headers)
    assert dead.message_id == f"{rabbit.queue}-bad"
    assert headers["x-oncely-outcome"] == "rejected"
    assert "failed on all 3 deliveries" in headers["x-oncely-reason"]
    assert "the ledger service is broken" in headers["x-oncely-reason"]
    assert headers["x-oncely-deliveries"] == "3"
    assert consumer.counts["dead_lettered_after_retries"] == 1
    assert ledger.counts() == {"flaky": 1}
    await rabbit.assert_settled()


# ---------------------------------------------------------------------- g. in_flight -> retry


async def test_r10_in_flight_copy_is_requeued_not_acked_while_another_holds_the_claim(
    rabbit: Rabbit, ledger: Ledger, redis_inbox: oncely.AsyncInbox
) -> None:
    """Two consumers, two copies of one message: while the first handler runs, the second
    copy keeps coming back as ``in_flight`` and stays on the broker (held, then requeued);
    it is acked only as a ``duplicate`` after the first finished."""
    started, release = asyncio.Event(), asyncio.Event()
    mid = f"{rabbit.queue}-held"

    async def slow(payload: Any) -> None:
        started.set()
        await release.wait()
        await ledger.apply(payload["n"], payload)

    one = ConsumerSettings(
        concurrency=1,
        requeue_delay=timedelta(milliseconds=300),
        poll=FAST.poll,
        reconnect=FAST.reconnect,
        shutdown_grace=FAST.shutdown_grace,
    )
    watched = [Watching(RABBITMQ_URL, rabbit.queue) for _ in range(2)]
    first = BrokerConsumer(watched[0], redis_inbox, slow, settings=one)
    second = BrokerConsumer(watched[1], redis_inbox, slow, settings=one)
    producer = open_producer(RABBITMQ_URL, rabbit.queue)
    try:
        async with running(first), running(second), released_on_exit(release):
            await wait_until(
                lambda: _equals(rabbit.consumers(), 2), what="both consumers to be reading"
            )
            for _copy in range(2):
                await producer.publish(body("held"), message_id=mid)
            await asyncio.wait_for(started.wait(), 30)

            def in_flight() -> int:
                return first.counts["in_flight"] + second.counts["in_flight"]

            await wait_until(lambda: in_flight() >= 4, what="the copy requeued as in_flight")
            assert ledger.counts() == {}
            release.set()
            await wait_until(
                lambda: first.counts["duplicate"] + second.counts["duplicate"] == 1,
                what="the second copy acked as a duplicate",
            )
    finally:
        await producer.close()
    assert ledger.counts() == {"held": 1}
    assert first.counts["processed"] + second.counts["processed"] == 1
    # The broker counted every requeue of the in_flight copy: it was given back each time,
    # never acked, until it came back as a duplicate after the first copy was done.
    counts = sorted(c or 0 for c in watched[0].counts(mid) + watched[1].counts(mid))
    in_flight_total = first.counts["in_flight"] + second.counts["in_flight"]
    assert counts == [1, *range(1, in_flight_total + 2)]
    await rabbit.assert_settled()


# ---------------------------------------------------------------------- broker delivery limit


async def test_broker_delivery_limit_is_a_safety_net_without_a_reason(rabbit: Rabbit) -> None:
    """Past ``x-delivery-limit`` the quorum queue dead-letters by itself, with no
    ``x-oncely-*`` reason: that is why the limit sits above ``max_deliveries``."""
    made = RabbitMQ(RABBITMQ_URL, rabbit.queue, delivery_limit=2)
    producer = RabbitMQProducer(RABBITMQ_URL, rabbit.queue, delivery_limit=2)
    await made.open(1)
    try:
        await producer.publish(body("x"), message_id=f"{rabbit.queue}-x")
        counts = []
        while True:
            found = await made.fetch(1, timedelta(seconds=1))
            if not found:
                break
            counts.append(found[0].delivery_count)
            await found[0].retry(timedelta(0))
    finally:
        await producer.close()
        await made.close()
    assert counts == [1, 2, 3]
    await wait_until(lambda: _equals(rabbit.dead_count(), 1), what="the broker's dead letter")
    (dead,) = await rabbit.drain_dead()
    assert dead.message_id == f"{rabbit.queue}-x"
    assert "x-oncely-reason" not in (dead.headers or {})
    assert await rabbit.ready() == 0
