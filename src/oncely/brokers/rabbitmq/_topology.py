"""RabbitMQ topology and connections: the names and arguments declared, the URL options, and
how the client library's exceptions become oncely's."""

from __future__ import annotations

import contextlib
import logging
from datetime import timedelta
from typing import Any, NoReturn

import aio_pika
import aiormq
from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractQueue, ExchangeType

from oncely._core.said import said
from oncely._urls import UrlOptions, redact
from oncely.brokers._common import positive, server_url
from oncely.brokers.rabbitmq._frames import lossless_frames
from oncely.errors import BrokerError, BrokerUnavailable, ConfigurationError

LOGGER = logging.getLogger("oncely.broker.rabbitmq")

DEFAULT_DELIVERY_LIMIT = 20
"""The quorum queue's own ``x-delivery-limit``: a safety net above
``ConsumerSettings.max_deliveries`` (5 by default) and the requeues of ``in_flight`` copies."""

DELIVERY_COUNT_HEADER = "x-delivery-count"
_SCHEMES = ("amqp", "amqps")
_URL_OPTIONS = (
    "delivery_limit",
    "declare",
    "heartbeat",
    "connect_timeout",
    "confirm_timeout",
    "trust_hex_message_ids",
)
_MAX_NAME_BYTES = 255


# ---------------------------------------------------------------------- errors


def raise_translated(exc: BaseException, doing: str) -> NoReturn:
    """Raise ``exc`` as an oncely error: unreachable or closed as :class:`BrokerUnavailable`,
    a refusal by the broker as :class:`BrokerError` or :class:`ConfigurationError`."""
    if isinstance(exc, aiormq.exceptions.ChannelPreconditionFailed):
        raise ConfigurationError(
            f"RabbitMQ refused to {doing}: {exc}. A queue or exchange of that name exists with "
            "other arguments; RabbitMQ cannot change them (use the same options everywhere, "
            "delete the queue, or manage it with a policy and declare=false)"
        ) from None
    if isinstance(
        exc,
        aiormq.exceptions.AuthenticationError
        | aiormq.exceptions.ProbableAuthenticationError
        | aiormq.exceptions.ChannelAccessRefused,
    ):
        # A refusal is not an outage: trying again with the same credentials cannot succeed.
        raise BrokerError(f"RabbitMQ refused to {doing}: {_reason(exc)}") from None
    if isinstance(exc, aiormq.exceptions.InvalidFrameError) and _closed_while_opening(exc):
        raise BrokerError(
            f"RabbitMQ refused to {doing}: it closed the connection while opening the "
            "virtual host (one that does not exist, or that this user may not use)"
        ) from None
    if isinstance(exc, aiormq.exceptions.DeliveryError | aiormq.exceptions.ChannelNotFoundEntity):
        raise BrokerError(f"RabbitMQ could not {doing}: {exc}") from None
    raise BrokerUnavailable(f"RabbitMQ is unavailable ({doing}): {said(exc)}") from None


def _reason(exc: BaseException) -> str:
    """The broker's words in ``exc``, without the tuple the client wraps them in."""
    args = [str(a) for a in exc.args if a]
    return "; ".join(args) if args else type(exc).__name__


def _closed_while_opening(exc: BaseException) -> bool:
    # aiormq reports a Connection.Close answered to Connection.Open (RabbitMQ's answer for a
    # virtual host that does not exist or that the user may not use) only as this text.
    text = str(exc)
    return "Connection.OpenOk" in text and "Connection.Close" in text


FAILURES = (
    aiormq.exceptions.AMQPError,
    aiormq.exceptions.ChannelInvalidStateError,
    aio_pika.exceptions.MessageProcessError,
    ConnectionError,
    OSError,
    TimeoutError,
    RuntimeError,
    StopAsyncIteration,
)
"""What the client library raises when a connection, channel or operation fails."""


# ---------------------------------------------------------------------- topology


def _check_name(what: str, name: str) -> str:
    if not name or len(name.encode("utf-8")) > _MAX_NAME_BYTES or name.startswith("amq."):
        raise ConfigurationError(
            f"the {what} must be a non-empty name of at most {_MAX_NAME_BYTES} bytes not "
            f"starting with 'amq.', not {name!r}"
        )
    return name


def _check_limit(limit: int | None) -> int | None:
    if limit is not None and (isinstance(limit, bool) or limit < 1):
        raise ConfigurationError("delivery_limit must be a whole number of at least 1, or None")
    return limit


