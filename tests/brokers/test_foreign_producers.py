"""Messages from producers oncely did not write, on each real broker (R2-R4, R20 step 6).

A foreign producer can send ids, properties and headers that are not UTF-8. Each such message
must be consumed and dead-lettered as ``rejected`` with a reason naming the field, the
messages behind it processed normally, and no two different byte strings ever read as one
key. Before, a RabbitMQ message whose ``message_id`` was not UTF-8 closed the connection on
every delivery (the queue stalled), and Redis Streams and NATS replaced the bad bytes with
U+FFFD, so ``inv-\\xff`` and ``inv-\\xfe`` became one key and the second message was acked as
a duplicate of the first without ever running.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import aio_pika
import pytest
import redis

import oncely
from oncely.brokers import (
    BrokerConsumer,
    ConsumerSettings,
    new_message_id,
    open_producer,
    open_transport,
)
from oncely.brokers.rabbitmq._delivery import client_made_id
from tests.brokers.common import remove_destinations, running, unique, wait_until
from tests.brokers.foreign import (
    header_lines,
    nats_headers,
    publish_amqp,
    publish_nats,
    read_nats_stream,
    stream_fields,
    wait_for_queue,
    xadd_raw,
)
from tests.services import NATS_URL, RABBITMQ_URL, REDIS_URL, require

pytestmark = [pytest.mark.services]

SETTINGS = ConsumerSettings(
    concurrency=4,
    poll=timedelta(milliseconds=200),
    requeue_delay=timedelta(milliseconds=200),
    max_body_bytes=64,
)


@dataclass
class Sent:
    """One foreign message: its id, correlation id and headers as raw bytes."""

    body: bytes
    message_id: bytes | None = None
    correlation_id: bytes | None = None
    headers: Sequence[tuple[bytes, bytes]] = ()


@dataclass
class Dead:
    """A dead-letter copy as read back: why, and the id's exact bytes."""

    outcome: str
    reason: str
    message_id: bytes | None
    body: bytes


@dataclass
class Broker:
    name: str
    url: str
    source: str
    publish: Callable[[Sequence[Sent]], Awaitable[None]]
    dead: Callable[[], Awaitable[list[Dead]]]
    extra: dict[str, Any] = field(default_factory=dict)


def _text(value: object) -> str:
    if isinstance(value, bytes | bytearray):
        return bytes(value).decode()
    return str(value)


def _rabbitmq(source: str) -> Broker:
    require("RabbitMQ", RABBITMQ_URL, 5672)

    async def publish(messages: Sequence[Sent]) -> None:
        await publish_amqp(
            source,
            [
                (
                    m.body,
                    {
                        "message_id": m.message_id,
                        "correlation_id": m.correlation_id,
                        "headers": {n.decode("latin-1"): v for n, v in m.headers} or None,
                    },
                )
                for m in messages
            ],
        )

    async def dead() -> list[Dead]:
        connection = await aio_pika.connect(RABBITMQ_URL)
        found: list[Dead] = []
        async with connection:
            channel = await connection.channel()
            queue = await channel.declare_queue(f"{source}.dead", passive=True)
            while (message := await queue.get(fail=False)) is not None:
                headers = message.headers or {}
                raw = headers.get("x-oncely-raw-message_id")
                found.append(
                    Dead(
                        _text(headers["x-oncely-outcome"]),
                        _text(headers["x-oncely-reason"]),
                        bytes(raw) if raw is not None else _encoded(message.message_id),
                        message.body,
                    )
                )
                await message.ack()
        return found

    return Broker("rabbitmq", RABBITMQ_URL, source, publish, dead)


def _encoded(text: str | None) -> bytes | None:
    return text.encode() if text is not None else None


def _redis(source: str) -> Broker:
    require("Redis", REDIS_URL, 6379)

    async def publish(messages: Sequence[Sent]) -> None:
        entries = [
            stream_fields(
                m.body if m.body != b"<none>" else None,
                message_id=m.message_id,
                correlation_id=m.correlation_id,
                headers=m.headers,
            )
            for m in messages
        ]
        await asyncio.to_thread(xadd_raw, source, entries)

    async def dead() -> list[Dead]:
        client = redis.Redis.from_url(REDIS_URL)
        try:
            entries = client.xrange(f"{source}.dead")
        finally:
            client.close()
        return [
            Dead(
                fields[b"x-oncely-outcome"].decode(),
                fields[b"x-oncely-reason"].decode(),
                fields.get(b"message_id"),
                fields.get(b"body", b""),
            )
            for _id, fields in entries
        ]

    return Broker("redis", REDIS_URL, source, publish, dead)


