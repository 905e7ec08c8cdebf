"""NATS JetStream end to end, against a real nats-server: every scenario ends with each logical
message's effect applied exactly once (a ledger row per effect, no unique constraint), nothing
lost, and the durable consumer holding nothing pending or unacknowledged.

Two inbox flavours: the transactional mode on PostgreSQL (the ledger row is written in the
marker's transaction) and the two-phase mode on Redis. The restart tests run a private
nats-server of their own (a port and store directory per test), never the shared one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import nats
import nats.js.errors
import pytest
import redis.asyncio as aioredis

import oncely
from oncely.brokers import (
    Backoff,
    BrokerConsumer,
    ConsumerSettings,
    cloudevent_headers,
    open_producer,
    open_transport,
)
from oncely.brokers.nats import JetStream, JetStreamProducer
from tests.brokers.common import (
    Ledger,
    drop_store_table,
    pg_store,
    require_postgres,
    running,
    unique,
    wait_until,
)
from tests.services import NATS_URL, REDIS_URL, REQUIRED, require

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


@pytest.fixture
async def world() -> AsyncIterator[World]:
    need_services()
    w = World(NATS_URL, unique("oncely_nats"))
    w.ledger.create()
    try:
        yield w
    finally:
        for closer in w.closers:
            await closer.close()
        for inbox in w.inboxes:
            await inbox.aclose()
        await delete_streams(w.url, w.base)
        w.ledger.drop()
        for table in w.tables:
            drop_store_table(table)
        for prefix in w.prefixes:
            await drop_redis_prefix(prefix)


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
    by_id = {headers.get("Nats-Msg-Id"): (headers, data) for headers, data in dead}
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
    assert headers["Nats-Msg-Id"] == "always" and json.loads(data) == {"id": "always"}
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


async def test_stop_gives_back_fetched_messages_no_handler_started(world: World) -> None:
    """Messages fetched from the server but never handed to a handler are given back (-NAK)
    at a graceful stop, so another consumer gets them at once rather than after ack_wait; the
    delivery whose handler is running is left alone and settled after the stop."""
    ack_wait = timedelta(seconds=60)
    producer = world.producer()
    first = world.transport(ack_wait=ack_wait)
    world.closers.append(first)
    await first.open(8)
    await producer.publish(body("started"), message_id="started")
    [started] = await first.fetch(8, timedelta(milliseconds=500))  # its handler "runs"
    # A fetch abandoned while it waits leaves its pull request open: what arrives for it
    # lands in nats-py's buffer, fetched from the server and never handed out.
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(first.fetch(8, timedelta(seconds=30)), 0.3)
    keys = [f"buffered-{i}" for i in range(3)]
    for key in keys:
        await producer.publish(body(key), message_id=key)

    async def some_buffered() -> bool:
        unacked, undelivered = await consumer_state(world.url, world.stream, world.group)
        return unacked >= 2 and unacked + undelivered == 1 + len(keys)

    await wait_until(some_buffered, what="messages delivered to the first consumer's buffer")
    await asyncio.sleep(0.2)  # let whatever else the server sends for that pull arrive
    await first.stop()
    second = BrokerConsumer(
        world.transport(ack_wait=ack_wait),
        world.pg_inbox(),
        world.in_tx,
        mode="transactional",
        settings=settings(),
    )
    async with running(second):
        # Far sooner than ack_wait (60 s): given back, not left to time out.
        await wait_until(
            world.has(len(keys)), timeout=timedelta(seconds=15), what="the buffered messages"
        )
        await started.ack()  # the running handler finishes after the stop
        await wait_until(world.settled, what="nothing pending")
    assert world.ledger.counts() == dict.fromkeys(keys, 1)  # "started" was never given back
    assert second.counts["processed"] == len(keys)


# ---------------------------------------------------------------------------- f. restarts


class PrivateNats:
    """A nats-server of this test's own: a free port and a store directory that outlive a
    kill, so the stream and the consumer's state survive a restart."""

    def __init__(self, store: Path) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.store = store
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> None:
        binary = shutil.which("nats-server")
        assert binary is not None
        self.proc = subprocess.Popen(
            [binary, "-js", "-a", "127.0.0.1", "-p", str(self.port), "-sd", str(self.store)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 20
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), 0.5):
                    return
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise AssertionError("the private nats-server did not start") from None
                time.sleep(0.05)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
            self.proc.wait(10)
        self.proc = None


