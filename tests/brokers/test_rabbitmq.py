"""RabbitMQ end to end, against the real broker: a quorum queue, a dead-letter exchange and
queue, the consumer loop and both inbox flavours (transactional on PostgreSQL, two-phase on
Redis).

Every scenario ends by checking the facts: each logical message's effect is in the ledger once
(R1, R7, R8), nothing is lost, and after the consumer has gone the queue holds nothing (a
message left unacknowledged would be back in the queue by then).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import socket
import subprocess
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, cast
from urllib.parse import unquote, urlsplit

import aio_pika
import aiormq
import pamqp.body
import pamqp.exceptions
import pamqp.frame
import pamqp.header
import psycopg
import pytest
import redis.asyncio
from pamqp import commands

import oncely
from oncely.brokers import (
    Backoff,
    BrokerConsumer,
    ConsumerSettings,
    Delivery,
    cloudevent_headers,
    open_producer,
    open_transport,
)
from oncely.brokers.rabbitmq import (
    DEFAULT_DELIVERY_LIMIT,
    RabbitMQ,
    RabbitMQProducer,
)
from tests.brokers.common import (
    Ledger,
    drop_store_table,
    pg_store,
    require_postgres,
    running,
    unique,
    wait_until,
)
from tests.services import RABBITMQ_URL, REDIS_URL, require

pytestmark = pytest.mark.services

CONSUMER = "rmq-tests"

FAST = ConsumerSettings(
    concurrency=4,
    requeue_delay=timedelta(milliseconds=200),
    backoff=Backoff(first=timedelta(milliseconds=100), most=timedelta(milliseconds=400)),
    max_deliveries=3,
    poll=timedelta(milliseconds=200),
    reconnect=Backoff(first=timedelta(milliseconds=200), most=timedelta(seconds=1)),
    shutdown_grace=timedelta(seconds=5),
)


def _require_rabbitmq() -> None:
    require("RabbitMQ", RABBITMQ_URL, 5672)


async def rabbitmqctl(*args: str) -> str:
    """Run ``rabbitmqctl`` without blocking the event loop the consumers run on."""
    if shutil.which("rabbitmqctl") is None:
        pytest.skip("rabbitmqctl is not installed here")
    proc = await asyncio.create_subprocess_exec(
        "rabbitmqctl",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate()
    if proc.returncode != 0:
        raise AssertionError(f"rabbitmqctl {' '.join(args)} failed: {err.decode()}")
    return out.decode()


@dataclass
class Rabbit:
    """One test's queue (and its dead-letter queue), read back with a plain client."""

    queue: str

    @property
    def dead(self) -> str:
        return f"{self.queue}.dead"

    @property
    def consumer_name(self) -> str:
        """The connection name a transport opened with ``group=CONSUMER`` uses."""
        return f"oncely {CONSUMER} {self.queue}"

    async def _declare(self, name: str, *, missing_ok: bool = False) -> tuple[int, int]:
        connection = await aio_pika.connect(RABBITMQ_URL)
        async with connection:
            channel = await connection.channel()
            try:
                queue = await channel.declare_queue(name, passive=True)
            except aiormq.exceptions.ChannelNotFoundEntity:
                if missing_ok:  # the consumer has not declared it yet
                    return 0, 0
                raise
            result = queue.declaration_result
            return result.message_count or 0, result.consumer_count or 0

    async def ready(self) -> int:
        return (await self._declare(self.queue))[0]

    async def consumers(self) -> int:
        return (await self._declare(self.queue, missing_ok=True))[1]

    async def dead_count(self) -> int:
        return (await self._declare(self.dead))[0]

    async def assert_settled(self) -> None:
        """Nothing left on the broker: once the queue has no consumer, whatever a consumer
        had not acknowledged is back in the queue, so an empty queue means all were acked."""
        await wait_until(self.consumers_gone, what="the queue to have no consumer left")
        assert await self.ready() == 0, "messages were left in the queue (unacknowledged)"

    async def consumers_gone(self) -> bool:
        return await self.consumers() == 0

    async def drain_dead(self) -> list[aio_pika.abc.AbstractIncomingMessage]:
        """Every message in the dead-letter queue, acknowledged (so the queue ends empty)."""
        found = []
        connection = await aio_pika.connect(RABBITMQ_URL)
        async with connection:
            channel = await connection.channel()
            queue = await channel.declare_queue(self.dead, passive=True)
            while (message := await queue.get(fail=False)) is not None:
                await message.ack()
                found.append(message)
            queue = await channel.declare_queue(self.dead, passive=True)
            assert queue.declaration_result.message_count == 0
        return found

    async def publish_without_message_id(self, body: bytes) -> None:
        """Publish a message that has no ``message_id`` property at all. aiormq gives every
        message it publishes without one a random id, so this speaks AMQP 0-9-1 itself."""
        await asyncio.to_thread(_publish_bare, self.queue, body)

    async def kill_consumer_connections(self) -> int:
        """Close this test's consumer connections from the broker's side."""
        table = await rabbitmqctl(
            "-q", "--no-table-headers", "list_connections", "pid", "client_properties"
        )
        pids = [row.split("\t", 1)[0] for row in table.splitlines() if self.consumer_name in row]
        for pid in pids:
            await rabbitmqctl("close_connection", pid, "oncely test: connection killed")
        return len(pids)

    async def delete(self) -> None:
        connection = await aio_pika.connect(RABBITMQ_URL)
        async with connection:
            for name in (self.queue, self.dead):
                channel = await connection.channel()
                with contextlib.suppress(aiormq.exceptions.AMQPError):
                    await channel.queue_delete(name)
            channel = await connection.channel()
            with contextlib.suppress(aiormq.exceptions.AMQPError):
                await channel.exchange_delete(self.dead)


