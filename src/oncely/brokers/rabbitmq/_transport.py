"""The RabbitMQ transport: one connection and channel consuming the queue, replaced when lost."""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict
from datetime import timedelta

import aiormq
from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractIncomingMessage, AbstractQueue

from oncely._urls import redact
from oncely.brokers._shape import BrokerLimits, Delivery
from oncely.brokers.rabbitmq._delivery import RabbitMQDelivery
from oncely.brokers.rabbitmq._topology import (
    DEFAULT_DELIVERY_LIMIT,
    FAILURES,
    Link,
    Topology,
    parse_url,
    raise_translated,
)
from oncely.errors import BrokerError, BrokerUnavailable, ConfigurationError

DEFAULT_CONSUMER_TIMEOUT = timedelta(minutes=30)
"""RabbitMQ's own default ``consumer_timeout`` (since 3.8.15)."""

REDELIVERIES_KEPT = 10_000
"""How many messages a transport counts the deliveries of itself, at most (the least recently
delivered are forgotten first): those of a queue that does not count them."""

CHECK_EVERY = timedelta(seconds=5)
"""How often, at most, an idle transport checks that the queue still counts its consumer."""


class Session:
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

    def on_cancel(self, frame: object) -> None:
        """The broker cancelled a consumer of the channel (``basic.cancel``); this session's
        ends the session, as a lost connection would."""
        if getattr(frame, "consumer_tag", None) == self.consumer_tag:
            self.on_close(None, ConsumerGone())

    def why(self) -> str:
        if isinstance(self.lost, ConsumerGone):
            return (
                f"{self.lost}; the transport connects and consumes again, and the broker "
                "redelivers what was not acknowledged"
            )
        return (
            f"the connection to RabbitMQ was lost ({self.lost}); the broker redelivers what "
            "was not acknowledged"
        )


class ConsumerGone(ConnectionError):
    """The queue no longer serves this consumer, though its channel is open: RabbitMQ
    cancelled it, or the queue was deleted (and maybe declared again) under it."""

    def __init__(self) -> None:
        super().__init__(
            "the queue no longer serves this consumer (it was deleted, maybe declared again, "
            "or RabbitMQ cancelled the consumer): no message would come on its channel"
        )


