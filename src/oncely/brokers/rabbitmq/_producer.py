"""The RabbitMQ producer: publishes to a queue with publisher confirms."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from datetime import timedelta

import aiormq
from aio_pika.abc import AbstractChannel, AbstractConnection, DeliveryMode

from oncely._urls import redact
from oncely.brokers._common import require_message_id
from oncely.brokers.rabbitmq._delivery import client_made_id
from oncely.brokers.rabbitmq._frames import WholeHeaderNames, frame_max, header_frame
from oncely.brokers.rabbitmq._topology import (
    DEFAULT_DELIVERY_LIMIT,
    FAILURES,
    Link,
    Topology,
    parse_url,
    raise_translated,
)
from oncely.errors import BrokerError, ConfigurationError

_SHORTSTR = 255
"""The longest AMQP short string, in bytes: a message's id, correlation id and content type."""


class RabbitMQProducer:
    """Publishes to a queue (through the default exchange) with publisher confirms: a call
    returns once the broker has the message. A message no queue takes is an error, never
    dropped silently. On first use it declares the queue as :class:`RabbitMQ` does, unless
    the queue exists already (then it is used as it is) or ``declare=False``. Header names
    are sent whole up to AMQP's 255 bytes (aio-pika alone cuts them at 128); a longer one is
    refused with :class:`~oncely.ConfigurationError`, and so are headers larger than the
    connection's ``frame_max`` (RabbitMQ would close the connection). So is a message id of
    the shape aio-pika's client makes up (``uuid4().hex``), which the consumers refuse,
    unless ``trust_hex_message_ids`` says your ids have it (as the consumers must say too)."""

    def __init__(
        self,
        url: str,
        queue: str,
        *,
        dead_letter: str | None = None,
        delivery_limit: int | None = DEFAULT_DELIVERY_LIMIT,
        declare: bool = True,
        heartbeat: timedelta = timedelta(seconds=60),
        connect_timeout: timedelta = timedelta(seconds=10),
        confirm_timeout: timedelta = timedelta(seconds=30),
        trust_hex_message_ids: bool = False,
    ) -> None:
        self.trust_hex_message_ids = trust_hex_message_ids
        self._link = Link(
            url,
            heartbeat=heartbeat,
            connect_timeout=connect_timeout,
            confirm_timeout=confirm_timeout,
        )
        self._topology = Topology(queue, dead_letter, delivery_limit)
        self.queue = self._topology.queue
        self._declare = declare
        self._connection: AbstractConnection | None = None
        self._channel: AbstractChannel | None = None
        self._lock = asyncio.Lock()

    @classmethod
    def from_url(cls, url: str, destination: str) -> RabbitMQProducer:
        """The producer for ``url`` (the transport's URL options apply) and the queue
        ``destination``."""
        base, options = parse_url(url)
        return cls(base, destination, **options)

    def __repr__(self) -> str:
        return f"RabbitMQProducer({redact(self._link.url)!r}, {self.queue!r})"

    async def _ready(self) -> AbstractChannel:
        channel = self._channel
        if channel is not None and not channel.is_closed:
            return channel
        async with self._lock:
            if self._channel is not None and not self._channel.is_closed:
                return self._channel
            await self._drop()
            connection = await self._link.connect(f"oncely producer {self.queue}")
            try:
                if self._declare:
                    await self._topology.ensure(connection)
                channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
            except BaseException as exc:
                with contextlib.suppress(*FAILURES):
                    await connection.close()
                if isinstance(exc, FAILURES):
                    raise_translated(exc, f"declare the queue {self.queue!r}")
                raise
            self._connection, self._channel = connection, channel
            return channel

    async def publish(
        self,
        body: bytes,
        *,
        message_id: str,
        headers: Mapping[str, str] | None = None,
        content_type: str = "application/json",
        correlation_id: str | None = None,
    ) -> None:
        for name, value in (
            ("message_id", message_id),
            ("correlation_id", correlation_id),
            ("content_type", content_type),
        ):
            size = len(value.encode("utf-8", "surrogatepass")) if value else 0
            if size > _SHORTSTR:
                # pamqp would fail while encoding, with a TypeError that names no field.
                raise ConfigurationError(
                    f"AMQP carries at most {_SHORTSTR} bytes in a message's {name}; this one "
                    f"has {size} (a longer id can travel in a header the consumers' key "
                    "source reads)"
                )
        if message_id and not self.trust_hex_message_ids and client_made_id(message_id):
            # Every oncely consumer on RabbitMQ would dead-letter it as made up by the client.
            raise ConfigurationError(
                f"the message id {message_id!r} has the shape aio-pika's client gives a "
                "message published without one (uuid4().hex), so oncely's consumers on "
                "RabbitMQ take it for made up and dead-letter the message: use "
                "new_message_id() or an id of your own, or, if your producers mint such ids, "
                "pass trust_hex_message_ids=True here and to the consumers (the URL option "
                "trust_hex_message_ids=true)"
            )
        for name in headers or ():
            size = len(name.encode("utf-8", "surrogatepass"))
            if size > _SHORTSTR:
                raise ConfigurationError(
                    f"AMQP carries at most {_SHORTSTR} bytes in a header name; {name[:40]!r}... "
                    f"has {size}"
                )
        # Header names go whole, up to 255 bytes: the client library cuts them at 128.
        message = WholeHeaderNames(
            body,
            headers=dict(headers) if headers else None,
            content_type=content_type,
            delivery_mode=DeliveryMode.PERSISTENT,
            message_id=require_message_id(message_id),
            correlation_id=correlation_id,
        )
        channel = await self._ready()
        size, most = header_frame(message), await frame_max(channel)
        if size > most:
            # RabbitMQ would close the connection: an error of this message, not an outage.
            raise ConfigurationError(
                f"the message's properties and headers take {size} bytes, over the "
                f"connection's frame_max of {most} (RabbitMQ closes a connection that sends "
                "them); send large data in the body"
            )
        try:
            await channel.default_exchange.publish(
                message, routing_key=self.queue, mandatory=True, timeout=self._link.confirm_timeout
            )
        except aiormq.exceptions.PublishError:
            raise BrokerError(
                f"RabbitMQ has no queue {self.queue!r} to take the message (it was returned); "
                "declare it or let the producer declare it (declare=true)"
            ) from None
        except FAILURES as exc:
            raise_translated(exc, f"publish to the queue {self.queue!r}")

    async def _drop(self) -> None:
        connection, self._connection, self._channel = self._connection, None, None
        if connection is not None:
            with contextlib.suppress(*FAILURES):
                await connection.close()

    async def close(self) -> None:
        async with self._lock:
            await self._drop()