def _nats(source: str) -> Broker:
    require("NATS", NATS_URL, 4222)

    async def publish(messages: Sequence[Sent]) -> None:
        batch = [
            (
                nats_headers(
                    message_id=m.message_id, correlation_id=m.correlation_id, headers=m.headers
                ),
                m.body,
            )
            for m in messages
        ]
        await publish_nats(source, batch)

    async def dead() -> list[Dead]:
        found = []
        for block, body in await read_nats_stream(f"{source}.dead"):
            lines = dict(header_lines(block))
            raw = lines.get(b"x-oncely-raw-headers")
            if raw is not None:
                lines.update(header_lines(base64.b64decode(raw)))
            found.append(
                Dead(
                    lines[b"x-oncely-outcome"].decode(),
                    lines[b"x-oncely-reason"].decode(),
                    lines.get(b"Nats-Msg-Id"),
                    body,
                )
            )
        return found

    return Broker("nats", NATS_URL, source, publish, dead)


@pytest.fixture(params=["rabbitmq", "redis", "nats"])
async def broker(request: pytest.FixtureRequest) -> AsyncIterator[Broker]:
    source = unique(f"foreign_{request.param}")
    made = {"rabbitmq": _rabbitmq, "redis": _redis, "nats": _nats}[request.param](source)
    try:
        yield made
    finally:
        await remove_destinations(made.url, source)


class Run:
    """A consumer on ``broker`` with an in-memory inbox; ``effects`` lists what ran."""

    def __init__(self, broker: Broker) -> None:
        self.effects: list[Any] = []
        self.inbox = oncely.AsyncInbox(oncely.AsyncMemoryStore(), consumer="foreign")

        async def handler(payload: Any) -> None:
            self.effects.append(payload)

        transport = open_transport(broker.url, broker.source, group="foreign")
        self.consumer = BrokerConsumer(transport, self.inbox, handler, settings=SETTINGS)

    def settled(self, n: int) -> Callable[[], bool]:
        counts = self.consumer.counts
        return lambda: sum(counts[o.value] for o in oncely.Outcome) >= n


def _body(n: object) -> bytes:
    return json.dumps({"n": n}).encode()


async def _consume(broker: Broker, messages: Sequence[Sent]) -> Run:
    run = Run(broker)
    async with running(run.consumer):
        await wait_until(lambda: run.consumer.counts["processed"] >= 0)  # started
        await asyncio.sleep(0.5)  # the consumer declares the queue, group or stream first
        await broker.publish(messages)
        await wait_until(
            run.settled(len(messages)),
            timeout=timedelta(seconds=30),
            what=f"all {len(messages)} messages to be settled",
        )
    return run


