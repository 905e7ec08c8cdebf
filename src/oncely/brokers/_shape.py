"""The one shape every broker adapter has: a :class:`Transport` that hands out
:class:`Delivery` objects, and the settings that say how outcomes become broker actions.

An adapter is a transport: it reads with manual acknowledgement, turns each broker message into
an :class:`~oncely.Envelope` (the producer's message id and headers; per-delivery data such as a
delivery tag or stream entry id only in ``Envelope.transport``, which no key source reads, R4),
and carries out the action :class:`~oncely.brokers.BrokerConsumer` asks for. It decides nothing.

===================  =============================  ================================================
outcome              action                          what a transport does
===================  =============================  ================================================
processed/duplicate  ack                             acknowledge
stale_reclaimed      ack                             acknowledge
in_flight            requeue later                   give the message back once the holder's lease
                                                     has run out (at least ``requeue_delay``)
failed               retry                           give it back after a backoff; once it
                                                     has failed ``max_deliveries`` times
                                                     dead-letter it instead
key_conflict         dead-letter                     copy it to the dead-letter destination with
rejected                                             the outcome and reason, then remove it
escalated            park                            the same, with outcome ``escalated``
===================  =============================  ================================================
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol, runtime_checkable

from oncely._core.policy import RedeliveryHorizon
from oncely.errors import ConfigurationError
from oncely.keys import Envelope

__all__ = [
    "Backoff",
    "BrokerLimits",
    "ConsumerSettings",
    "DeadLetter",
    "Delivery",
    "Transport",
]

REASON_HEADER = "x-oncely-reason"
OUTCOME_HEADER = "x-oncely-outcome"
CONSUMER_HEADER = "x-oncely-consumer"
DELIVERIES_HEADER = "x-oncely-deliveries"


@dataclass(frozen=True, slots=True, kw_only=True)
class DeadLetter:
    """Why a message goes to the dead-letter destination, as recorded on the copy there:
    ``x-oncely-outcome``, ``x-oncely-reason``, ``x-oncely-consumer`` and
    ``x-oncely-deliveries`` headers (or stream fields)."""

    outcome: str
    reason: str
    consumer: str
    deliveries: int | None

    def headers(self) -> dict[str, str]:
        fields = {
            OUTCOME_HEADER: self.outcome,
            REASON_HEADER: self.reason,
            CONSUMER_HEADER: self.consumer,
        }
        if self.deliveries is not None:
            fields[DELIVERIES_HEADER] = str(self.deliveries)
        return fields


class Delivery(Protocol):
    """One delivery of a message, held unacknowledged until one of the settling calls.

    Exactly one of :meth:`ack`, :meth:`retry` and :meth:`dead_letter` is called per delivery.
    Each may raise :class:`~oncely.BrokerUnavailable` when the connection is gone; the broker
    then redelivers the message, which the inbox answers as ``duplicate`` if it was processed.

    A delivery may offer ``identity``: a hashable value that tells its message apart from
    every other on the broker and is the same on each of its deliveries (JetStream's stream
    sequence, a Redis Streams entry id, SQS's ``MessageId``). The consumer keys the
    give-backs it made of a message by it, to count the message's failures apart from them;
    without it, a digest of the message id and the body.
    """

    @property
    def envelope(self) -> Envelope:
        """The message as the inbox reads it (``body`` still undecoded bytes)."""
        ...

    @property
    def delivery_count(self) -> int | None:
        """1 for the first delivery, as the broker counts; ``None`` when it does not say."""
        ...

    @property
    def refusal(self) -> str | None:
        """Why this delivery cannot be read at all, or ``None``: an id or property that is
        not UTF-8 text, a field the message must have that is missing. The consumer
        dead-letters a refused delivery as ``rejected`` with this reason, before decoding its
        body and without running the handler."""
        ...

    def describe(self) -> Mapping[str, object]:
        """Per-delivery transport fields for logs (delivery tag, entry id, redelivered)."""
        ...

    async def ack(self) -> None:
        """The message is done: remove it from the queue, stream or consumer."""
        ...

    async def retry(self, delay: timedelta) -> None:
        """Give the message back for a later delivery, no sooner than ``delay`` (never an ack)."""
        ...

    async def dead_letter(self, why: DeadLetter) -> None:
        """Copy the message to the dead-letter destination with ``why`` recorded on it, then
        remove it. The copy is confirmed by the broker before the original is removed, so a
        crash in between dead-letters it twice rather than never."""
        ...

    async def extend(self) -> None:
        """Tell the broker the message is still being worked on (reset its ack wait or idle
        time) so it is not redelivered to another consumer meanwhile. May do nothing."""
        ...


@dataclass(frozen=True, slots=True, kw_only=True)
class BrokerLimits:
    """What a transport knows, after :meth:`Transport.open`, about how long its broker can keep
    handing out a message: the inputs of the consumer's redelivery horizon (R13).

    ``ack_wait`` is how long one delivery may stay unsettled before the broker gives the
    message to another consumer (JetStream's ack wait, the Redis Streams idle time before a
    takeover, RabbitMQ's consumer timeout); ``message_ttl`` how long a message may wait in the
    queue or stream (``None``: the broker sets no limit, or the transport cannot read it);
    ``max_deliveries`` the broker's own delivery limit (``None``: none). ``source`` says where
    the numbers come from, for the consumer's start-up line.

    A transport of your own may offer them as a ``limits`` property; without it the consumer
    assumes an ack wait of three times :attr:`Transport.extend_every` (zero when that is
    ``None``) and takes the time-to-live from :attr:`ConsumerSettings.message_ttl`.
    """

    ack_wait: timedelta | None = None
    message_ttl: timedelta | None = None
    max_deliveries: int | None = None
    source: str = ""


@runtime_checkable
class Transport(Protocol):
    """A broker connection that reads deliveries with manual acknowledgement.

    A transport that writes dead letters by itself (on the broker's last delivery, past its
    own delivery limit) may offer ``set_inbox_consumer(consumer: str) -> None``:
    :class:`~oncely.brokers.BrokerConsumer` calls it with its inbox's consumer name, which
    those dead letters record in ``x-oncely-consumer`` like every other one."""

    @property
    def name(self) -> str:
        """The broker's name in logs: ``rabbitmq``, ``redis-streams``, ``nats``."""
        ...

    @property
    def extend_every(self) -> timedelta | None:
        """How often a running handler's delivery needs :meth:`Delivery.extend`; ``None`` when
        the broker never redelivers a message a live consumer holds."""
        ...

    async def open(self, prefetch: int) -> None:
        """Connect, declare what is missing, and start reading at most ``prefetch``
        unacknowledged messages at a time. Raises :class:`~oncely.BrokerUnavailable`."""
        ...

    async def fetch(self, limit: int, timeout: timedelta) -> list[Delivery]:
        """Up to ``limit`` deliveries, waiting at most ``timeout`` for the first. Raises
        :class:`~oncely.BrokerUnavailable` when the connection is down (the transport
        reconnects on the next call)."""
        ...

    async def stop(self) -> None:
        """Stop reading new messages; deliveries already handed out can still be settled."""
        ...

    async def close(self) -> None:
        """Close the connection. Unsettled deliveries go back to the broker."""
        ...


@dataclass(frozen=True, slots=True, kw_only=True)
class Backoff:
    """Delays between retries of a failed message: ``first``, then times ``factor`` up to
    ``most``. ``Backoff()`` waits 1s, 2s, 4s ... 1 minute."""

    first: timedelta = timedelta(seconds=1)
    factor: float = 2.0
    most: timedelta = timedelta(minutes=1)

    def __post_init__(self) -> None:
        if self.first < timedelta(0) or self.most < self.first or self.factor < 1:
            raise ConfigurationError("Backoff needs 0 <= first <= most and factor >= 1")

    def delay(self, deliveries: int | None) -> timedelta:
        """The delay before the next delivery after ``deliveries`` failed ones."""
        n = max(1, deliveries or 1)
        most = self.most.total_seconds()
        seconds = self.first.total_seconds() * self.factor ** min(n - 1, 64)
        # Compared as floats: a high delivery count overflows a timedelta long before ``most``.
        return self.most if seconds >= most else timedelta(seconds=seconds)


@dataclass(frozen=True, slots=True, kw_only=True)
class ConsumerSettings:
    """How a :class:`~oncely.brokers.BrokerConsumer` reads and settles.

    ``concurrency`` messages run at once and the broker hands out at most that many
    unacknowledged (prefetch). ``requeue_delay`` is the least an ``in_flight`` message waits
    before it is given back; it waits for what is left of the lease the key is held under where
    that is longer (up to 5 minutes at a time), so a dead worker's claim does not spend the
    message's deliveries while it runs out. Meanwhile the consumer holds it and reads the key's
    record (one read per held message every 1.5 s at most): once the holder completes, releases
    its claim or lets its lease lapse, the message goes through the inbox again at once, on the
    same delivery (a ``duplicate`` acknowledged, or run), rather than after the whole wait; a
    stop gives it back at once. At most ``max(concurrency, batch)`` such messages are held at
    once; more are given back after that wait, as they were before. A ``failed`` message is
    retried after ``backoff`` until it has failed ``max_deliveries`` times, then dead-lettered
    with the last error and the number of failures (R13: keep the broker's own limit at or above
    this one, or set it here to the broker's). Failures are the broker's delivery count less the
    deliveries this consumer process gave back unrun (an ``in_flight`` copy, the store away): a
    message given back while another copy held its key still gets all its runs. Give-backs made
    by another process, or before a restart, are not known to this one and count as failures
    (the message is dead-lettered sooner, never later); the broker's own delivery limit still
    bounds every message, given back or failing. On shutdown, running handlers get
    ``shutdown_grace`` to finish; the rest are cancelled, their claims released and their
    messages given back. A body longer than ``max_body_bytes`` (``None``: no limit) is
    dead-lettered as ``rejected`` without being decoded. With ``purge_every``, the consumer also
    runs a purge service on its inbox's store (:class:`~oncely.AsyncPurgeService`): across a
    fleet, one consumer per table leads it.

    ``batch`` is how many deliveries are read and run through the inbox together: one
    ``claim_many`` per batch instead of a claim per message (R1), the messages of one ordering
    group (a Kafka partition, an SQS FIFO message group) one after the other and up to
    ``concurrency`` groups at once. Each group is completed and settled as it ends (the groups
    that end within a few milliseconds of each other in one ``complete_many``), and more is
    read meanwhile, up to ``batch`` deliveries unsettled in all, so a slow handler holds up
    its own group only; the groups of all the batches running share ``concurrency``. ``None``
    takes the transport's choice (``batch_default``: 500 on Kafka, 10 on SQS, one message at
    a time on the others); ``1`` runs each message on its own as it arrives.

    The redelivery horizon (R13) is derived from these settings and what the broker says
    (:meth:`horizon`), and a consumer whose inbox keeps records for less refuses to start.
    ``resubmit_window`` is how long after a message is dead-lettered an operator may still
    send it back to the queue; ``message_ttl`` how long a message may wait before its
    first delivery, for a broker whose transport cannot read it (a queue policy, the longest
    backlog you allow); when the broker says too, the longer of the two counts.
    """

    concurrency: int = 16
    requeue_delay: timedelta = timedelta(seconds=1)
    backoff: Backoff = Backoff()
    max_deliveries: int = 5
    poll: timedelta = timedelta(seconds=1)
    reconnect: Backoff = Backoff(first=timedelta(milliseconds=200), most=timedelta(seconds=10))
    shutdown_grace: timedelta = timedelta(seconds=30)
    max_body_bytes: int | None = None
    purge_every: timedelta | None = None
    resubmit_window: timedelta = timedelta(days=1)
    message_ttl: timedelta | None = None
    batch: int | None = None

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ConfigurationError("concurrency must be at least 1")
        if self.batch is not None and self.batch < 1:
            raise ConfigurationError("batch must be at least 1 (None: the transport's choice)")
        if self.max_deliveries < 1:
            raise ConfigurationError("max_deliveries must be at least 1")
        if self.poll <= timedelta(0):
            raise ConfigurationError("poll must be positive")
        if self.max_body_bytes is not None and self.max_body_bytes < 0:
            raise ConfigurationError("max_body_bytes must not be negative (None: no limit)")
        if self.purge_every is not None and self.purge_every <= timedelta(0):
            raise ConfigurationError("purge_every must be positive (None: no purge service)")
        if self.resubmit_window < timedelta(0):
            raise ConfigurationError("resubmit_window must not be negative")
        if self.message_ttl is not None and self.message_ttl < timedelta(0):
            raise ConfigurationError("message_ttl must not be negative (None: unknown)")

    def horizon(self, limits: BrokerLimits | None = None) -> RedeliveryHorizon:
        """The redelivery horizon of a consumer with these settings on a broker with
        ``limits`` (R13): the longest time after a record's last write that the broker may
        still hand out a copy of its message.

        Each of up to ``max_deliveries`` deliveries (or the broker's own lower limit) may be
        held for the broker's ack wait and then wait for the longest retry delay this
        consumer asks for (the backoff before the last retry, or ``requeue_delay``); the
        message may wait in the queue for its time-to-live first, and an operator may
        resubmit it from the dead-letter queue for ``resubmit_window`` after that.
        """
        limits = limits if limits is not None else BrokerLimits()
        deliveries = self.max_deliveries
        if limits.max_deliveries is not None and limits.max_deliveries > 0:
            deliveries = min(deliveries, limits.max_deliveries)
        delay = self.requeue_delay
        if deliveries > 1:
            delay = max(delay, self.backoff.delay(deliveries - 1))
        known = [t for t in (self.message_ttl, limits.message_ttl) if t is not None]
        ttl = max(known) if known else None
        return RedeliveryHorizon(
            max_deliveries=deliveries,
            lock=limits.ack_wait if limits.ack_wait is not None else timedelta(0),
            message_ttl=ttl if ttl is not None else timedelta(0),
            redelivery_delay=delay,
            resubmit_window=self.resubmit_window,
        )
