"""R16, distributed tracing: a message followed across services with OpenTelemetry, on real
brokers, with the real SDK recording the spans in memory (``InMemorySpanExporter``).

A producer's publish (``open_producer(..., tracing=...)``) is a PRODUCER span whose context
travels in the message's headers; the consumer's span per delivery (``BrokerConsumer(...,
tracing=...)``) continues it, and the handler runs under that span. Off (the default), oncely
imports nothing of OpenTelemetry.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest

pytest.importorskip("opentelemetry.sdk")

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

import oncely
from oncely._core.observe import key_for_logs
from oncely.brokers import (
    Backoff,
    BrokerConsumer,
    ConsumerSettings,
    open_producer,
    open_transport,
)
from oncely.tracing import TracedProducer, inject
from tests.brokers.common import remove_destinations, running, unique, wait_until
from tests.brokers.kafka_broker import create_topic, kafka_url
from tests.brokers.sqs_broker import create_queue, sqs_url
from tests.services import NATS_URL, RABBITMQ_URL, REDIS_URL, require

pytestmark = pytest.mark.services

MS = timedelta(milliseconds=1)
SETTINGS = ConsumerSettings(
    concurrency=4,
    requeue_delay=200 * MS,
    backoff=Backoff(first=50 * MS, most=200 * MS),
    max_deliveries=2,
    poll=200 * MS,
    reconnect=Backoff(first=100 * MS, most=500 * MS),
    shutdown_grace=timedelta(seconds=10),
)

SYSTEMS = {"sqs": "aws_sqs"}
"""OpenTelemetry's name of a broker, where it is not oncely's."""

BROKERS = {
    "rabbitmq": (RABBITMQ_URL, 5672),
    "redis-streams": (REDIS_URL, 6379),
    "nats": (NATS_URL, 4222),
}


@dataclass
class Broker:
    name: str
    url: str
    source: str

    def transport(self) -> Any:
        if self.name == "kafka":  # a group of its own: a Kafka group spans topics
            from oncely.brokers.kafka import Kafka

            return Kafka(
                self.url,
                self.source,
                group=unique("otel_billing"),
                session_timeout=timedelta(seconds=6),
                revoke_grace=timedelta(seconds=5),
            )
        options: dict[str, Any] = {}
        if self.name != "rabbitmq":
            options["ack_wait"] = timedelta(seconds=5)
        return open_transport(self.url, self.source, group="otel_billing", **options)


@pytest.fixture(params=["rabbitmq", "redis-streams", "sqs"])
async def broker(request: pytest.FixtureRequest) -> AsyncIterator[Broker]:
    """RabbitMQ, Redis Streams and SQS (moto's server; it reads in batches by default)."""
    async for made in _broker(request.param):
        yield made


@pytest.fixture(params=["rabbitmq", "redis-streams", "nats", "sqs", "kafka"])
async def any_broker(request: pytest.FixtureRequest) -> AsyncIterator[Broker]:
    """RabbitMQ, Redis Streams, NATS JetStream, SQS and Kafka (Tansu; its headers are
    bytes)."""
    async for made in _broker(request.param):
        yield made


async def _broker(name: str) -> AsyncIterator[Broker]:
    source = unique("otel")
    if name == "sqs":
        url = sqs_url()
        create_queue(source)
    elif name == "kafka":
        url = kafka_url()
        create_topic(source, 2)
    else:
        url, port = BROKERS[name]
        require(name, url, port)
    made = Broker(name, url, source)
    try:
        yield made
    finally:
        await remove_destinations(url, made.source)


@pytest.fixture
def spans() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    """A tracer provider of the real SDK whose spans end up in memory."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider, exporter
    provider.shutdown()


def inbox(**options: Any) -> oncely.AsyncInbox:
    return oncely.AsyncInbox(oncely.AsyncMemoryStore(), consumer="otel_billing", **options)


def named(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [span for span in exporter.get_finished_spans() if span.name == name]


def consumer_spans(exporter: InMemorySpanExporter, broker: Broker) -> list[ReadableSpan]:
    return named(exporter, f"process {broker.source}")


def body(key: str) -> bytes:
    return json.dumps({"k": key}).encode()


async def consumed(
    consumer: BrokerConsumer,
    exporter: InMemorySpanExporter,
    broker: Broker,
    until: Any,
) -> list[ReadableSpan]:
    """Run ``consumer`` until ``until(consumer spans)`` holds; the consumer spans then."""
    async with running(consumer):
        await wait_until(
            lambda: until(consumer_spans(exporter, broker)), what="the consumer's spans"
        )
    return consumer_spans(exporter, broker)


def parent_of(span: ReadableSpan) -> int | None:
    return None if span.parent is None else span.parent.span_id


@pytest.mark.parametrize("batch", [1, 5], ids=["one_by_one", "batches"])
async def test_r16_a_consumer_span_continues_the_producers_trace_and_holds_the_handlers(
    any_broker: Broker,
    spans: tuple[TracerProvider, InMemorySpanExporter],
    batch: int,
) -> None:
    """A message published under a span of the producing service is processed in a CONSUMER
    span, ``process <destination>``, child of the producer's ``send`` span (itself a child
    of the service's span): one trace across the broker. The handler runs under it, so a
    span it makes is its child, each message's under its own span in a batch as well."""
    broker = any_broker
    provider, exporter = spans
    app = provider.get_tracer("the-shop")
    producer = open_producer(broker.url, broker.source, tracing=provider)
    keys = [f"order-{i}" for i in range(3)]
    try:
        with app.start_as_current_span("checkout"):
            for key in keys:
                await producer.publish(body(key), message_id=key, correlation_id=f"c-{key}")
    finally:
        await producer.close()

    async def charge(payload: dict[str, str]) -> None:
        with app.start_as_current_span(f"charge {payload['k']}"):
            await asyncio.sleep(0.01)  # the batch's handlers overlap

    consumer = BrokerConsumer(
        broker.transport(),
        inbox(),
        charge,
        settings=dataclasses.replace(SETTINGS, batch=batch),
        tracing=provider,
    )
    processed = await consumed(consumer, exporter, broker, lambda found: len(found) == 3)

    (checkout,) = named(exporter, "checkout")
    sends = {
        span.attributes["messaging.message.id"]: span
        for span in named(exporter, f"send {broker.source}")
    }
    assert set(sends) == set(keys)
    for span in processed:
        attributes = span.attributes
        key = attributes["oncely.key"]
        send = sends[key]
        assert span.kind is SpanKind.CONSUMER
        assert span.context.trace_id == checkout.context.trace_id
        assert parent_of(span) == send.context.span_id
        assert parent_of(send) == checkout.context.span_id
        assert send.kind is SpanKind.PRODUCER
        assert dict(attributes) == {
            "messaging.system": SYSTEMS.get(broker.name, broker.name),
            "messaging.destination.name": broker.source,
            "messaging.operation.type": "process",
            "messaging.operation.name": "process",
            "messaging.message.id": key,
            "messaging.message.conversation_id": f"c-{key}",
            "oncely.consumer": "otel_billing",
            "oncely.key": key,
            "oncely.outcome": "processed",
            "oncely.attempt": 1,
            "oncely.broker_action": "ack",
            **({"oncely.deliveries": 1} if "oncely.deliveries" in attributes else {}),
        }
        assert span.status.status_code is StatusCode.UNSET
        (inner,) = named(exporter, f"charge {key}")
        assert parent_of(inner) == span.context.span_id, "the handler's span is not nested"


async def test_r16_a_copy_of_a_message_gives_a_duplicate_span(
    broker: Broker, spans: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    """A producer's retry (the same message id again) is a second delivery: its span says
    ``duplicate``, acknowledged, in the same trace as the first."""
    provider, exporter = spans
    producer = open_producer(broker.url, broker.source, tracing=provider)
    try:
        with provider.get_tracer("the-shop").start_as_current_span("checkout"):
            for _ in range(2):
                await producer.publish(body("order-1"), message_id="order-1")
    finally:
        await producer.close()
    ran: list[object] = []

    async def charge(payload: object) -> None:
        ran.append(payload)

    consumer = BrokerConsumer(
        broker.transport(), inbox(), charge, settings=SETTINGS, tracing=provider
    )
    found = await consumed(consumer, exporter, broker, lambda found: len(found) == 2)
    assert len(ran) == 1
    assert sorted(span.attributes["oncely.outcome"] for span in found) == ["duplicate", "processed"]
    assert {span.attributes["oncely.broker_action"] for span in found} == {"ack"}
    assert len({span.context.trace_id for span in found}) == 1


async def test_r16_a_failing_handler_span_is_an_error_and_the_last_one_dead_letters(
    broker: Broker, spans: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    """Each failed delivery's span has status ERROR with the reason and the handler's
    exception recorded; after ``max_deliveries`` the span's broker action is ``dead_letter``."""
    provider, exporter = spans
    producer = open_producer(broker.url, broker.source, tracing=provider)
    try:
        await producer.publish(body("order-9"), message_id="order-9")
    finally:
        await producer.close()

    async def charge(payload: object) -> None:
        raise RuntimeError("the card was declined")

    consumer = BrokerConsumer(
        broker.transport(), inbox(), charge, settings=SETTINGS, tracing=provider
    )
    found = await consumed(
        consumer,
        exporter,
        broker,
        lambda found: any(s.attributes["oncely.broker_action"] == "dead_letter" for s in found),
    )
    assert [span.attributes["oncely.broker_action"] for span in found] == ["retry", "dead_letter"]
    for span in found:
        assert span.attributes["oncely.outcome"] == "failed"
        assert span.status.status_code is StatusCode.ERROR
        assert "the card was declined" in (span.status.description or "")
        (event,) = [e for e in span.events if e.name == "exception"]
        assert event.attributes["exception.type"] == "RuntimeError"
        assert event.attributes["exception.message"] == "the card was declined"
    assert str(found[-1].attributes["oncely.reason"]).startswith("failed on all 2 deliveries")


async def test_r16_under_hashed_log_keys_no_span_shows_the_key(
    broker: Broker, spans: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    """With the inbox's ``log_keys="hash"`` (keys that are personal data), the consumer's
    spans show the key and the message id hashed, as its log lines do; so does a producer
    made with ``log_keys="hash"``. The context reaches the consumer whichever way it was put
    in the headers (here :func:`oncely.tracing.inject` for one message)."""
    provider, exporter = spans
    secret = "alice@example.com"
    raw = open_producer(broker.url, broker.source)
    producer = TracedProducer(
        raw, system=broker.name, destination=broker.source, tracing=provider, log_keys="hash"
    )
    try:
        with provider.get_tracer("the-shop").start_as_current_span("signup"):
            await producer.publish(body(secret), message_id=secret)
            await raw.publish(body("bob"), message_id=f"{secret}/2", headers=inject({"x": "1"}))
    finally:
        await producer.close()

    async def welcome(payload: object) -> None:
        raise RuntimeError("mail server down")

    consumer = BrokerConsumer(
        broker.transport(), inbox(log_keys="hash"), welcome, settings=SETTINGS, tracing=provider
    )
    await consumed(consumer, exporter, broker, lambda found: len(found) >= 3)
    every = exporter.get_finished_spans()
    (signup,) = named(exporter, "signup")
    for span in every:
        assert span.context.trace_id == signup.context.trace_id
        for value in span.attributes.values():
            assert secret not in str(value), f"{span.name} shows the key"
        for event in span.events:
            for value in (event.attributes or {}).values():
                assert secret not in str(value)
    shown = {span.attributes.get("oncely.key") for span in consumer_spans(exporter, broker)}
    assert all(str(key).startswith("h:") for key in shown)


async def test_r16_under_hashed_log_keys_an_error_naming_the_key_shows_it_hashed_in_spans(
    broker: Broker, spans: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    """A handler's error whose text names the key (as a store's ``LeaseLost`` does): under
    ``log_keys="hash"`` the span's reason, status and exception event (message and stack
    trace) show it hashed, as the log lines do; the error's type stays."""
    provider, exporter = spans
    secret = "carol@example.com"
    raw = open_producer(broker.url, broker.source)
    try:
        await raw.publish(body(secret), message_id=secret)
    finally:
        await raw.close()

    async def welcome(payload: dict[str, str]) -> None:
        raise RuntimeError(f"no mailbox for {payload['k']}")

    consumer = BrokerConsumer(
        broker.transport(), inbox(log_keys="hash"), welcome, settings=SETTINGS, tracing=provider
    )
    found = await consumed(consumer, exporter, broker, lambda found: len(found) >= 2)
    for span in found:
        assert secret not in str(span.status.description), span.status.description
        for value in span.attributes.values():
            assert secret not in str(value), f"{span.name} shows the key"
        for event in span.events:
            for value in (event.attributes or {}).values():
                assert secret not in str(value), value
    hashed = key_for_logs(secret, "hash")
    events = [e for span in found for e in span.events if e.name == "exception"]
    assert events and all(e.attributes["exception.type"] == "RuntimeError" for e in events)
    assert all(e.attributes["exception.message"] == f"no mailbox for {hashed}" for e in events)
    assert all(
        f"no mailbox for {hashed}" in str(e.attributes["exception.stacktrace"]) for e in events
    )


def test_r16_with_tracing_off_oncely_imports_nothing_of_opentelemetry() -> None:
    """A consumer and a producer without tracing, run to the end of a message on RabbitMQ
    in a process of their own: no ``opentelemetry`` module is imported (tracing off costs
    nothing, not even the import)."""
    require("RabbitMQ", RABBITMQ_URL, 5672)
    source = unique("otel_off")
    script = f"""
import asyncio, sys
from datetime import timedelta
import oncely, oncely.tracing
from oncely.brokers import BrokerConsumer, ConsumerSettings, open_producer, open_transport

async def main():
    producer = open_producer({RABBITMQ_URL!r}, {source!r})
    await producer.publish(b'{{"k": 1}}', message_id="m-1")
    await producer.close()
    inbox = oncely.AsyncInbox(oncely.AsyncMemoryStore(), consumer="otel_off")
    seen = []
    async def handler(payload):
        seen.append(payload)
        consumer.stop()
    consumer = BrokerConsumer(
        open_transport({RABBITMQ_URL!r}, {source!r}, group="otel_off"), inbox, handler,
        settings=ConsumerSettings(poll=timedelta(milliseconds=100)),
    )
    await asyncio.wait_for(consumer.run(), 60)
    assert seen == [{{"k": 1}}], seen
    assert consumer.counts["processed"] == 1, consumer.counts

asyncio.run(main())
loaded = sorted(name for name in sys.modules if name.startswith("opentelemetry"))
assert not loaded, loaded
print("ok")
"""
    try:
        done = subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(["src", "."])},
            check=False,
        )
    finally:
        asyncio.run(remove_destinations(RABBITMQ_URL, source))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_r16_tracing_refuses_what_is_no_tracer_provider() -> None:
    with pytest.raises(oncely.ConfigurationError, match="TracerProvider"):
        BrokerConsumer(
            open_transport(RABBITMQ_URL, "otel_never", group="otel"),
            inbox(),
            lambda payload: None,
            tracing="yes",  # type: ignore[arg-type]
        )


@pytest.mark.parametrize("batch", [1, 5], ids=["one_by_one", "batches"])
async def test_r16_a_transactional_handler_runs_under_its_messages_span(
    broker: Broker,
    spans: tuple[TracerProvider, InMemorySpanExporter],
    batch: int,
    tmp_path: Any,
) -> None:
    """In the transactional mode (a batch's messages each in a transaction of their own),
    each handler runs under its own message's span too."""
    provider, exporter = spans
    app = provider.get_tracer("the-shop")
    producer = open_producer(broker.url, broker.source, tracing=provider)
    keys = [f"order-{i}" for i in range(3)]
    try:
        for key in keys:
            await producer.publish(body(key), message_id=key)
    finally:
        await producer.close()

    async def book(tx: Any, payload: dict[str, str]) -> None:
        with app.start_as_current_span(f"book {payload['k']}"):
            await tx.execute("CREATE TABLE IF NOT EXISTS ledger (k TEXT)")
            await tx.execute("INSERT INTO ledger VALUES (?)", (payload["k"],))

    store = oncely.AsyncSQLiteStore(str(tmp_path / "inbox.db"))
    consumer = BrokerConsumer(
        broker.transport(),
        oncely.AsyncInbox(store, consumer="otel_billing"),
        book,
        mode="transactional",
        settings=dataclasses.replace(SETTINGS, batch=batch),
        tracing=provider,
    )
    try:
        found = await consumed(consumer, exporter, broker, lambda found: len(found) == 3)
    finally:
        await store.aclose()
    for span in found:
        assert span.attributes["oncely.outcome"] == "processed"
        (inner,) = named(exporter, f"book {span.attributes['oncely.key']}")
        assert parent_of(inner) == span.context.span_id
        assert inner.context.trace_id == span.context.trace_id


async def test_r16_a_long_key_claimed_hashed_runs_its_handler_under_its_span(
    broker: Broker, spans: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    """In a batch, a key over ``Limits.max_key_bytes`` that the inbox claims hashed
    (``hash_long_keys``) still runs its handler under its own message's span."""
    provider, exporter = spans
    app = provider.get_tracer("the-shop")
    keys = [f"{'x' * 40}-{i}" for i in range(2)]
    producer = open_producer(broker.url, broker.source, tracing=provider)
    try:
        for key in keys:
            await producer.publish(body(key), message_id=key)
    finally:
        await producer.close()

    async def charge(payload: dict[str, str]) -> None:
        with app.start_as_current_span(f"charge {payload['k']}"):
            pass

    consumer = BrokerConsumer(
        broker.transport(),
        inbox(limits=oncely.Limits(max_key_bytes=32, hash_long_keys=True)),
        charge,
        settings=dataclasses.replace(SETTINGS, batch=5),
        tracing=provider,
    )
    found = await consumed(consumer, exporter, broker, lambda found: len(found) == 2)
    for key in keys:
        (inner,) = named(exporter, f"charge {key}")
        (outer,) = [s for s in found if parent_of(inner) == s.context.span_id]
        assert outer.attributes["messaging.message.id"] == key
        assert str(outer.attributes["oncely.key"]).startswith("sha256:")


def test_r16_tracing_without_opentelemetry_says_which_extra_installs_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Tracing asked for where OpenTelemetry's API is not installed: an error naming
    ``oncely[otel]`` when the consumer or producer is made, not an ImportError later."""
    for name in [name for name in sys.modules if name.startswith("opentelemetry")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "opentelemetry", None)
    transport = open_transport(RABBITMQ_URL, "otel_never", group="otel")
    with pytest.raises(oncely.ConfigurationError, match=r"oncely\[otel\]"):
        BrokerConsumer(transport, inbox(), lambda payload: None, tracing=True)
    with pytest.raises(oncely.ConfigurationError, match=r"oncely\[otel\]"):
        open_producer(RABBITMQ_URL, "otel_never", tracing=True)
    with pytest.raises(oncely.ConfigurationError, match=r"oncely\[otel\]"):
        inject({})
