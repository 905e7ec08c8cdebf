"""Broker adapters: a consumer is a handler plus a few lines.

::

    import oncely
    from oncely.brokers import BrokerConsumer, open_transport

    inbox = oncely.AsyncInbox(oncely.open_async("postgresql://..."), consumer="billing")
    transport = open_transport("amqp://guest:guest@localhost/", "payments", group="billing")
    await BrokerConsumer(transport, inbox, charge).run(handle_signals=True)

=====================  ===========================================  =======================
URL                    transport (extra)                            ``source`` is
=====================  ===========================================  =======================
``amqp://``            :class:`~oncely.brokers.rabbitmq.RabbitMQ`   a queue (quorum, with a
                       (``oncely[rabbitmq]``)                       dead-letter exchange)
``redis://``           :class:`~oncely.brokers.redis_streams.        a stream, read by the
                       RedisStreams` (``oncely[redis]``)            consumer group ``group``
``nats://``            :class:`~oncely.brokers.nats.JetStream`      a subject of a stream,
                       (``oncely[nats]``)                           read by the durable
                                                                    pull consumer ``group``
``kafka://``           :class:`~oncely.brokers.kafka.Kafka`         a topic, read by the
                       (``oncely[kafka]``)                          consumer group ``group``
``sqs://``             :class:`~oncely.brokers.sqs.SQS`             a queue (standard or
                       (``oncely[sqs]``)                            FIFO)
=====================  ===========================================  =======================

Every transport has the same shape (:mod:`oncely.brokers._shape`); producers
(:func:`open_producer`) publish with a stable message id so producer retries are recognisable
downstream (R2, R14). Kafka is tested on Tansu, a Kafka-protocol broker, not on Apache Kafka
itself; SQS on moto's server (the SQS API), not on AWS. Azure Service Bus has no adapter: an
adapter that was never run against something that speaks the broker's protocol is not
shipped.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from datetime import timedelta
from typing import Literal, Protocol, cast

from oncely._urls import load_by_scheme
from oncely.brokers._consumer import (
    BrokerConsumer,
    InboxProcessor,
    Processor,
    UndecodableBody,
    decode_body,
)
from oncely.brokers._shape import (
    Backoff,
    BrokerLimits,
    ConsumerSettings,
    DeadLetter,
    Delivery,
    Transport,
)
from oncely.errors import ConfigurationError
from oncely.keys import key_source
from oncely.tracing import TracedProducer, Tracing

__all__ = [
    "Backoff",
    "BrokerConsumer",
    "BrokerLimits",
    "ConsumerSettings",
    "DeadLetter",
    "Delivery",
    "InboxProcessor",
    "Processor",
    "Producer",
    "Transport",
    "UndecodableBody",
    "cloudevent_headers",
    "decode_body",
    "key_source",
    "new_message_id",
    "open_producer",
    "open_transport",
]


class Producer(Protocol):
    """Publishes messages with a stable, producer-assigned message id (R2).

    Retrying a publish with the *same* ``message_id`` is what makes a producer retry a
    duplicate that consumers recognise; a new id per attempt would make it a new message.
    """

    async def publish(
        self,
        body: bytes,
        *,
        message_id: str,
        headers: Mapping[str, str] | None = None,
        content_type: str = "application/json",
        correlation_id: str | None = None,
    ) -> None:
        """Publish ``body`` and return once the broker has confirmed it (publisher confirm,
        JetStream ack, XADD reply). Raises :class:`~oncely.BrokerUnavailable`; retrying
        with the same ``message_id`` is then safe."""
        ...

    async def close(self) -> None: ...


def new_message_id() -> str:
    """A fresh message id for a new logical message: create it once, before the first
    publish attempt, and reuse it on every retry."""
    return str(uuid.uuid4())


_CE_PREFIXES: dict[str, str] = {
    "http": "ce-",
    "nats": "ce-",
    "kafka": "ce_",
    "amqp": "cloudEvents_",
}
"""The binary-mode header prefix of each protocol binding the producers speak."""


def cloudevent_headers(
    *,
    source: str,
    event_type: str,
    event_id: str | None = None,
    subject: str | None = None,
    binding: Literal["http", "nats", "kafka", "amqp"] = "http",
) -> dict[str, str]:
    """Binary-mode CloudEvents attributes as headers (R3), named as ``binding`` names them:
    ``ce-`` for ``"http"`` (the default) and ``"nats"``, ``ce_`` for ``"kafka"``,
    ``cloudEvents_`` for ``"amqp"`` (RabbitMQ). The consumer's :class:`~oncely.CloudEventsKey`
    reads ``(source, id)`` back from any of them; a consumer outside oncely reads only its
    own binding's spelling, so pass the one of the broker you publish to::

        headers = cloudevent_headers(source="/shop", event_type="order.paid", binding="kafka")

    Raises :class:`~oncely.errors.ConfigurationError` for an unknown binding and for a source
    that is empty or holds white space or control characters (a URI reference has none, and
    the consumer refuses it)."""
    prefix = _CE_PREFIXES.get(binding)
    if prefix is None:
        raise ConfigurationError(
            f"unknown CloudEvents binding {binding!r}; use one of {', '.join(_CE_PREFIXES)}"
        )
    if not source or " " in source or not source.isprintable():
        raise ConfigurationError(
            "a CloudEvents source is a non-empty URI reference, without white space or "
            f"control characters; got {source!r}"
        )
    headers = {
        f"{prefix}specversion": "1.0",
        f"{prefix}source": source,
        f"{prefix}type": event_type,
        f"{prefix}id": event_id if event_id is not None else new_message_id(),
    }
    if subject is not None:
        headers[f"{prefix}subject"] = subject
    return headers


class _Factory(Protocol):
    def from_url(self, url: str, source: str, **options: object) -> object: ...


# scheme -> (transport "module:Class", producer "module:Class", extra)
_BROKERS: dict[str, tuple[str, str, str]] = {
    "amqp": (
        "oncely.brokers.rabbitmq:RabbitMQ",
        "oncely.brokers.rabbitmq:RabbitMQProducer",
        "rabbitmq",
    ),
    "redis": (
        "oncely.brokers.redis_streams:RedisStreams",
        "oncely.brokers.redis_streams:RedisStreamsProducer",
        "redis",
    ),
    "nats": ("oncely.brokers.nats:JetStream", "oncely.brokers.nats:JetStreamProducer", "nats"),
    "kafka": ("oncely.brokers.kafka:Kafka", "oncely.brokers.kafka:KafkaProducer", "kafka"),
    "sqs": ("oncely.brokers.sqs:SQS", "oncely.brokers.sqs:SQSProducer", "sqs"),
}
_ALIASES = {"amqps": "amqp", "rediss": "redis", "tls": "nats"}
_SYSTEMS = {
    "amqp": "rabbitmq",
    "redis": "redis-streams",
    "nats": "nats",
    "kafka": "kafka",
    "sqs": "sqs",
}
"""Each scheme's broker as its transport names it (``Transport.name``), for spans."""
SCHEMES = tuple(sorted({*_BROKERS, *_ALIASES}))