class RabbitMQ:
    """Reads a RabbitMQ quorum queue with manual acknowledgement (see the module docs).

    ``queue`` is read by every consumer process of a group (competing consumers); the queue
    itself is the group. ``dead_letter`` names the dead-letter exchange and queue (default
    ``<queue>.dead``). ``delivery_limit`` is the queue's ``x-delivery-limit`` (``None``: no
    limit), a safety net above ``ConsumerSettings.max_deliveries``. With ``declare=False``
    the topology must exist already (the queue, the dead-letter exchange and queue are
    checked passively). ``heartbeat`` is the AMQP
    heartbeat, ``connect_timeout`` bounds connecting and ``confirm_timeout`` waiting for the
    broker to confirm a dead-letter copy. ``trust_hex_message_ids=True`` takes a message id
    of the shape aio-pika's client gives a message published without one (``uuid4().hex``)
    as the producer's; by default the key source refuses it (see the module docs).

    RabbitMQ gives a message back only when its consumer's channel closes: a dead consumer's
    at once, a stuck one's after the server's ``consumer_timeout`` (30 minutes unless the
    server is configured otherwise). A client cannot read that setting, so
    ``consumer_timeout`` states it, for the consumer's redelivery horizon (R13).
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
        consumer_timeout: timedelta = DEFAULT_CONSUMER_TIMEOUT,
        trust_hex_message_ids: bool = False,
    ) -> None:
        self.trust_hex_message_ids = trust_hex_message_ids
        if consumer_timeout < timedelta(0):
            raise ConfigurationError("consumer_timeout must not be negative")
        self.consumer_timeout = consumer_timeout
        self._link = Link(
            url,
            heartbeat=heartbeat,
            connect_timeout=connect_timeout,
            confirm_timeout=confirm_timeout,
        )
        self.topology = Topology(queue, dead_letter, delivery_limit)
        self.queue = self.topology.queue
        self._declare = declare
        self.confirm_timeout = self._link.confirm_timeout
        self._connection_name = connection_name or f"oncely {self.queue}"
        self._prefetch = 1
        self._session: Session | None = None
        self._connected = False
        """Whether the broker has let this transport in once (a refusal is final only before)."""
        self._stopped = False
        self._held: set[asyncio.Task[None]] = set()
        self._next_check = 0.0
        self._redeliveries: OrderedDict[bytes, int] = OrderedDict()

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
        ``connect_timeout``, ``confirm_timeout``, ``trust_hex_message_ids``) reading the
        queue ``source``. ``group`` names the connection; ``ack_wait`` is the server's
        ``consumer_timeout`` (RabbitMQ holds a message for its live consumer as long as it
        takes, up to that)."""
        base, options = parse_url(url)
        return cls(
            base,
            source,
            dead_letter=dead_letter,
            connection_name=f"oncely {group} {source}",
            consumer_timeout=ack_wait if ack_wait is not None else DEFAULT_CONSUMER_TIMEOUT,
            **options,
        )

    def __repr__(self) -> str:
        return f"RabbitMQ({redact(self._link.url)!r}, {self.queue!r})"

    @property
    def name(self) -> str:
        return "rabbitmq"

    @property
    def extend_every(self) -> timedelta | None:
        return None

    @property
    def limits(self) -> BrokerLimits:
        """The horizon's inputs: the consumer timeout as stated, the queue's delivery limit;
        no time-to-live (oncely declares none; one set by a policy counts through
        ``ConsumerSettings.message_ttl``)."""
        return BrokerLimits(
            ack_wait=self.consumer_timeout,
            max_deliveries=self.topology.delivery_limit,
            source=f"RabbitMQ consumer_timeout (stated), queue {self.queue!r} x-delivery-limit",
        )

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
        try:
            connection = await self._link.connect(self._connection_name)
        except BrokerError as exc:
            if self._connected and not isinstance(exc, BrokerUnavailable):
                # It let these credentials in before: a refusal now (a broker still starting,
                # a password being rotated) is ridden out like an outage, not fatal mid-run.
                raise BrokerUnavailable(str(exc)) from None
            raise
        self._connected = True
        try:
            session = await self._start(connection)
        except BaseException:
            with contextlib.suppress(*FAILURES):
                await connection.close()
            raise
        self._session = session

    async def _start(self, connection: AbstractConnection) -> Session:
        try:
            # on_return_raises: a dead-letter copy nothing routes must fail, not vanish.
            channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
            await channel.set_qos(prefetch_count=self._prefetch)
            if self._declare:
                queue = await self.topology.declare(channel)
            else:
                # The exchange too: a dead letter sent to a missing one closes the channel,
                # giving back every message on it, the dead letter to come again for good.
                await channel.declare_exchange(self.topology.dead_letter, passive=True)
                await channel.declare_queue(self.topology.dead_letter, passive=True)
                queue = await channel.declare_queue(self.queue, passive=True)
            session = Session(connection, channel)
            connection.close_callbacks.add(session.on_close)
            channel.close_callbacks.add(session.on_close)
            session.queue = queue

            async def received(message: AbstractIncomingMessage) -> None:
                if self._stopped or session.lost is not None:
                    with contextlib.suppress(*FAILURES):
                        await message.nack(requeue=True)
                    return
                session.messages.put_nowait(message)

            session.consumer_tag = await queue.consume(received, no_ack=False)
            # A consumer the broker cancels is over (its channel stays open): be told.
            underlay = await channel.get_underlay_channel()
            cancels = getattr(underlay, "on_consumer_cancel_callbacks", None)
            if cancels is not None:
                cancels.add(session.on_cancel)
        except FAILURES as exc:
            raise_translated(exc, f"declare and consume the queue {self.queue!r}")
        return session

    async def fetch(self, limit: int, timeout: timedelta) -> list[Delivery]:
        session = self._session
        if session is not None and session.lost is not None and not session.reported:
            session.reported = True  # say it once (the loop logs it), reconnect next time
            raise BrokerUnavailable(session.why())
        if session is None or session.lost is not None:
            if self._stopped:
                return []
            await self._reconnect()  # raises BrokerUnavailable while the broker is away
            session = self._session
            assert session is not None
        try:
            first = await asyncio.wait_for(session.messages.get(), timeout.total_seconds())
        except TimeoutError:
            if await self._consumer_gone(session):
                session.reported = True
                raise BrokerUnavailable(session.why()) from None
            return []
        batch = [first]
        while len(batch) < max(1, limit) and not session.messages.empty():
            batch.append(session.messages.get_nowait())
        if session.lost is not None or None in batch:
            session.reported = True
            raise BrokerUnavailable(session.why())
        return [RabbitMQDelivery(m, session, self) for m in batch if m is not None]

    async def _consumer_gone(self, session: Session) -> bool:
        """After an empty fetch (at most every :data:`CHECK_EVERY`): whether the queue still
        counts a consumer, by a passive declare on the session's channel. A queue deleted
        under its consumers cancels them (:meth:`Session.on_cancel`), but one declared again
        at once (a producer declares a missing queue) can leave a consumer neither cancelled
        nor served: no message would come, and the transport would look healthy while the
        queue fills. A queue missing, or counting no consumer, ends the session; the next
        fetch connects and consumes again."""
        loop = asyncio.get_running_loop()
        if self._stopped or session.lost is not None or loop.time() < self._next_check:
            return session.lost is not None and not self._stopped
        self._next_check = loop.time() + CHECK_EVERY.total_seconds()
        try:
            queue = await session.channel.declare_queue(self.queue, passive=True)
        except aiormq.exceptions.ChannelNotFoundEntity:
            session.on_close(None, ConsumerGone())  # the broker closed the channel too
        except FAILURES:
            pass  # the connection's own callbacks say what happened
        else:
            if not queue.declaration_result.consumer_count:
                session.on_close(None, ConsumerGone())
        return session.lost is not None

    def _count_redelivery(self, identity: bytes) -> int:
        """The delivery count of a redelivered message the queue does not count (a classic
        queue sets no ``x-delivery-count``), as this transport counts: 2 the first time it
        sees the message, one more each time after. Without it a failing message would be
        given back for good, never dead-lettered. Each consumer process counts its own, so a
        message that fails everywhere is dead-lettered after at most ``max_deliveries``
        deliveries to each."""
        count = self._redeliveries.pop(identity, 1) + 1
        self._redeliveries[identity] = count
        while len(self._redeliveries) > REDELIVERIES_KEPT:
            self._redeliveries.popitem(last=False)
        return count

    def _forget_redeliveries(self, identity: bytes) -> None:
        self._redeliveries.pop(identity, None)

    def _hold(self, delivery: RabbitMQDelivery, seconds: float) -> None:
        """Requeue ``delivery`` after ``seconds``, or half the stated ``consumer_timeout``
        where that is sooner: held longer, RabbitMQ would close the channel and give back
        every message on it."""
        if self.consumer_timeout > timedelta(0):
            seconds = min(seconds, self.consumer_timeout.total_seconds() / 2)
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
        except FAILURES as exc:
            raise_translated(exc, "stop consuming")

    async def close(self) -> None:
        """Close the connection: held and unsettled messages go back to the queue."""
        self._stopped = True
        for task in list(self._held):
            task.cancel()
        session, self._session = self._session, None
        if session is not None:
            await self._discard(session)

    async def _discard(self, session: Session) -> None:
        session.on_close(None)
        with contextlib.suppress(*FAILURES):
            await session.connection.close()
