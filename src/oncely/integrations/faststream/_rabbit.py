"""FastStream's RabbitMQ messages as oncely reads and settles them: the raw aio-pika message
is the source of truth, never the id FastStream or the client made up."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from aio_pika.abc import AbstractIncomingMessage, DeliveryMode
from faststream.rabbit import RabbitQueue

from oncely.brokers._common import not_utf8
from oncely.brokers._shape import REASON_HEADER, DeadLetter
from oncely.brokers.rabbitmq._delivery import (
    _delivery_count,
    _header_value,
    _sendable_headers,
    dead_letter_headers,
    producer_id,
)
from oncely.brokers.rabbitmq._frames import (
    WholeHeaderNames,
    cut_reason,
    header_frame,
    negotiated,
)
from oncely.brokers.rabbitmq._topology import DELIVERY_COUNT_HEADER
from oncely.integrations.faststream._adapter import DEAD_LETTER_SUFFIX, Delivery, Settling
from oncely.keys import Envelope

__all__ = ["ADAPTER", "DELIVERIES_HEADER", "RabbitAdapter"]

DELIVERIES_HEADER = "x-oncely-delivered"
"""On a copy sent back to the queue for a retry: how many times the message was delivered
(RabbitMQ's classic queues count no deliveries, and a requeue keeps no header)."""
_COUNTS = (DELIVERY_COUNT_HEADER, DELIVERIES_HEADER)
_TRUST = "pass trust_hex_message_ids=True to Idempotency"
_PROPERTIES = (
    ("message_id", "message id (AMQP message_id property)"),
    ("correlation_id", "correlation id (AMQP correlation_id property)"),
)


class RabbitAdapter:
    """FastStream's RabbitBroker (see :mod:`oncely.integrations.faststream`)."""

    broker_name = "RabbitMQ"

    def __init__(self) -> None:
        self._declared: set[tuple[int, str]] = set()
        self._trust_hex = False
        """The middleware's ``trust_hex_message_ids``, as :meth:`read` was last given it (one
        adapter serves one middleware): a dead letter tells whose id its message carried."""

    def source_of(self, subscriber: Any) -> str | None:
        name = getattr(getattr(subscriber, "queue", None), "name", None)
        return name if isinstance(name, str) else None

    def unprotectable(self, subscriber: Any) -> str | None:
        return None

    def is_delivery(self, raw: object) -> bool:
        return isinstance(raw, AbstractIncomingMessage)

    async def read(self, message: Any, *, trust_hex: bool) -> Delivery:
        self._trust_hex = trust_hex
        return _read(message.raw_message, trust_hex=trust_hex)

    def delivery_limit(self, subscriber: Any) -> int | None:
        return None

    def counted_give_back(self, held: Settling) -> None:
        """None: on a quorum queue a give-back is a copy carrying the count this delivery
        had; a classic queue counts no deliveries (a requeue leaves ``x-oncely-delivered``
        as it was)."""
        return None

    def extend_every(self, held: Settling) -> timedelta | None:
        return None  # an unacknowledged message stays with its consumer while it is connected

    async def extend(self, held: Settling) -> None:
        return None

    async def give_back(self, held: Settling, delay: timedelta) -> None:
        # RabbitMQ has no delayed requeue: the message is held unacknowledged meanwhile
        # (locked, so FastStream leaves it alone).
        held.raw.lock()
        if _counts_requeues(held):
            # A quorum queue counts every requeue against its x-delivery-limit (RabbitMQ 4
            # sets one by default) and drops or dead-letters the message past it: a message
            # given back unrun (a running copy, a dead worker's live lease) would be spent.
            # A copy at the tail keeps the count this delivery had instead.
            count = _count(held.raw.headers or {}, bool(held.raw.redelivered)) or 1
            held.later(_retry_later(held.broker, held.raw, held.source, delay, count - 1))
            return
        held.later(_requeue_later(held.raw, delay))

    async def retry(self, held: Settling, delay: timedelta, count: int) -> None:
        held.raw.lock()
        held.later(_retry_later(held.broker, held.raw, held.source, delay, count))

    async def dead_letter(self, held: Settling, why: DeadLetter) -> None:
        target = held.source + DEAD_LETTER_SUFFIX
        marker = (id(held.broker), target)
        if marker not in self._declared:
            await held.broker.declare_queue(RabbitQueue(target, durable=True))
            self._declared.add(marker)
        producers_id = _producer_id(held.raw, trust_hex=self._trust_hex)[0] is not None
        await _dead_letter(held.broker, held.raw, target, why, producers_id=producers_id)

    async def dead_letter_unread(
        self, raw: Any, subscriber: Any, broker: Any, why: DeadLetter
    ) -> bool:
        return False  # FastStream's parser of this broker reads every message its client gives

    def settled(self, held: Settling) -> None:
        if not held.raw.locked:
            held.raw.lock()

    def stamp(self, cmd: Any, message_id: str) -> None:
        options = getattr(cmd, "message_options", None)
        if isinstance(options, dict) and not options.get("message_id"):
            options["message_id"] = message_id


ADAPTER = RabbitAdapter


def _read(raw: AbstractIncomingMessage, *, trust_hex: bool) -> Delivery:
    headers_in = raw.headers or {}
    headers = {
        name: _header_value(value)
        for name, value in headers_in.items()
        if name not in (DELIVERY_COUNT_HEADER, DELIVERIES_HEADER)
    }
    refusal = not_utf8((what, getattr(raw, name, None)) for name, what in _PROPERTIES)
    message_id, made_up = raw.message_id or None, None
    if refusal is None:
        message_id, made_up = _producer_id(raw, trust_hex=trust_hex)
    envelope = Envelope(
        body=raw.body,
        message_id=message_id,
        headers=headers,
        correlation_id=raw.correlation_id or None,
        delivery_count=_count(headers_in, bool(raw.redelivered)),
        transport={
            "delivery_tag": raw.delivery_tag,
            "redelivered": bool(raw.redelivered),
            "content_type": raw.content_type,
            "content_encoding": raw.content_encoding,
        },
        message_id_refusal=made_up,
    )
    return Delivery(envelope, refusal)


def _producer_id(raw: AbstractIncomingMessage, *, trust_hex: bool) -> tuple[str | None, str | None]:
    """The producer's id of ``raw``, and why the id it carries is not one (an id the client
    made up), as :mod:`oncely.brokers.rabbitmq` reads it."""
    if type(raw).__name__ == "PatchedMessage" and raw.message_id == raw.correlation_id:
        # FastStream's test broker copies a made-up correlation id into message_id.
        return None, None
    return producer_id(raw.message_id, trust_hex=trust_hex, trust=_TRUST)


def _counts_requeues(held: Settling) -> bool:
    """Whether the queue of ``held`` counts deliveries (a quorum queue: declared so, or its
    message carries ``x-delivery-count``)."""
    if DELIVERY_COUNT_HEADER in (held.raw.headers or {}):
        return True
    arguments = getattr(getattr(held.subscriber, "queue", None), "arguments", None) or {}
    return arguments.get("x-queue-type") == "quorum"


def _count(headers: Mapping[str, object], redelivered: bool) -> int | None:
    count = _delivery_count(headers, redelivered)
    earlier = headers.get(DELIVERIES_HEADER)
    if isinstance(earlier, int) and not isinstance(earlier, bool) and earlier >= 0:
        return max(count or 0, earlier + 1)
    return count


async def _retry_later(
    broker: Any, raw: AbstractIncomingMessage, queue: str, delay: timedelta, count: int
) -> None:
    """After ``delay``, send a copy of ``raw`` that says it was delivered ``count`` times to
    the tail of ``queue``, then ack the original; should the copy not go, the original goes
    back as it is (counted once less, never lost)."""
    await asyncio.sleep(delay.total_seconds())
    headers = _sendable_headers(raw.headers or {})
    headers[DELIVERIES_HEADER] = count
    try:
        await _copy(broker, raw, queue, headers)
    except Exception:
        await _requeue_later(raw, timedelta(0))
        return
    try:
        await raw.ack()
    except Exception:  # the channel closed: the original comes back too, a duplicate
        return


async def _requeue_later(raw: AbstractIncomingMessage, delay: timedelta) -> None:
    await asyncio.sleep(delay.total_seconds())
    try:
        await raw.nack(requeue=True)
    except Exception:  # the channel closed meanwhile: RabbitMQ requeued it already
        return


async def _dead_letter(
    broker: Any, raw: AbstractIncomingMessage, target: str, why: DeadLetter, *, producers_id: bool
) -> None:
    """Publish a copy of ``raw`` to ``target`` with the reason, then ack the original; the
    copy's headers as :mod:`oncely.brokers.rabbitmq` writes them (``producers_id``: whether
    the id ``raw`` carries is the producer's)."""
    headers = dead_letter_headers(raw, why, producers_id=producers_id)
    await _copy(broker, raw, target, headers)
    await raw.ack()


def _fit(raw: AbstractIncomingMessage, copy: WholeHeaderNames, headers: dict[str, Any]) -> bool:
    """Cut the reason in ``headers`` where ``copy`` would not fit the connection's
    ``frame_max`` (RabbitMQ would close the connection, every message on it given back and
    this one to fail again); whether it was cut."""
    try:
        underlay = raw.channel
    except Exception:  # none (FastStream's test broker) or closed: the publish tells
        return False
    over = header_frame(copy) - negotiated(underlay)
    if over <= 0:
        return False
    headers[REASON_HEADER] = cut_reason(str(headers.get(REASON_HEADER, "")), over)
    return True


async def _copy(
    broker: Any, raw: AbstractIncomingMessage, queue: str, headers: dict[str, Any]
) -> None:
    # A message FastStream publishes as it is: its header names go whole (up to AMQP's 255
    # bytes), where the client library cuts them at 128 and merges two that share their start.
    def made() -> WholeHeaderNames:
        return WholeHeaderNames(
            raw.body,
            headers=headers,
            message_id=raw.message_id,
            correlation_id=raw.correlation_id,
            content_type=raw.content_type,
            content_encoding=raw.content_encoding,
            type=raw.type,
            timestamp=raw.timestamp,
            delivery_mode=DeliveryMode.PERSISTENT,
        )

    copy = made()
    if REASON_HEADER in headers and _fit(raw, copy, headers):
        copy = made()
    await broker.publish(copy, queue=queue)
