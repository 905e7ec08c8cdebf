"""RabbitMQ: a quorum queue read with manual acknowledgement, and a confirming producer.

::

    import oncely
    from oncely.brokers import BrokerConsumer, ConsumerSettings, open_producer, open_transport

    producer = open_producer("amqp://guest:guest@localhost/", "payments")
    await producer.publish(b'{"order": 7}', message_id="order-7")  # confirmed when it returns

    inbox = oncely.AsyncInbox(oncely.open_async("postgresql://..."), consumer="billing")
    transport = open_transport("amqp://guest:guest@localhost/", "payments", group="billing")
    await BrokerConsumer(transport, inbox, charge, settings=ConsumerSettings()).run()

Topology. The transport (and the producer, when the queue does not exist yet) declares:

- the queue ``source`` as a durable quorum queue (``x-queue-type: quorum``) with
  ``x-dead-letter-exchange`` set to the dead-letter exchange and ``x-delivery-limit`` set to
  ``delivery_limit``;
- the dead-letter exchange, a durable fanout exchange named like the dead-letter queue
  (default ``<source>.dead``), and the dead-letter queue itself (a quorum queue) bound to it.

Declaring is idempotent. A queue that already exists with other arguments is refused with
:class:`~oncely.ConfigurationError` (RabbitMQ cannot change a queue's arguments; give the
producer the same URL options as the consumer, or use a policy and ``declare=false``).

What each outcome does here:

===================  ==========================================================================
processed/duplicate  ``basic.ack``
stale_reclaimed      ``basic.ack``
in_flight            held unacknowledged for ``requeue_delay``, then ``basic.nack`` with requeue
failed               held for the backoff delay, then ``basic.nack`` with requeue; once the
                     delivery count reaches ``ConsumerSettings.max_deliveries`` it is
                     dead-lettered instead, with the last error as the reason
key_conflict,        published to the dead-letter exchange with ``x-oncely-outcome``,
rejected, escalated  ``x-oncely-reason``, ``x-oncely-consumer`` and ``x-oncely-deliveries``
                     headers (same body, message id, correlation id and original headers),
                     confirmed by the broker (publisher confirms), *then* the original is acked
===================  ==========================================================================

RabbitMQ has no delayed negative acknowledgement, so a retry keeps the message unacknowledged
for the delay (a scheduled task, the consumer goes on with other messages) and then requeues
it. A held message counts against the prefetch window. If the channel closes meanwhile the
broker requeues the message by itself, which is the same result.

Delivery counts and the delivery limit. Quorum queues count deliveries and put the count of
earlier deliveries in the ``x-delivery-count`` header of a redelivered message; the transport
reports ``delivery_count = x-delivery-count + 1`` (1 for a first delivery; unknown when a
message is marked redelivered without the header, as on a classic queue). Every requeue counts:
a failed attempt, an ``in_flight`` requeue, a consumer crash or a lost connection. When a
message has been delivered more than ``x-delivery-limit`` times the broker dead-letters it by
itself, which is at-most-once by default and carries no ``x-oncely-*`` reason. That is only a
safety net: keep ``delivery_limit`` above ``ConsumerSettings.max_deliveries`` plus the
requeues an ``in_flight`` duplicate can take (how long a handler runs divided by
``requeue_delay``), so oncely's own dead-lettering, with the reason, always comes first. The
default, :data:`DEFAULT_DELIVERY_LIMIT` (20), suits the default ``max_deliveries`` of 5;
``delivery_limit=0`` in the URL (``None`` in the constructor) declares no limit. Keep dedup
records (R13) longer than a message can keep being redelivered.

Keys. ``Envelope.message_id`` is the AMQP ``message_id`` property, which only the producer
sets (R2); CloudEvents attributes arrive as ``ce-*`` or ``cloudEvents:*`` headers and
:class:`~oncely.CloudEventsKey` reads them (R3). The delivery tag, the ``redelivered`` flag and
``x-delivery-count`` are per delivery and appear only in ``Envelope.transport`` and
:meth:`describe <oncely.brokers.Delivery.describe>` (R4). Beware of producers built on aiormq
(and so aio-pika): it gives every message published without a ``message_id`` a random one, so
a retried publish becomes a new message; always set the id (:class:`RabbitMQProducer` requires
it). For the same reason the dead-letter copy of a message that arrived without an id carries
a random one; its ``x-oncely-reason`` says the original had none, so give it the producer's id
before resubmitting it.

Ack wait. RabbitMQ does not redeliver a message that a live consumer holds, so
``extend_every`` is ``None`` and ``ack_wait`` is accepted (for a URL shared with other brokers)
and unused. The exception is the server's ``consumer_timeout`` (30 minutes by default), after
which the broker closes the channel: keep handlers well below it. A message is redelivered
when its channel or connection closes; the inbox answers that copy ``in_flight`` while the
first handler still runs and ``duplicate`` after it finished (R8).

Connection loss. The transport reconnects on the next :meth:`RabbitMQ.fetch` after a lost
connection (the consumer loop backs off between attempts). Deliveries from the lost channel
can no longer be settled (their delivery tags belong to the old channel): settling them raises
:class:`~oncely.BrokerUnavailable` and the broker redelivers them.

URL options: ``delivery_limit`` (whole number, 0 for none), ``declare`` (true/false),
``heartbeat``, ``connect_timeout`` and ``confirm_timeout`` (seconds).

Tested (``tests/brokers/test_rabbitmq.py``, against a real RabbitMQ): producer retries with one
message id, a connection killed under a slow handler (in_flight, then duplicate), two competing
consumers with copies of one message, key conflicts and poison messages read back from the
dead-letter queue with their reasons, retries up to ``max_deliveries``, a broker restart
mid-run, and an empty queue with nothing unacknowledged at the end of each test.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any, NoReturn
from urllib.parse import urlunsplit

import aio_pika
import aiormq
from aio_pika.abc import (
    AbstractChannel,
    AbstractConnection,
    AbstractIncomingMessage,
    AbstractQueue,
    DeliveryMode,
    ExchangeType,
)

from oncely._core.keys import Envelope
from oncely._urls import UrlOptions, redact, split
from oncely.brokers._shape import DeadLetter, Delivery
from oncely.errors import BrokerError, BrokerUnavailable, ConfigurationError

__all__ = ["DEFAULT_DELIVERY_LIMIT", "RabbitMQ", "RabbitMQDelivery", "RabbitMQProducer"]

LOGGER = logging.getLogger("oncely.broker.rabbitmq")

DEFAULT_DELIVERY_LIMIT = 20
"""The quorum queue's own ``x-delivery-limit``: a safety net above
``ConsumerSettings.max_deliveries`` (5 by default) and the requeues of ``in_flight`` copies."""

DELIVERY_COUNT_HEADER = "x-delivery-count"
_DEAD_LETTER_RETRY = timedelta(seconds=5)
_URL_OPTIONS = ("delivery_limit", "declare", "heartbeat", "connect_timeout", "confirm_timeout")
_MAX_NAME_BYTES = 255


# ---------------------------------------------------------------------- errors


def _raise(exc: BaseException, doing: str) -> NoReturn:
    """Raise ``exc`` as an oncely error: unreachable or closed as :class:`BrokerUnavailable`,
    a refusal by the broker as :class:`BrokerError` or :class:`ConfigurationError`."""
    if isinstance(exc, aiormq.exceptions.ChannelPreconditionFailed):
        raise ConfigurationError(
            f"RabbitMQ refused to {doing}: {exc}. A queue or exchange of that name exists with "
            "other arguments; RabbitMQ cannot change them (use the same options everywhere, "
            "delete the queue, or manage it with a policy and declare=false)"
        ) from None
    if isinstance(
        exc, aiormq.exceptions.AuthenticationError | aiormq.exceptions.ChannelAccessRefused
    ):
        raise BrokerError(f"RabbitMQ refused to {doing}: {exc}") from None
    if isinstance(exc, aiormq.exceptions.DeliveryError | aiormq.exceptions.ChannelNotFoundEntity):
        raise BrokerError(f"RabbitMQ could not {doing}: {exc}") from None
    raise BrokerUnavailable(
        f"RabbitMQ is unavailable ({doing}): {type(exc).__name__}: {exc}"
    ) from None


_FAILURES = (
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


class _Topology:
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
            with contextlib.suppress(*_FAILURES):
                await channel.close()


def _parse(url: str) -> tuple[str, dict[str, Any]]:
    """The connection URL (without oncely's options) and the options read from it."""
    parts = split(url)
    if parts.scheme.lower() not in ("amqp", "amqps"):
        raise ConfigurationError(f"{redact(url)}: a RabbitMQ URL starts with amqp:// or amqps://")
    options = UrlOptions(url)
    limit = options.integer("delivery_limit", DEFAULT_DELIVERY_LIMIT)
    found: dict[str, Any] = {
        "delivery_limit": None if limit == 0 else limit,
        "declare": options.boolean("declare", True),
        "heartbeat": options.seconds("heartbeat", timedelta(seconds=60)),
        "connect_timeout": options.seconds("connect_timeout", timedelta(seconds=10)),
        "confirm_timeout": options.seconds("confirm_timeout", timedelta(seconds=30)),
    }
    options.done(_URL_OPTIONS)
    if limit < 0:
        raise ConfigurationError(f"{redact(url)}: delivery_limit must be 0 (none) or more")
    return urlunsplit(parts._replace(query="", fragment="")), found


def _positive(name: str, value: timedelta) -> float:
    seconds = value.total_seconds()
    if seconds <= 0:
        raise ConfigurationError(f"{name} must be positive")
    return seconds


async def _connect(
    url: str, *, name: str, heartbeat: timedelta, timeout: float
) -> AbstractConnection:
    try:
        return await aio_pika.connect(
            url,
            timeout=timeout,
            heartbeat=int(heartbeat.total_seconds()),
            client_properties={"connection_name": name},
        )
    except _FAILURES as exc:
        _raise(exc, f"connect to {redact(url)}")


# ---------------------------------------------------------------------- envelope


def _header_text(value: object) -> str | None:
    """A header value as text, or ``None`` for a structured one (a table or an array)."""
    if isinstance(value, str):
        return value
    if isinstance(value, bytes | bytearray):
        return bytes(value).decode("utf-8", "replace")
    if isinstance(value, bool | int | float | Decimal):
        return str(value)
    if isinstance(value, datetime):
        return value.isoformat()
    return None


def _delivery_count(headers: Mapping[str, object], redelivered: bool) -> int | None:
    earlier = headers.get(DELIVERY_COUNT_HEADER)
    if isinstance(earlier, int) and not isinstance(earlier, bool) and earlier >= 0:
        return earlier + 1
    return None if redelivered else 1


class RabbitMQDelivery:
    """One message delivered on one channel, unacknowledged until it is settled."""

    __slots__ = ("_envelope", "_fields", "_message", "_session", "_transport")

    def __init__(
        self, message: AbstractIncomingMessage, session: _Session, transport: RabbitMQ
    ) -> None:
        self._message = message
        self._session = session
        self._transport = transport
        raw = message.headers or {}
        headers = {
            name: text
            for name, value in raw.items()
            if name != DELIVERY_COUNT_HEADER and (text := _header_text(value)) is not None
        }
        count = _delivery_count(raw, bool(message.redelivered))
        self._fields: dict[str, object] = {
            "delivery_tag": message.delivery_tag,
            "redelivered": bool(message.redelivered),
            DELIVERY_COUNT_HEADER: raw.get(DELIVERY_COUNT_HEADER),
            "queue": transport.queue,
        }
        transport_fields = dict(self._fields)
        transport_fields["content_type"] = message.content_type
        transport_fields["content_encoding"] = message.content_encoding
        self._envelope = Envelope(
            body=message.body,
            message_id=message.message_id or None,
            headers=headers,
            correlation_id=message.correlation_id or None,
            delivery_count=count,
            transport=transport_fields,
        )

    @property
    def envelope(self) -> Envelope:
        return self._envelope

    @property
    def delivery_count(self) -> int | None:
        return self._envelope.delivery_count

    def describe(self) -> Mapping[str, object]:
        return self._fields

    def _live(self, doing: str) -> None:
        if self._session.lost is not None or self._session.channel.is_closed:
            raise BrokerUnavailable(
                f"cannot {doing} delivery {self._message.delivery_tag}: the channel it came on "
                "is closed (its delivery tag is stale); RabbitMQ redelivers the message"
            )

    async def ack(self) -> None:
        self._live("ack")
        try:
            await self._message.ack()
        except _FAILURES as exc:
            _raise(exc, "acknowledge a message")

    async def _requeue(self) -> None:
        try:
            await self._message.nack(requeue=True)
        except _FAILURES as exc:
            _raise(exc, "requeue a message")

    async def retry(self, delay: timedelta) -> None:
        """Requeue now when ``delay`` is zero; otherwise hold the message and requeue it after
        ``delay`` in the background (RabbitMQ has no delayed requeue)."""
        self._live("requeue")
        if delay <= timedelta(0):
            await self._requeue()
            return
        self._transport._hold(self, delay.total_seconds())

    async def _requeue_later(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
        try:
            await self._requeue()
        except BrokerError as exc:
            # The channel closed meanwhile: the broker has requeued the message already.
            LOGGER.debug("oncely rabbitmq: a held message went back on its own (%s)", exc)

    async def dead_letter(self, why: DeadLetter) -> None:
        """Publish the copy to the dead-letter exchange, wait for the broker's confirm, then
        ack the original. Should the broker refuse the copy (say the dead-letter queue was
        deleted), the original is given back after a pause and :class:`BrokerError` raised."""
        self._live("dead-letter")
        message = self._message
        headers: dict[str, Any] = {
            name: value
            for name, value in (message.headers or {}).items()
            if name != DELIVERY_COUNT_HEADER
        }
        headers.update(why.headers())
        copy = aio_pika.Message(
            message.body,
            headers=headers,
            content_type=message.content_type,
            content_encoding=message.content_encoding,
            delivery_mode=DeliveryMode.PERSISTENT,
            correlation_id=message.correlation_id,
            message_id=message.message_id,
            type=message.type,
            app_id=message.app_id,
            timestamp=message.timestamp,
        )
        topology = self._transport.topology
        try:
            exchange = await self._session.channel.get_exchange(topology.dead_letter, ensure=False)
            await exchange.publish(
                copy, routing_key=topology.dead_letter, timeout=self._transport.confirm_timeout
            )
        except aiormq.exceptions.DeliveryError as exc:
            self._transport._hold(self, _DEAD_LETTER_RETRY.total_seconds())
            raise BrokerError(
                f"RabbitMQ did not take the dead-letter copy ({exc}); is the exchange "
                f"{topology.dead_letter!r} bound to a queue? The message is given back"
            ) from None
        except _FAILURES as exc:
            _raise(exc, f"publish to the dead-letter exchange {topology.dead_letter!r}")
        await self.ack()

    async def extend(self) -> None:
        """Nothing to do: RabbitMQ does not redeliver a message its live consumer holds."""


# ---------------------------------------------------------------------- transport


class _Session:
    """One connection and channel, and the deliveries read on them. A new session replaces
    a lost one; deliveries keep the session they came on, so a stale one is recognised."""

    __slots__ = ("channel", "connection", "consumer_tag", "lost", "messages", "queue", "reported")

    def __init__(self, connection: AbstractConnection, channel: AbstractChannel) -> None:
        self.connection = connection
        self.channel = channel
        self.queue: AbstractQueue | None = None
        self.consumer_tag: str | None = None
        self.lost: BaseException | None = None
        self.reported = False
        # None is the "connection lost" wake-up for a waiting fetch.
        self.messages: asyncio.Queue[AbstractIncomingMessage | None] = asyncio.Queue()

    def on_close(self, _sender: object, exc: BaseException | None = None) -> None:
        if self.lost is None:
            self.lost = exc if exc is not None else ConnectionError("closed")
            self.messages.put_nowait(None)


class RabbitMQ:
    """Reads a RabbitMQ quorum queue with manual acknowledgement (see the module docs).

    ``queue`` is read by every consumer process of a group (competing consumers); the queue
    itself is the group. ``dead_letter`` names the dead-letter exchange and queue (default
    ``<queue>.dead``). ``delivery_limit`` is the queue's ``x-delivery-limit`` (``None``: no
    limit), a safety net above ``ConsumerSettings.max_deliveries``. With ``declare=False``
    the topology must exist already (it is checked passively). ``heartbeat`` is the AMQP
    heartbeat, ``connect_timeout`` bounds connecting and ``confirm_timeout`` waiting for the
    broker to confirm a dead-letter copy.
    """

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
        connection_name: str | None = None,
    ) -> None:
        parts = split(url)
        if parts.scheme.lower() not in ("amqp", "amqps"):
            raise ConfigurationError(
                f"{redact(url)}: a RabbitMQ URL starts with amqp:// or amqps://"
            )
        self.topology = _Topology(queue, dead_letter, delivery_limit)
        self.queue = self.topology.queue
        self._url = url
        self._declare = declare
        if heartbeat < timedelta(0):
            raise ConfigurationError("heartbeat must not be negative")
        self._heartbeat = heartbeat
        self._connect_timeout = _positive("connect_timeout", connect_timeout)
        self.confirm_timeout = _positive("confirm_timeout", confirm_timeout)
        self._connection_name = connection_name or f"oncely {self.queue}"
        self._prefetch = 1
        self._session: _Session | None = None
        self._stopped = False
        self._held: set[asyncio.Task[None]] = set()

    @classmethod
    def from_url(
        cls,
        url: str,
        source: str,
        *,
        group: str,
        dead_letter: str | None = None,
        ack_wait: timedelta | None = None,
    ) -> RabbitMQ:
        """The transport for ``url`` (options: ``delivery_limit``, ``declare``, ``heartbeat``,
        ``connect_timeout``, ``confirm_timeout``) reading the queue ``source``. ``group``
        names the connection; ``ack_wait`` is unused (see the module docs)."""
        del ack_wait  # RabbitMQ holds a message for its live consumer as long as it takes
        base, options = _parse(url)
        return cls(
            base,
            source,
            dead_letter=dead_letter,
            connection_name=f"oncely {group} {source}",
            **options,
        )

    def __repr__(self) -> str:
        return f"RabbitMQ({redact(self._url)!r}, {self.queue!r})"

    @property
    def name(self) -> str:
        return "rabbitmq"

    @property
    def extend_every(self) -> timedelta | None:
        return None

    async def open(self, prefetch: int) -> None:
        if prefetch < 1:
            raise ConfigurationError("prefetch must be at least 1")
        self._prefetch = prefetch
        self._stopped = False
        if self._session is None or self._session.lost is not None:
            await self._reconnect()

    async def _reconnect(self) -> None:
        old, self._session = self._session, None
        if old is not None:
            await self._discard(old)
        connection = await _connect(
            self._url,
            name=self._connection_name,
            heartbeat=self._heartbeat,
            timeout=self._connect_timeout,
        )
        try:
            session = await self._start(connection)
        except BaseException:
            with contextlib.suppress(*_FAILURES):
                await connection.close()
            raise
        self._session = session

    async def _start(self, connection: AbstractConnection) -> _Session:
        try:
            # on_return_raises: a dead-letter copy nothing routes must fail, not vanish.
            channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
            await channel.set_qos(prefetch_count=self._prefetch)
            if self._declare:
                queue = await self.topology.declare(channel)
            else:
                await channel.declare_queue(self.topology.dead_letter, passive=True)
                queue = await channel.declare_queue(self.queue, passive=True)
            session = _Session(connection, channel)
            connection.close_callbacks.add(session.on_close)
            channel.close_callbacks.add(session.on_close)
            session.queue = queue

            async def received(message: AbstractIncomingMessage) -> None:
                if self._stopped or session.lost is not None:
                    with contextlib.suppress(*_FAILURES):
                        await message.nack(requeue=True)
                    return
                session.messages.put_nowait(message)

            session.consumer_tag = await queue.consume(received, no_ack=False)
        except _FAILURES as exc:
            _raise(exc, f"declare and consume the queue {self.queue!r}")
        return session

    async def fetch(self, limit: int, timeout: timedelta) -> list[Delivery]:
        session = self._session
        if session is not None and session.lost is not None and not session.reported:
            session.reported = True  # say it once (the loop logs it), reconnect next time
            raise BrokerUnavailable(
                f"the connection to RabbitMQ was lost ({session.lost}); the broker redelivers "
                "what was not acknowledged"
            )
        if session is None or session.lost is not None:
            if self._stopped:
                return []
            await self._reconnect()  # raises BrokerUnavailable while the broker is away
            session = self._session
            assert session is not None
        try:
            first = await asyncio.wait_for(session.messages.get(), timeout.total_seconds())
        except TimeoutError:
            return []
        batch = [first]
        while len(batch) < max(1, limit) and not session.messages.empty():
            batch.append(session.messages.get_nowait())
        if session.lost is not None or None in batch:
            session.reported = True
            raise BrokerUnavailable(
                f"the connection to RabbitMQ was lost ({session.lost}); the broker redelivers "
                "what was not acknowledged"
            )
        return [RabbitMQDelivery(m, session, self) for m in batch if m is not None]

    def _hold(self, delivery: RabbitMQDelivery, seconds: float) -> None:
        task = asyncio.create_task(delivery._requeue_later(seconds))
        self._held.add(task)
        task.add_done_callback(self._held.discard)

    async def stop(self) -> None:
        """Cancel the consumer and give back what was prefetched and not yet fetched."""
        self._stopped = True
        session = self._session
        if session is None or session.lost is not None:
            return
        try:
            if session.queue is not None and session.consumer_tag is not None:
                await session.queue.cancel(session.consumer_tag)
            while not session.messages.empty():
                message = session.messages.get_nowait()
                if message is not None:
                    await message.nack(requeue=True)
        except _FAILURES as exc:
            _raise(exc, "stop consuming")

    async def close(self) -> None:
        """Close the connection: held and unsettled messages go back to the queue."""
        self._stopped = True
        for task in list(self._held):
            task.cancel()
        session, self._session = self._session, None
        if session is not None:
            await self._discard(session)

    async def _discard(self, session: _Session) -> None:
        session.on_close(None)
        with contextlib.suppress(*_FAILURES):
            await session.connection.close()


# ---------------------------------------------------------------------- producer


class RabbitMQProducer:
    """Publishes to a queue (through the default exchange) with publisher confirms: a call
    returns once the broker has the message. A message no queue takes is an error, never
    dropped silently. On first use it declares the queue as :class:`RabbitMQ` does, unless
    the queue exists already (then it is used as it is) or ``declare=False``."""

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
    ) -> None:
        parts = split(url)
        if parts.scheme.lower() not in ("amqp", "amqps"):
            raise ConfigurationError(
                f"{redact(url)}: a RabbitMQ URL starts with amqp:// or amqps://"
            )
        self._topology = _Topology(queue, dead_letter, delivery_limit)
        self.queue = self._topology.queue
        self._url = url
        self._declare = declare
        self._heartbeat = heartbeat
        self._connect_timeout = _positive("connect_timeout", connect_timeout)
        self._confirm_timeout = _positive("confirm_timeout", confirm_timeout)
        self._connection: AbstractConnection | None = None
        self._channel: AbstractChannel | None = None
        self._lock = asyncio.Lock()

    @classmethod
    def from_url(cls, url: str, destination: str) -> RabbitMQProducer:
        """The producer for ``url`` (the transport's URL options apply) and the queue
        ``destination``."""
        base, options = _parse(url)
        return cls(base, destination, **options)

    def __repr__(self) -> str:
        return f"RabbitMQProducer({redact(self._url)!r}, {self.queue!r})"

    async def _ready(self) -> AbstractChannel:
        channel = self._channel
        if channel is not None and not channel.is_closed:
            return channel
        async with self._lock:
            if self._channel is not None and not self._channel.is_closed:
                return self._channel
            await self._drop()
            connection = await _connect(
                self._url,
                name=f"oncely producer {self.queue}",
                heartbeat=self._heartbeat,
                timeout=self._connect_timeout,
            )
            try:
                if self._declare:
                    await self._topology.ensure(connection)
                channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
            except BaseException as exc:
                with contextlib.suppress(*_FAILURES):
                    await connection.close()
                if isinstance(exc, _FAILURES):
                    _raise(exc, f"declare the queue {self.queue!r}")
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
        if not message_id:
            raise ConfigurationError("publish needs the producer's message id (R2)")
        message = aio_pika.Message(
            body,
            headers=dict(headers) if headers else None,
            content_type=content_type,
            delivery_mode=DeliveryMode.PERSISTENT,
            message_id=message_id,
            correlation_id=correlation_id,
        )
        channel = await self._ready()
        try:
            await channel.default_exchange.publish(
                message, routing_key=self.queue, mandatory=True, timeout=self._confirm_timeout
            )
        except aiormq.exceptions.PublishError:
            raise BrokerError(
                f"RabbitMQ has no queue {self.queue!r} to take the message (it was returned); "
                "declare it or let the producer declare it (declare=true)"
            ) from None
        except _FAILURES as exc:
            _raise(exc, f"publish to the queue {self.queue!r}")

    async def _drop(self) -> None:
        connection, self._connection, self._channel = self._connection, None, None
        if connection is not None:
            with contextlib.suppress(*_FAILURES):
                await connection.close()

    async def close(self) -> None:
        async with self._lock:
            await self._drop()
