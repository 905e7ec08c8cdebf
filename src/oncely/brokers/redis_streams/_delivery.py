"""One Redis Streams delivery: an entry pending for this consumer until it is settled."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING

from oncely.brokers._shape import (
    CONSUMER_HEADER,
    DELIVERIES_HEADER,
    OUTCOME_HEADER,
    REASON_HEADER,
    DeadLetter,
)
from oncely.brokers.redis_streams._layout import LOGGER, as_text, ms
from oncely.keys import Envelope

if TYPE_CHECKING:
    from oncely.brokers.redis_streams._transport import RedisStreams

_WHY_FIELDS = frozenset(
    f.encode() for f in (OUTCOME_HEADER, REASON_HEADER, CONSUMER_HEADER, DELIVERIES_HEADER)
)


class RedisStreamsDelivery:
    """One entry delivered to this consumer, pending in the group until settled."""

    __slots__ = ("_count", "_envelope", "_fields", "_id", "_refusal", "_settled", "_transport")

    def __init__(
        self,
        transport: RedisStreams,
        entry_id: bytes,
        fields: Sequence[tuple[bytes, bytes]],
        count: int,
    ) -> None:
        self._transport = transport
        self._id = entry_id
        self._fields = fields
        self._count = count
        self._settled = False
        per_delivery: dict[str, object] = {
            "stream": transport.stream,
            "entry_id": as_text(entry_id),
            "consumer": transport.consumer,
            "delivery_count": count,
            "redelivered": count > 1,
        }
        self._envelope, self._refusal = transport._layout.envelope(fields, count, per_delivery)

    @property
    def envelope(self) -> Envelope:
        return self._envelope

    @property
    def delivery_count(self) -> int:
        return self._count

    @property
    def refusal(self) -> str | None:
        return self._refusal

    @property
    def entry_id(self) -> str:
        return as_text(self._id)

    @property
    def identity(self) -> tuple[str, bytes]:
        """The stream and the entry id: the same on each delivery of the entry."""
        return (self._transport.stream, self._id)

    @property
    def fields(self) -> Sequence[tuple[bytes, bytes]]:
        """The entry's fields as stored, in order."""
        return self._fields

    def describe(self) -> Mapping[str, object]:
        return self._envelope.transport

    async def ack(self) -> None:
        """``XACK`` the entry."""
        transport = self._transport
        client = transport._settling()
        with transport._errors("acknowledge an entry"):
            await client.xack(transport.stream, transport.group, self._id)
        self._done()

    async def retry(self, delay: timedelta) -> None:
        """Leave the entry pending, claimable by any consumer's ``XAUTOCLAIM`` once ``delay``
        has passed (its idle time set to ``ack_wait - delay``)."""
        await self._set_idle(self._transport._ack_wait_ms - ms(delay))
        self._done()

    async def extend(self) -> None:
        """Reset the entry's idle time, so ``XAUTOCLAIM`` leaves it alone for ``ack_wait``."""
        await self._set_idle(0)

    async def dead_letter(self, why: DeadLetter) -> None:
        """Copy the entry with ``why`` to the dead-letter stream and ``XACK`` it, atomically."""
        transport = self._transport
        client = transport._settling()
        args: list[bytes | str | int] = [transport.group, transport.consumer, self._id]
        for name, value in self._fields:
            if name not in _WHY_FIELDS:
                args += [name, value]
        for header, text in why.headers().items():
            args += [header, text]
        with transport._errors("dead-letter an entry"):
            copied = await transport._scripts["dead_letter"](
                keys=[transport.stream, transport.dead_letter_stream], args=args, client=client
            )
        if copied is None:
            self._left_to_owner("; not dead-lettered here (its owner settles it)")
        self._done()

    async def _set_idle(self, idle_ms: int) -> None:
        transport = self._transport
        client = transport._settling()
        with transport._errors("set an entry's idle time"):
            owned = await transport._scripts["set_idle"](
                keys=[transport.stream],
                args=[transport.group, transport.consumer, self._id, max(0, idle_ms)],
                client=client,
            )
        if not owned:
            self._left_to_owner(" (taken over or settled); left to its owner")

    def _left_to_owner(self, what: str) -> None:
        LOGGER.info(
            "oncely broker=redis-streams entry %s of %r is no longer held by %r%s",
            self.entry_id,
            self._transport.stream,
            self._transport.consumer,
            what,
        )

    def _done(self) -> None:
        self._settled = True
        self._transport._held.pop(self._id, None)
