"""An in-memory at-least-once broker for testing consumers without a server.

:class:`MemoryBroker` is a :class:`~oncely.brokers.Transport` with the habits of a real broker
that matter to a consumer: it redelivers what was not acknowledged (after ``retry``, or when the
transport closes with deliveries outstanding), counts deliveries, honours delays, and keeps a
dead-letter list with the reason recorded on each message. Use it to test a handler and its
outcomes in milliseconds; the real adapters (:mod:`oncely.brokers`) are tested against real
servers.

::

    broker = MemoryBroker()
    broker.publish(b'{"amount": 5}', message_id="pay-1")
    broker.publish(b'{"amount": 5}', message_id="pay-1")  # a producer retry
    consumer = BrokerConsumer(broker, inbox, charge)
    await broker.run_until_idle(consumer)
    assert broker.acked == 2 and not broker.dead
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta

from oncely._core.keys import Envelope
from oncely.brokers._common import not_utf8
from oncely.brokers._consumer import BrokerConsumer
from oncely.brokers._shape import DeadLetter, Delivery

__all__ = ["DeadMessage", "MemoryBroker"]


@dataclass(frozen=True, slots=True)
class DeadMessage:
    """A message in the dead-letter list, with why it is there."""

    body: bytes
    message_id: str | None
    headers: Mapping[str, str]
    why: DeadLetter


@dataclass(slots=True)
class _Message:
    body: bytes
    message_id: str | None
    headers: dict[str, str]
    content_type: str | None
    deliveries: int = 0
    not_before: float = 0.0


@dataclass(slots=True)
class _MemoryDelivery:
    broker: MemoryBroker
    message: _Message
    tag: int
    envelope: Envelope = field(init=False)
    settled: bool = False

    def __post_init__(self) -> None:
        message = self.message
        self.envelope = Envelope(
            body=message.body,
            message_id=message.message_id,
            headers=dict(message.headers),
            delivery_count=message.deliveries,
            transport={
                "delivery_tag": self.tag,
                "redelivered": message.deliveries > 1,
                "content_type": message.content_type,
            },
        )

    @property
    def delivery_count(self) -> int | None:
        return self.message.deliveries

    @property
    def refusal(self) -> str | None:
        return not_utf8([("message id", self.message.message_id)])

    def describe(self) -> Mapping[str, object]:
        return {"delivery_tag": self.tag, "redelivered": self.message.deliveries > 1}

    def _settle(self) -> None:
        if self.settled:
            raise RuntimeError("a delivery was settled twice")
        self.settled = True
        self.broker._unacked.pop(self.tag, None)

    async def ack(self) -> None:
        self._settle()
        self.broker.acked += 1

    async def retry(self, delay: timedelta) -> None:
        self._settle()
        self.broker.retried += 1
        self.message.not_before = asyncio.get_running_loop().time() + delay.total_seconds()
        self.broker._ready.append(self.message)
        self.broker._wake.set()

    async def dead_letter(self, why: DeadLetter) -> None:
        self._settle()
        message = self.message
        headers = {**message.headers, **why.headers()}
        self.broker.dead.append(DeadMessage(message.body, message.message_id, headers, why))

    async def extend(self) -> None:
        self.broker.extended += 1


class MemoryBroker:
    """A queue in memory with at-least-once delivery, as a :class:`~oncely.brokers.Transport`.

    ``acked``, ``retried`` and ``extended`` count those calls; ``dead`` lists dead-lettered
    messages; :attr:`outstanding` is how many messages are neither acknowledged nor
    dead-lettered. One consumer at a time.
    """

    name = "memory"

    def __init__(self, *, extend_every: timedelta | None = None) -> None:
        self.extend_every = extend_every
        self.acked = 0
        self.retried = 0
        self.extended = 0
        self.dead: list[DeadMessage] = []
        self._ready: deque[_Message] = deque()
        self._unacked: dict[int, _MemoryDelivery] = {}
        self._tags = itertools.count(1)
        self._wake = asyncio.Event()
        self._reading = False

    def publish(
        self,
        body: bytes,
        *,
        message_id: str | None = None,
        headers: Mapping[str, str] | None = None,
        content_type: str | None = "application/json",
    ) -> None:
        """Enqueue one copy (call twice with the same id for a producer retry)."""
        self._ready.append(_Message(body, message_id, dict(headers or {}), content_type))
        self._wake.set()

    @property
    def outstanding(self) -> int:
        return len(self._ready) + len(self._unacked)

    async def open(self, prefetch: int) -> None:
        self._reading = True

    async def fetch(self, limit: int, timeout: timedelta) -> list[Delivery]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout.total_seconds()
        while self._reading:
            now = loop.time()
            due = [m for m in self._ready if m.not_before <= now][:limit]
            if due:
                out: list[Delivery] = []
                for message in due:
                    self._ready.remove(message)
                    message.deliveries += 1
                    delivery = _MemoryDelivery(self, message, next(self._tags))
                    self._unacked[delivery.tag] = delivery
                    out.append(delivery)
                return out
            if now >= deadline:
                return []
            self._wake.clear()
            wake = min([deadline, *(m.not_before for m in self._ready)])
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), max(0.0, wake - now))
        return []

    async def stop(self) -> None:
        self._reading = False

    async def close(self) -> None:
        # As a broker does when a consumer's connection closes: unacknowledged messages are
        # delivered again later.
        self._reading = False
        for delivery in list(self._unacked.values()):
            delivery.settled = True
            self._ready.append(delivery.message)
        self._unacked.clear()

    async def run_until_idle(
        self, consumer: BrokerConsumer, *, idle: timedelta = timedelta(milliseconds=50)
    ) -> None:
        """Run ``consumer`` (a :class:`~oncely.brokers.BrokerConsumer` reading this broker)
        until every message is acknowledged or dead-lettered, then stop it. Messages given
        back with a delay are waited for."""
        if consumer.transport is not self:
            raise TypeError("run_until_idle needs a BrokerConsumer reading this broker")
        task = asyncio.create_task(consumer.run())
        try:
            while self.outstanding:
                if task.done():
                    await task
                    break
                await asyncio.sleep(idle.total_seconds())
        finally:
            consumer.stop()
            await task
