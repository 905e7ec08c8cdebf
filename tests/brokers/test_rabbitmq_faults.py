"""RabbitMQ end to end, against the real broker: a quorum queue, a dead-letter exchange and
queue, the consumer loop and both inbox flavours (transactional on PostgreSQL, two-phase on
Redis). Here the faults: a connection killed under a slow handler, the broker restarted
mid-run, a stale delivery after a reconnect, an unreachable broker.

Every scenario ends by checking the facts: each logical message's effect is in the ledger once
(R1, R7, R8), nothing is lost, and after the consumer has gone the queue holds nothing (a
message left unacknowledged would be back in the queue by then).
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections import Counter
from datetime import timedelta
from typing import Any

import psycopg
import pytest

import oncely
from oncely.brokers import BrokerConsumer, open_producer
from oncely.brokers.rabbitmq import RabbitMQ, RabbitMQProducer
from tests.brokers.common import Ledger, running, wait_until
from tests.brokers.rabbitmq_helpers import (
    FAST,
    Rabbit,
    body,
    rabbitmqctl,
    released_on_exit,
    transport,
)
from tests.services import RABBITMQ_URL, disruptive

pytestmark = pytest.mark.services


# ---------------------------------------------------------- b. connection loss under a slow handler


async def test_r8_r10_connection_killed_under_slow_handler_applies_once(
    rabbit: Rabbit, ledger: Ledger, redis_inbox: oncely.AsyncInbox
) -> None:
    """The broker closes the consumer's connection while a handler runs longer than its
    lease: the redelivered copy meets the live (renewed) claim and is requeued (in_flight);
    the first handler's ack then fails on the dead channel; the next copy is a duplicate."""
    started, release = asyncio.Event(), asyncio.Event()
    calls = Counter[str]()

    async def slow(payload: Any) -> None:
        calls[payload["n"]] += 1
        started.set()
        await release.wait()
        await ledger.apply(payload["n"], payload)

    producer = open_producer(RABBITMQ_URL, rabbit.queue)
    consumer = BrokerConsumer(transport(rabbit), redis_inbox, slow, settings=FAST)
    try:
        async with running(consumer), released_on_exit(release):
            await producer.publish(body("slow"), message_id=f"{rabbit.queue}-slow")
            await asyncio.wait_for(started.wait(), 30)
            assert await rabbit.kill_consumer_connections() == 1
            # Requeued at least 6 times, 0.2s apart: the handler has outlived its 1s lease.
            await wait_until(
                lambda: consumer.counts["in_flight"] >= 6,
                what="the redelivered copy to be requeued as in_flight",
            )
            assert ledger.counts() == {}
            release.set()
            await wait_until(
                lambda: consumer.counts["duplicate"] >= 1, what="the copy to be a duplicate"
            )
    finally:
        await producer.close()
    assert ledger.counts() == {"slow": 1}
    assert calls == {"slow": 1}
    assert consumer.counts["processed"] == 1
    assert consumer.counts["settle_failed"] >= 1  # the stale delivery tag could not be acked
    await rabbit.assert_settled()
    assert await rabbit.dead_count() == 0


# ---------------------------------------------------------------------- f. broker restart


@pytest.mark.slow
@disruptive("stops and starts the machine's RabbitMQ application")
async def test_broker_restart_mid_run_loses_nothing_and_applies_once(
    rabbit: Rabbit, ledger: Ledger, pg_inbox: oncely.AsyncInbox
) -> None:
    """``rabbitmqctl stop_app`` / ``start_app`` under a running consumer: the quorum queue
    keeps its messages; the consumer reconnects by itself and finishes them, then takes new
    ones."""

    resume = asyncio.Event()
    calls = 0

    async def apply(tx: psycopg.AsyncConnection[Any], payload: Any) -> None:
        nonlocal calls
        calls += 1
        if calls > 10:  # from the 11th on, handlers hold their transaction until the restart
            await resume.wait()
        await ledger.apply_in(tx, payload["n"], payload)

    before, after = 40, 10
    producer = open_producer(RABBITMQ_URL, rabbit.queue)
    consumer = BrokerConsumer(
        transport(rabbit), pg_inbox, apply, mode="transactional", settings=FAST
    )
    try:
        for n in range(before):
            await producer.publish(body(f"r{n}"), message_id=f"{rabbit.queue}-r{n}")
        async with running(consumer) as task, released_on_exit(resume):
            await wait_until(
                lambda: calls == 10 + FAST.concurrency, what="every handler slot to be mid-run"
            )
            try:
                await rabbitmqctl("stop_app")
            finally:
                await _start_app()
            resume.set()  # the handlers that ran across the restart commit; their acks fail
            for n in range(after):  # the producer reconnects too
                await producer.publish(body(f"s{n}"), message_id=f"{rabbit.queue}-s{n}")
            await wait_until(
                lambda: len(ledger.counts()) == before + after,
                timeout=timedelta(seconds=90),
                what="every message after the restart",
            )
            await wait_until(
                lambda: consumer.counts["duplicate"] >= FAST.concurrency,
                what="the copies redelivered after the restart to be acked as duplicates",
            )
            assert not task.done()
    finally:
        resume.set()
        await producer.close()
    expected = {f"r{n}": 1 for n in range(before)} | {f"s{n}": 1 for n in range(after)}
    assert ledger.counts() == expected
    assert consumer.counts["settle_failed"] >= 1  # acks on the channel the restart closed
    await rabbit.assert_settled()
    assert await rabbit.dead_count() == 0


async def _start_app() -> None:
    """Start the RabbitMQ application and wait until it answers again (always run)."""
    subprocess.run(["rabbitmqctl", "start_app"], check=True, capture_output=True, timeout=120)
    deadline = time.monotonic() + 120
    while True:
        ping = await asyncio.create_subprocess_exec(
            "rabbitmq-diagnostics",
            "-q",
            "check_running",
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        if await ping.wait() == 0:
            return
        if time.monotonic() > deadline:
            raise AssertionError("RabbitMQ did not come back after start_app")
        await asyncio.sleep(0.5)


# ---------------------------------------------------------------------- reconnects


async def test_stale_delivery_after_reconnect_raises_broker_unavailable(rabbit: Rabbit) -> None:
    made = transport(rabbit)
    producer = open_producer(RABBITMQ_URL, rabbit.queue)
    await made.open(1)
    try:
        await producer.publish(body("stale"), message_id=f"{rabbit.queue}-stale")
        (held,) = await made.fetch(1, timedelta(seconds=10))
        assert await rabbit.kill_consumer_connections() == 1
        with pytest.raises(oncely.BrokerUnavailable):
            for _ in range(100):  # until the transport notices the loss
                await made.fetch(1, timedelta(milliseconds=100))
        (again,) = await made.fetch(1, timedelta(seconds=10))  # reconnected
        assert again.envelope.message_id == held.envelope.message_id
        assert again.delivery_count == 2
        with pytest.raises(oncely.BrokerUnavailable):
            await held.ack()
        await again.ack()
    finally:
        await producer.close()
        await made.close()
    await rabbit.assert_settled()


async def test_unreachable_broker_is_broker_unavailable() -> None:
    made = RabbitMQ("amqp://guest:guest@127.0.0.1:1/", "q", connect_timeout=timedelta(seconds=2))
    with pytest.raises(oncely.BrokerUnavailable):
        await made.open(1)
    producer = RabbitMQProducer("amqp://guest:guest@127.0.0.1:1/", "q")
    with pytest.raises(oncely.BrokerUnavailable):
        await producer.publish(b"{}", message_id="m")