def _publish_bare(queue: str, payload: bytes) -> None:
    """A minimal AMQP 0-9-1 publisher (confirmed) that sets only ``content_type``."""
    parts = urlsplit(RABBITMQ_URL)
    vhost = unquote(parts.path[1:]) if len(parts.path) > 1 else "/"
    buffer = b""

    def receive(sock: socket.socket) -> Any:
        nonlocal buffer
        while True:
            if buffer:
                with contextlib.suppress(pamqp.exceptions.UnmarshalingException):
                    used, _channel, frame = pamqp.frame.unmarshal(buffer)
                    buffer = buffer[used:]
                    if frame.name == "Heartbeat":
                        continue
                    return frame
            chunk = sock.recv(65536)
            if not chunk:
                raise AssertionError("RabbitMQ closed the connection")
            buffer += chunk

    def send(sock: socket.socket, frame: Any, channel: int = 0) -> None:
        sock.sendall(pamqp.frame.marshal(frame, channel))

    with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 5672), 10) as sock:
        sock.sendall(pamqp.header.ProtocolHeader().marshal())
        assert receive(sock).name == "Connection.Start"
        login = f"\0{unquote(parts.username or 'guest')}\0{unquote(parts.password or 'guest')}"
        send(sock, commands.Connection.StartOk(client_properties={}, response=login))
        tune = receive(sock)
        send(sock, commands.Connection.TuneOk(tune.channel_max, tune.frame_max, 0))
        send(sock, commands.Connection.Open(virtual_host=vhost))
        assert receive(sock).name == "Connection.OpenOk"
        send(sock, commands.Channel.Open(), 1)
        assert receive(sock).name == "Channel.OpenOk"
        send(sock, commands.Confirm.Select(), 1)
        assert receive(sock).name == "Confirm.SelectOk"
        send(sock, commands.Basic.Publish(exchange="", routing_key=queue, mandatory=True), 1)
        properties = commands.Basic.Properties(content_type="application/json", delivery_mode=2)
        send(sock, pamqp.header.ContentHeader(0, len(payload), properties), 1)
        send(sock, pamqp.body.ContentBody(payload), 1)
        assert receive(sock).name == "Basic.Ack", "the broker did not confirm the message"
        send(sock, commands.Connection.Close(200, "done", 0, 0))
        assert receive(sock).name == "Connection.CloseOk"


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


class Watching(RabbitMQ):
    """The transport, noting the delivery count of every delivery it hands out."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[tuple[str | None, int | None]] = []

    async def fetch(self, limit: int, timeout: timedelta) -> list[Delivery]:
        found = await super().fetch(limit, timeout)
        self.seen.extend((d.envelope.message_id, d.delivery_count) for d in found)
        return found

    def counts(self, message_id: str) -> list[int | None]:
        return [count for seen_id, count in self.seen if seen_id == message_id]


def transport(rabbit: Rabbit, **options: Any) -> RabbitMQ:
    made = open_transport(RABBITMQ_URL, rabbit.queue, group=CONSUMER, **options)
    assert isinstance(made, RabbitMQ)
    return made


def body(n: str, **extra: object) -> bytes:
    return json.dumps({"n": n, **extra}).encode()


def transactional(ledger: Ledger) -> Callable[[psycopg.AsyncConnection[Any], Any], Awaitable[None]]:
    async def apply(tx: psycopg.AsyncConnection[Any], payload: Any) -> None:
        await ledger.apply_in(tx, payload["n"], payload)

    return apply


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


@contextlib.asynccontextmanager
async def released_on_exit(release: asyncio.Event) -> AsyncIterator[None]:
    """Let blocked handlers finish before the consumers stop, even when the test fails."""
    try:
        yield
    finally:
        release.set()


async def _equals(value: Awaitable[int], expected: int) -> bool:
    return await value == expected


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


# ---------------------------------------------------------------------- f. broker restart


@pytest.mark.slow
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


async def test_unreachable_broker_is_broker_unavailable() -> None:
    made = RabbitMQ("amqp://guest:guest@127.0.0.1:1/", "q", connect_timeout=timedelta(seconds=2))
    with pytest.raises(oncely.BrokerUnavailable):
        await made.open(1)
    producer = RabbitMQProducer("amqp://guest:guest@127.0.0.1:1/", "q")
    with pytest.raises(oncely.BrokerUnavailable):
        await producer.publish(b"{}", message_id="m")
