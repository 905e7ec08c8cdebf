"""One RabbitMQ delivery: the envelope read from the AMQP message, and how each settlement is
carried out on the channel it came on."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from datetime import datetime, timedelta
from decimal import Decimal
from typing import TYPE_CHECKING, Any

import aio_pika
import aiormq
from aio_pika.abc import AbstractIncomingMessage, DeliveryMode

from oncely._core.keys import Envelope
from oncely.brokers._shape import DeadLetter
from oncely.brokers.rabbitmq._topology import (
    DELIVERY_COUNT_HEADER,
    FAILURES,
    LOGGER,
    raise_translated,
)
from oncely.errors import BrokerError, BrokerUnavailable

if TYPE_CHECKING:
    from oncely.brokers.rabbitmq._transport import RabbitMQ, Session

_DEAD_LETTER_RETRY = timedelta(seconds=5)


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
        self, message: AbstractIncomingMessage, session: Session, transport: RabbitMQ
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
        except FAILURES as exc:
            raise_translated(exc, "acknowledge a message")

    async def _requeue(self) -> None:
        try:
            await self._message.nack(requeue=True)
        except FAILURES as exc:
            raise_translated(exc, "requeue a message")

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
        except FAILURES as exc:
            raise_translated(exc, f"publish to the dead-letter exchange {topology.dead_letter!r}")
        await self.ack()

    async def extend(self) -> None:
        """Nothing to do: RabbitMQ does not redeliver a message its live consumer holds."""