async def test_r2_r4_ids_that_are_not_utf8_are_dead_lettered_and_never_merged(
    broker: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    """``inv-\\xff`` and ``inv-\\xfe`` (and Latin-1 "Müller-7" and "Möller-7") are four
    different ids: each is dead-lettered with a reason naming the message id and its exact
    bytes, none is acked as a duplicate of another, and the queue moves on to the good
    message behind them."""
    ids = [b"inv-\xff", b"inv-\xfe", "Müller-7".encode("latin-1"), "Möller-7".encode("latin-1")]
    messages = [Sent(_body(i), message_id=raw) for i, raw in enumerate(ids)]
    messages.append(Sent(_body("good"), message_id="Müller-7".encode()))  # UTF-8: a fine id
    caplog.set_level(logging.WARNING, logger="oncely")
    run = await _consume(broker, messages)
    counts = run.consumer.counts
    assert counts["rejected"] == 4 and counts["processed"] == 1, counts
    assert counts["duplicate"] == 0 and counts["store_unavailable"] == 0
    assert run.effects == [{"n": "good"}]
    dead = await broker.dead()
    assert sorted(d.message_id or b"" for d in dead) == sorted(ids)  # the exact bytes kept
    for copy in dead:
        assert copy.outcome == "rejected"
        assert "message id" in copy.reason and "not UTF-8" in copy.reason, copy.reason
        assert repr(copy.message_id) in copy.reason
    assert "unavailable" not in caplog.text  # RabbitMQ: no connection was lost on the way


async def test_r2_a_correlation_id_that_is_not_utf8_is_refused_by_name(broker: Broker) -> None:
    messages = [
        Sent(_body(1), message_id=b"c-1", correlation_id=b"req-\xff"),
        Sent(_body(2), message_id=b"c-2", correlation_id=b"req-2"),
    ]
    run = await _consume(broker, messages)
    assert run.effects == [{"n": 2}]
    (copy,) = await broker.dead()
    assert copy.message_id == b"c-1"
    assert "correlation" in copy.reason.lower() and "b'req-\\xff'" in copy.reason


async def test_a_header_that_is_not_utf8_does_not_stop_a_message_keyed_otherwise(
    broker: Broker,
) -> None:
    """Only what oncely reads as a key or id must be text: an application header holding
    other bytes travels on, and the message is processed under its (valid) id."""
    messages = [Sent(_body(1), message_id=b"h-1", headers=[(b"x-blob", b"\x00\xff\xfe")])]
    run = await _consume(broker, messages)
    assert run.effects == [{"n": 1}]
    assert run.consumer.counts["processed"] == 1


async def test_an_oversized_body_is_dead_lettered_before_decoding_with_its_id_logged(
    broker: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    """``max_body_bytes`` (64 here): a body over it is refused without being decoded; the
    rejected outcome names the message id in its log line (not ``key=None``)."""
    big = b"{" + b" " * 100 + b"}"
    messages = [
        Sent(big, message_id=b"big-1"),
        Sent(b"\xff not json", message_id=b"garbage-1"),
        Sent(_body(3), message_id=b"fits-1"),
    ]
    caplog.set_level(logging.INFO, logger="oncely")
    run = await _consume(broker, messages)
    assert run.effects == [{"n": 3}]
    reasons = {d.message_id: d.reason for d in await broker.dead()}
    assert "102 bytes, over the limit of 64" in reasons[b"big-1"]
    assert "undecodable body" in reasons[b"garbage-1"]
    lines = [r.getMessage() for r in caplog.records if "outcome=rejected" in r.getMessage()]
    assert any("key=big-1" in line for line in lines), lines
    assert any("key=garbage-1" in line for line in lines), lines


async def test_a_redis_entry_without_a_body_field_says_so() -> None:
    require("Redis", REDIS_URL, 6379)
    source = unique("foreign_redis_nobody")
    broker = _redis(source)
    try:
        run = await _consume(broker, [Sent(b"<none>", message_id=b"nobody-1")])
        assert run.effects == []
        (copy,) = await broker.dead()
        assert "no 'body' field" in copy.reason, copy.reason
    finally:
        await remove_destinations(REDIS_URL, source)


# ---------------------------------------------------------------------- ids aio-pika made up
#
# aiormq (under aio-pika and FastStream) gives every message published without a message_id
# one of its own, uuid4().hex, new on every publish: a producer's retry looked like a new
# message and was processed twice. Such an id is refused as no producer's (R2-R4) where the
# key is read from the message id, unless trust_hex_message_ids says the producers mint it.


async def _publish_aio_pika(source: str, messages: Sequence[aio_pika.Message]) -> None:
    """Publish ``messages`` to ``source`` as an aio-pika producer does (confirmed)."""
    connection = await aio_pika.connect(RABBITMQ_URL)
    async with connection:
        channel = await connection.channel()
        for message in messages:
            await channel.default_exchange.publish(message, routing_key=source)


async def _dead_copies(source: str) -> list[tuple[str | None, dict[str, Any]]]:
    """The dead-letter copies of ``source``: each one's message id and headers (as text)."""
    connection = await aio_pika.connect(RABBITMQ_URL)
    found: list[tuple[str | None, dict[str, Any]]] = []
    async with connection:
        channel = await connection.channel()
        queue = await channel.declare_queue(f"{source}.dead", passive=True)
        while (message := await queue.get(fail=False)) is not None:
            headers = {name: _text(v) for name, v in (message.headers or {}).items()}
            found.append((message.message_id, headers))
            await message.ack()
    return found


async def _consume_aio_pika(
    source: str,
    messages: Sequence[aio_pika.Message],
    *,
    url: str = RABBITMQ_URL,
    key: oncely.KeySource | None = None,
) -> tuple[BrokerConsumer, list[Any]]:
    require("RabbitMQ", RABBITMQ_URL, 5672)
    effects: list[Any] = []

    async def handler(payload: Any) -> None:
        effects.append(payload)

    inbox = oncely.AsyncInbox(oncely.AsyncMemoryStore(), consumer="foreign")
    transport = open_transport(url, source, group="foreign")
    consumer = BrokerConsumer(transport, inbox, handler, key=key, settings=SETTINGS)
    async with running(consumer):
        await asyncio.to_thread(wait_for_queue, source)  # the consumer declares it
        await _publish_aio_pika(source, messages)
        await wait_until(
            lambda: sum(consumer.counts[o.value] for o in oncely.Outcome) >= len(messages),
            timeout=timedelta(seconds=30),
            what=f"all {len(messages)} messages to be settled",
        )
    return consumer, effects


@pytest.fixture
async def rabbit_source() -> AsyncIterator[str]:
    source = unique("foreign_hex")
    try:
        yield source
    finally:
        await remove_destinations(RABBITMQ_URL, source)


async def test_r2_r4_a_retry_published_by_aio_pika_without_an_id_is_not_processed_twice(
    rabbit_source: str,
) -> None:
    """A user's repro: the same body published twice with aio-pika and no message id was
    processed twice (each copy got its own made-up id). Both are dead-lettered as
    ``rejected`` with a reason naming the fixes; each copy keeps the id it came with and
    says it was made up."""
    body = b'{"id": "x"}'
    consumer, effects = await _consume_aio_pika(
        rabbit_source, [aio_pika.Message(body), aio_pika.Message(body)]
    )
    counts = consumer.counts
    assert effects == [] and counts["processed"] == 0, (effects, counts)
    assert counts["rejected"] == 2, counts
    copies = await _dead_copies(rabbit_source)
    assert len(copies) == 2
    for message_id, headers in copies:
        assert message_id is not None and len(message_id) == 32  # kept as it came
        assert headers["x-oncely-outcome"] == "rejected"
        reason = headers["x-oncely-reason"]
        assert repr(message_id) in reason and "aio-pika" in reason, reason
        assert "new_message_id()" in reason and "trust_hex_message_ids=true" in reason
        assert (
            headers["x-oncely-no-message-id"]
            == "the original had no message_id; this one is made up"
        )


async def test_r2_a_made_up_id_is_refused_only_where_the_key_falls_through_to_it(
    rabbit_source: str,
) -> None:
    """Keyed by ``FirstOf(header, message id)``: a message carrying the header is keyed by it
    whatever its made-up id (its retry is a duplicate); one without falls through to the
    made-up id and is refused, the reason naming both sources."""

    def order(n: str, **headers: Any) -> aio_pika.Message:
        return aio_pika.Message(json.dumps({"order": n}).encode(), headers=headers or None)

    consumer, effects = await _consume_aio_pika(
        rabbit_source,
        [order("1", **{"x-order": "o-1"}), order("1", **{"x-order": "o-1"}), order("2")],
        key=oncely.FirstOf(oncely.HeaderKey("x-order"), oncely.MessageIdKey()),
    )
    counts = consumer.counts
    assert effects == [{"order": "1"}], effects
    assert counts["processed"] == 1 and counts["duplicate"] == 1 and counts["rejected"] == 1
    ((_id, headers),) = await _dead_copies(rabbit_source)
    reason = headers["x-oncely-reason"]
    assert "'x-order' header" in reason and "aio-pika" in reason, reason


async def test_r2_trust_hex_message_ids_takes_such_an_id_as_the_producers(
    rabbit_source: str,
) -> None:
    """``?trust_hex_message_ids=true``: producers that mint uuid4 hex ids themselves (here
    oncely's producer, told the same) are keyed by them, a retry is a duplicate."""
    trusted = RABBITMQ_URL + "?trust_hex_message_ids=true"
    minted = uuid.uuid4().hex
    producer = open_producer(trusted, rabbit_source)
    try:
        await producer.publish(b'{"n": 1}', message_id=minted)
        await producer.publish(b'{"n": 1}', message_id=minted)
    finally:
        await producer.close()
    consumer, effects = await _consume_aio_pika(rabbit_source, [], url=trusted)
    await wait_until(lambda: consumer.counts["duplicate"] >= 1, what="the retry")
    assert effects == [{"n": 1}]
    assert consumer.counts["processed"] == 1 and consumer.counts["rejected"] == 0


async def test_r2_oncely_producer_never_sends_an_id_of_the_made_up_shape() -> None:
    """``new_message_id()`` never has the shape; a caller's uuid4 hex id is refused at publish
    (every consumer would dead-letter it) unless the producer is told it is trusted."""
    assert all(not client_made_id(new_message_id()) for _ in range(1000))
    assert client_made_id(uuid.uuid4().hex)
    assert not client_made_id(uuid.uuid4().hex.upper())
    assert not client_made_id(uuid.uuid1().hex)  # version 1: no client makes it up
    producer = open_producer(RABBITMQ_URL, unique("foreign_hex_never_declared"))
    try:
        with pytest.raises(oncely.ConfigurationError, match="trust_hex_message_ids"):
            await producer.publish(b"{}", message_id=uuid.uuid4().hex)
    finally:
        await producer.close()