class Topology:
    """The queue, its dead-letter exchange and the dead-letter queue bound to it."""

    __slots__ = ("dead_letter", "delivery_limit", "queue")

    def __init__(self, queue: str, dead_letter: str | None, delivery_limit: int | None) -> None:
        self.queue = _check_name("queue", queue)
        self.dead_letter = _check_name(
            "dead-letter queue", dead_letter if dead_letter is not None else f"{queue}.dead"
        )
        if self.dead_letter == self.queue:
            raise ConfigurationError("the dead-letter queue must differ from the queue")
        self.delivery_limit = _check_limit(delivery_limit)

    def arguments(self) -> dict[str, Any]:
        arguments: dict[str, Any] = {
            "x-queue-type": "quorum",
            "x-dead-letter-exchange": self.dead_letter,
        }
        if self.delivery_limit is not None:
            arguments["x-delivery-limit"] = self.delivery_limit
        return arguments

    async def declare(self, channel: AbstractChannel) -> AbstractQueue:
        """Declare everything (idempotent when it exists with the same arguments)."""
        exchange = await channel.declare_exchange(
            self.dead_letter, ExchangeType.FANOUT, durable=True
        )
        dead = await channel.declare_queue(
            self.dead_letter, durable=True, arguments={"x-queue-type": "quorum"}
        )
        await dead.bind(exchange, routing_key="")
        return await channel.declare_queue(self.queue, durable=True, arguments=self.arguments())

    async def ensure(self, connection: AbstractConnection) -> None:
        """Declare everything unless the queue exists (whatever its arguments): the
        producer's way, which never fights a consumer's configuration."""
        probe = await connection.channel(publisher_confirms=False)
        try:
            await probe.declare_queue(self.queue, passive=True)
        except aiormq.exceptions.ChannelNotFoundEntity:
            pass  # the broker closed the probe channel: the queue is missing
        else:
            await probe.close()
            return
        channel = await connection.channel(publisher_confirms=False)
        try:
            await self.declare(channel)
        finally:
            with contextlib.suppress(*FAILURES):
                await channel.close()


def parse_url(url: str) -> tuple[str, dict[str, Any]]:
    """The connection URL (without oncely's options) and the options read from it."""
    base = server_url(url, _SCHEMES, "RabbitMQ")
    options = UrlOptions(url)
    limit = options.integer("delivery_limit", DEFAULT_DELIVERY_LIMIT)
    found: dict[str, Any] = {
        "delivery_limit": None if limit == 0 else limit,
        "declare": options.boolean("declare", True),
        "heartbeat": options.seconds("heartbeat", timedelta(seconds=60)),
        "connect_timeout": options.seconds("connect_timeout", timedelta(seconds=10)),
        "confirm_timeout": options.seconds("confirm_timeout", timedelta(seconds=30)),
        "trust_hex_message_ids": options.boolean("trust_hex_message_ids", False),
    }
    options.done(_URL_OPTIONS)
    if limit < 0:
        raise ConfigurationError(f"{redact(url)}: delivery_limit must be 0 (none) or more")
    return base, found


class Link:
    """How to reach the broker, as the transport and the producer both do: the URL, the AMQP
    heartbeat, and the time allowed to connect and to have a publish confirmed (seconds)."""

    __slots__ = ("confirm_timeout", "connect_timeout", "heartbeat", "url")

    def __init__(
        self,
        url: str,
        *,
        heartbeat: timedelta,
        connect_timeout: timedelta,
        confirm_timeout: timedelta,
    ) -> None:
        server_url(url, _SCHEMES, "RabbitMQ")  # the client reads the URL as it is
        if heartbeat < timedelta(0):
            raise ConfigurationError("heartbeat must not be negative")
        self.url = url
        self.heartbeat = heartbeat
        self.connect_timeout = positive(connect_timeout, "connect_timeout").total_seconds()
        self.confirm_timeout = positive(confirm_timeout, "confirm_timeout").total_seconds()

    async def connect(self, name: str) -> AbstractConnection:
        """A new connection named ``name`` (as the management UI shows it), on which a frame
        holding a string that is not UTF-8 is read losslessly instead of closing the
        connection (see :mod:`._frames`)."""
        try:
            with lossless_frames():
                return await aio_pika.connect(
                    self.url,
                    timeout=self.connect_timeout,
                    heartbeat=int(self.heartbeat.total_seconds()),
                    client_properties={"connection_name": name},
                )
        except FAILURES as exc:
            raise_translated(exc, f"connect to {redact(self.url)}")
