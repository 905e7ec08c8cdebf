"""What the middleware asks of each FastStream broker: one small adapter per broker, chosen
from the subscriber that received the message. The middleware decides (claim, outcome,
delivery limit); an adapter only reads its broker's raw message and carries out the broker
action it is told."""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Hashable
from dataclasses import dataclass
from datetime import timedelta
from importlib import import_module
from typing import Any, Protocol

from oncely.brokers._shape import DeadLetter
from oncely.keys import Envelope

__all__ = ["ADAPTED", "DEAD_LETTER_SUFFIX", "Adapter", "Delivery", "Settling", "adapter_for"]

DEAD_LETTER_SUFFIX = ".dead"
"""A subscriber's queue, subject or stream ``q`` dead-letters to ``q`` plus this suffix."""


@dataclass(frozen=True, slots=True)
class Delivery:
    """A message as the inbox reads it, and why it cannot be read at all (``None`` when it
    can): no producer's id, an id that is not UTF-8. An id the client made up is no refusal
    here but the envelope's ``message_id_refusal``, as the broker transports read it: a key
    source that reads another field may still find a key."""

    envelope: Envelope
    refusal: str | None


@dataclass(frozen=True, slots=True)
class Settling:
    """One message being settled by the middleware: FastStream's message, the client's raw
    message under it, the subscriber's source (queue, subject or stream), the subscriber and
    the broker; ``later`` runs a settlement in the background (a delayed give-back)."""

    message: Any
    raw: Any
    source: str
    subscriber: Any
    broker: Any
    later: Callable[[Coroutine[Any, Any, None]], None]


class Adapter(Protocol):
    """One FastStream broker as the middleware sees it."""

    broker_name: str
    """The broker as users call it, for messages (``"RabbitMQ"``)."""

    def source_of(self, subscriber: Any) -> str | None:
        """The queue, subject or stream ``subscriber`` reads (the key of an inbox mapping)."""
        ...

    def unprotectable(self, subscriber: Any) -> str | None:
        """Why the middleware cannot protect ``subscriber`` (a subscriber whose broker never
        redelivers, or one that acknowledges on its own), or ``None``."""
        ...

    def is_delivery(self, raw: object) -> bool:
        """Whether ``raw`` is a single message of this broker's client."""
        ...

    async def read(self, message: Any, *, trust_hex: bool) -> Delivery:
        """The envelope of FastStream's ``message``, read from the raw message: the
        producer's id, never one FastStream or the client made up; the broker's delivery
        count."""
        ...

    def delivery_limit(self, subscriber: Any) -> int | None:
        """The broker's own delivery limit for ``subscriber``'s messages, past which it
        would not deliver a message again (``None``: none)."""
        ...

    def counted_give_back(self, held: Settling) -> Hashable | None:
        """The message's identity on its broker (the same on each of its deliveries) where
        the broker counts a give-back of it as a delivery, so that the count the next
        delivery reads includes it; ``None`` where a give-back keeps the count (a copy that
        carries it, a rewind) or the broker counts no deliveries. The middleware takes the
        give-backs it noted off that count: ``max_deliveries`` counts failures."""
        ...

    def extend_every(self, held: Settling) -> timedelta | None:
        """How often to tell the broker, while the handler runs, that the message is still
        being worked on, so that it is not delivered to another consumer meanwhile (``None``:
        the broker needs no telling)."""
        ...

    async def extend(self, held: Settling) -> None:
        """Tell the broker the message is still being worked on."""
        ...

    async def give_back(self, held: Settling, delay: timedelta) -> None:
        """Have the broker deliver the message again, no sooner than ``delay``; never an
        ack (``in_flight``, a store that cannot answer, a dead letter that failed)."""
        ...

    async def retry(self, held: Settling, delay: timedelta, count: int) -> None:
        """As :meth:`give_back`, for a failure: the next delivery counts ``count + 1``."""
        ...

    async def dead_letter(self, held: Settling, why: DeadLetter) -> None:
        """Copy the message with ``why`` to its dead-letter destination, confirmed, then
        remove the original; raises when the copy could not be made (the original is then
        left for :meth:`give_back`)."""
        ...

    async def dead_letter_unread(
        self, raw: Any, subscriber: Any, broker: Any, why: DeadLetter
    ) -> bool:
        """Copy ``raw``, a message FastStream failed to parse (so there is no FastStream
        message), with ``why`` to its dead-letter destination; ``False`` when this broker's
        messages cannot fail that way (FastStream's parser takes whatever its client gives)."""
        ...

    def settled(self, held: Settling) -> None:
        """The middleware settled the message itself: make FastStream's own ack of it do
        nothing."""
        ...

    def stamp(self, cmd: Any, message_id: str) -> None:
        """Give a result the handler publishes ``message_id``, unless it has one."""
        ...


# The subscriber's package names its broker; the adapter module is imported on first use, so
# an app needs the client library of its own broker only.
_MODULES = {
    "faststream.rabbit": ("RabbitBroker", "oncely.integrations.faststream._rabbit"),
    "faststream.nats": ("NatsBroker (JetStream)", "oncely.integrations.faststream._nats"),
    "faststream.redis": ("RedisBroker (streams)", "oncely.integrations.faststream._redis"),
    "faststream.kafka": ("KafkaBroker (aiokafka)", "oncely.integrations.faststream._kafka"),
}
ADAPTED = ", ".join(broker for broker, _ in _MODULES.values())
"""FastStream's brokers that have an adapter, for error messages."""


def adapter_for(subscriber: object) -> Adapter | None:
    """A new adapter for the broker of ``subscriber`` (``None``: a broker not adapted)."""
    module = type(subscriber).__module__
    for package, (_, name) in _MODULES.items():
        if module == package or module.startswith(package + "."):
            made: Adapter = import_module(name).ADAPTER()
            return made
    return None