def _load(url: str, which: int) -> _Factory:
    return cast(_Factory, load_by_scheme(url, _BROKERS, _ALIASES, which, "adapter"))


def open_transport(
    url: str,
    source: str,
    *,
    group: str,
    dead_letter: str | None = None,
    ack_wait: timedelta | None = None,
) -> Transport:
    """The transport for ``url`` reading ``source`` (a queue, stream or subject).

    ``group`` names the consumer group (Redis Streams) or durable consumer (JetStream); for
    RabbitMQ the queue itself is the group. ``dead_letter`` names the dead-letter destination
    (default: ``<source>.dead``; on SQS ``<source>-dead``, ``<name>-dead.fifo`` for a FIFO
    queue). ``ack_wait`` is how long the broker waits for an ack before
    redelivering to another consumer (JetStream ack wait, Redis Streams idle time before
    XAUTOCLAIM); running handlers extend it.
    """
    factory = _load(url, 0)
    return cast(
        Transport,
        factory.from_url(url, source, group=group, dead_letter=dead_letter, ack_wait=ack_wait),
    )


def open_producer(url: str, destination: str, *, tracing: Tracing = False) -> Producer:
    """The producer for ``url`` publishing to ``destination`` (a queue, stream or subject).

    ``tracing=True`` (or an OpenTelemetry ``TracerProvider``) makes each publish a PRODUCER
    span whose context the message's headers carry (W3C ``traceparent``), for a consumer's
    span to continue the trace (:class:`oncely.tracing.TracedProducer`)."""
    producer = cast(Producer, _load(url, 1).from_url(url, destination))
    if tracing is False:
        return producer
    scheme = url.split(":", 1)[0].lower()
    system = _SYSTEMS[_ALIASES.get(scheme, scheme)]
    return TracedProducer(producer, system=system, destination=destination, tracing=tracing)