@pytest.fixture
def private_nats(tmp_path: Path) -> Iterator[PrivateNats]:
    if shutil.which("nats-server") is None:
        reason = "nats-server is not installed; the restart tests run a private one"
        if REQUIRED:
            pytest.fail(reason)
        pytest.skip(reason)
    server = PrivateNats(tmp_path / "jetstream")
    server.start()
    try:
        yield server
    finally:
        server.kill()


async def publish_retrying(producer: JetStreamProducer, key: str) -> None:
    """What a producer does when the broker is away: retry with the same id (R2)."""
    while True:
        try:
            await producer.publish(body(key), message_id=key)
            return
        except oncely.BrokerUnavailable:
            await asyncio.sleep(0.1)


@pytest.mark.slow
async def test_f_server_killed_and_restarted_mid_run(
    private_nats: PrivateNats, world: World
) -> None:
    world.url = private_nats.url
    producer = world.producer()
    first = [f"k{i:03}" for i in range(60)]
    for key in first:
        await publish_retrying(producer, key)

    async def handler(tx: Any, payload: dict[str, Any]) -> None:
        await asyncio.sleep(0.02)
        await world.in_tx(tx, payload)

    transport = world.transport(ack_wait=timedelta(seconds=2))
    consumer = BrokerConsumer(
        transport, world.pg_inbox(), handler, mode="transactional", settings=settings()
    )
    async with running(consumer):
        await wait_until(world.has(15), what="a quarter of the messages")
        private_nats.kill(signal.SIGKILL)
        await wait_until(lambda: not transport.connected, what="the consumer to notice")
        await asyncio.sleep(0.5)  # a few fetches fail while the server is away
        private_nats.start()
        later = [f"k{i:03}" for i in range(60, 80)]
        for key in later:
            await publish_retrying(producer, key)
        await wait_until(world.has(80), what="every message after the restart")
        await wait_until(world.settled, what="nothing pending")
    assert world.ledger.counts() == dict.fromkeys(first + later, 1)
    assert consumer.counts["processed"] == 80


@pytest.mark.slow
async def test_f_fetch_and_ack_on_a_dropped_connection(
    private_nats: PrivateNats, world: World
) -> None:
    """An empty fetch returns []; with the server gone, fetch and ack raise BrokerUnavailable
    (never a raw client error, never a silent buffer); after the restart the unacknowledged
    message comes back and is acknowledged."""
    world.url = private_nats.url
    transport = world.transport(ack_wait=timedelta(seconds=1))
    await transport.open(4)
    try:
        assert await transport.fetch(4, timedelta(milliseconds=300)) == []
        producer = world.producer()
        await producer.publish(body("x"), message_id="x")
        [delivery] = await transport.fetch(4, timedelta(seconds=2))
        assert delivery.envelope.message_id == "x" and delivery.delivery_count == 1
        assert "stream_seq" in delivery.describe()
        private_nats.kill(signal.SIGTERM)
        await wait_until(lambda: not transport.connected, what="the connection to drop")
        with pytest.raises(oncely.BrokerUnavailable):
            await delivery.ack()
        with pytest.raises(oncely.BrokerUnavailable):
            await transport.fetch(4, timedelta(milliseconds=300))
        private_nats.start()
        again: list[Any] = []

        async def redelivered() -> bool:
            with contextlib.suppress(oncely.BrokerUnavailable):
                again.extend(await transport.fetch(4, timedelta(milliseconds=300)))
            return bool(again)

        await wait_until(redelivered, what="the redelivery")
        [copy] = again
        assert copy.envelope.message_id == "x" and (copy.delivery_count or 0) >= 2
        await copy.ack()
        await wait_until(world.settled, what="nothing pending")
    finally:
        await transport.close()
