"""One RabbitMQ delivery: the envelope read from the AMQP message, and how each settlement is
carried out on the channel it came on."""

from __future__ import annotations

import asyncio
import hashlib
import re
from collections.abc import Mapping
from datetime import datetime, timedelta
from decimal import Decimal
from typing import TYPE_CHECKING, Any

import aiormq
from aio_pika.abc import AbstractIncomingMessage, DeliveryMode

from oncely.brokers._common import not_utf8
from oncely.brokers._shape import REASON_HEADER, DeadLetter
from oncely.brokers.rabbitmq._frames import (
    WholeHeaderNames,
    cut_reason,
    frame_max,
    header_frame,
)
from oncely.brokers.rabbitmq._topology import (
    DELIVERY_COUNT_HEADER,
    FAILURES,
    LOGGER,
    raise_translated,
)
from oncely.errors import BrokerError, BrokerUnavailable
from oncely.keys import Envelope
from oncely.wire import escaped, raw_bytes, wire_text

if TYPE_CHECKING:
    from oncely.brokers.rabbitmq._transport import RabbitMQ, Session

_DEAD_LETTER_RETRY = timedelta(seconds=5)
_TRUST = (
    "add trust_hex_message_ids=true to the broker URL (trust_hex_message_ids=True to the "
    "RabbitMQ transport)"
)

# The basic properties that are AMQP short strings, as aio-pika names them (and the AMQP name
# a reason gives). Any of them may hold bytes that are not UTF-8 (see ._frames).
_TEXT_PROPERTIES = (
    ("message_id", "message id (AMQP message_id property)"),
    ("correlation_id", "correlation id (AMQP correlation_id property)"),
    ("content_type", "AMQP content_type property"),
    ("content_encoding", "AMQP content_encoding property"),
    ("type", "AMQP type property"),
    ("app_id", "AMQP app_id property"),
    ("user_id", "AMQP user_id property"),
    ("reply_to", "AMQP reply_to property"),
    ("cluster_id", "AMQP cluster_id property"),
)
_COPIED_PROPERTIES = (
    "content_type",
    "content_encoding",
    "correlation_id",
    "message_id",
    "type",
    "app_id",
)
RAW_PROPERTY_HEADER = "x-oncely-raw-"
"""A dead-letter copy carries a property that is not UTF-8 as this header plus the property's
name, holding its exact bytes (AMQP cannot send it as a property through the client)."""
NO_MESSAGE_ID_HEADER = "x-oncely-no-message-id"
"""On a dead-letter copy of a message that had no ``message_id``, or one the client library
made up (see :func:`client_made_id`): the copy's id was assigned by the client library
(aiormq sets one on every publish), not by the producer."""
MADE_UP_NOTE = "the original had no message_id; this one is made up"
"""The value of :data:`NO_MESSAGE_ID_HEADER`."""
_CLIENT_MADE_ID = re.compile(r"[0-9a-f]{12}4[0-9a-f]{3}[89ab][0-9a-f]{15}\Z")
RAW_HEADERS_HEADER = "x-oncely-raw-headers"
"""A dead-letter copy carries headers whose names are not UTF-8 here: a list of
``[name bytes, value]`` pairs."""


def client_made_id(message_id: str) -> bool:
    """Whether ``message_id`` has the shape aiormq (under aio-pika and FastStream) gives every
    message published without one, ``uuid4().hex``: 32 lowercase hex digits with the version
    nibble 4 and the variant nibble 8, 9, a or b. No producer's id then: a retried publish
    carries a new one."""
    return len(message_id) == 32 and _CLIENT_MADE_ID.match(message_id) is not None


def made_up_reason(message_id: str, trust: str) -> str:
    """Why ``message_id`` (see :func:`client_made_id`) is no key, and the fixes; ``trust``
    says how to declare that the producers mint such ids themselves."""
    return (
        f"the message id {message_id!r} has the shape aio-pika's client gives a message "
        "published without one (uuid4().hex): it is not a producer's id, so a retry would "
        "look new (R2, R4). Publish with a message id of your own (oncely's producer, or "
        f"message_id=new_message_id()), or {trust} if your producers mint this shape themselves"
    )


def producer_id(
    message_id: str | None, *, trust_hex: bool, trust: str
) -> tuple[str | None, str | None]:
    """The producer's id of a message whose ``message_id`` property is ``message_id``, and
    why that id is not one: ``(None, reason)`` for an id the client library made up (see
    :func:`client_made_id`) unless ``trust_hex`` (``trust`` says how to set it, for the
    reason). The reason goes to :attr:`Envelope.message_id_refusal`: a key source that reads
    another field (a header, the body) may still find a key."""
    if message_id and not trust_hex and client_made_id(message_id):
        return None, made_up_reason(message_id, trust)
    return message_id or None, None


def dead_letter_headers(
    message: AbstractIncomingMessage, why: DeadLetter, *, producers_id: bool
) -> dict[str, Any]:
    """The headers of the dead-letter copy of ``message``: its own as the client can send
    them again (see :func:`_sendable_headers`), :data:`NO_MESSAGE_ID_HEADER` unless the id it
    carries is the producer's (``producers_id``), and the reason's ``x-oncely-*`` headers."""
    headers = _sendable_headers(message.headers or {})
    if message.message_id is None or not producers_id:
        # The client library gives every message it publishes an id; say this copy's was
        # not the producer's, so nobody replaying the dead letters takes it for one.
        headers[NO_MESSAGE_ID_HEADER] = MADE_UP_NOTE
    headers.update(why.headers())
    return headers


def _header_value(value: object) -> object:
    """A header value as text, or as it came for one that has no single spelling as text (a
    table, an array, a float, a flag): a key source refuses it as what it is."""
    if isinstance(value, str):
        return value
    if isinstance(value, bytes | bytearray):
        return wire_text(value)  # lossless: bytes that are not UTF-8 are kept (and refused)
    if isinstance(value, bool | float):
        return value  # no one spelling of it is a key (1.0 and 1, True and "True")
    if isinstance(value, int | Decimal):
        return str(value)
    if isinstance(value, datetime):
        return value.isoformat()
    return value


def _identity(message: AbstractIncomingMessage) -> bytes:
    """What tells the copies of one message apart from other messages, for counting the
    deliveries a queue does not count: its id and a hash of its body."""
    digest = hashlib.sha256(message.body)
    digest.update(b"\0" + (message.message_id or "").encode("utf-8", "surrogatepass"))
    return digest.digest()


def _delivery_count(headers: Mapping[str, object], redelivered: bool) -> int | None:
    earlier = headers.get(DELIVERY_COUNT_HEADER)
    if isinstance(earlier, int) and not isinstance(earlier, bool) and earlier >= 0:
        return earlier + 1
    return None if redelivered else 1


class RabbitMQDelivery:
    """One message delivered on one channel, unacknowledged until it is settled."""

    __slots__ = (
        "_envelope",
        "_fields",
        "_identity",
        "_made_up",
        "_message",
        "_refusal",
        "_session",
        "_transport",
    )

    def __init__(
        self, message: AbstractIncomingMessage, session: Session, transport: RabbitMQ
    ) -> None:
        self._message = message
        self._session = session
        self._transport = transport
        raw = message.headers or {}
        headers = {
            name: _header_value(value)
            for name, value in raw.items()
            if name != DELIVERY_COUNT_HEADER
        }
        count = _delivery_count(raw, bool(message.redelivered))
        self._identity: bytes | None = None
        if count is None:  # redelivered, and the queue does not count (a classic queue)
            self._identity = _identity(message)
            count = transport._count_redelivery(self._identity)
        self._fields: dict[str, object] = {
            "delivery_tag": message.delivery_tag,
            "redelivered": bool(message.redelivered),
            DELIVERY_COUNT_HEADER: raw.get(DELIVERY_COUNT_HEADER),
            "queue": transport.queue,
        }
        self._refusal = not_utf8(
            (what, getattr(message, name, None)) for name, what in _TEXT_PROPERTIES
        )
        transport_fields = dict(self._fields)
        transport_fields["content_type"] = message.content_type
        transport_fields["content_encoding"] = message.content_encoding
        message_id = message.message_id or None
        made_up = None
        if self._refusal is None:
            # aiormq's id for a message published without one: no key of the producer's, but
            # a key source that reads another field (a header, the body) may still find one.
            message_id, made_up = producer_id(
                message_id, trust_hex=transport.trust_hex_message_ids, trust=_TRUST
            )
        self._made_up = made_up is not None
        self._envelope = Envelope(
            body=message.body,
            message_id=message_id,
            headers=headers,
            correlation_id=message.correlation_id or None,
            delivery_count=count,
            transport=transport_fields,
            message_id_refusal=made_up,
        )

    @property
    def envelope(self) -> Envelope:
        return self._envelope

    @property
    def delivery_count(self) -> int | None:
        return self._envelope.delivery_count

    @property
    def refusal(self) -> str | None:
        return self._refusal

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
        if self._identity is not None:
            self._transport._forget_redeliveries(self._identity)

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
        deleted), the original is given back after a pause and :class:`BrokerError` raised;
        a copy not confirmed within ``confirm_timeout`` gives it back the same way and raises
        :class:`BrokerUnavailable`."""
        self._live("dead-letter")
        message = self._message
        headers = dead_letter_headers(message, why, producers_id=not self._made_up)
        text = {
            name: _sendable_property(name, getattr(message, name), headers)
            for name in _COPIED_PROPERTIES
        }
        copy = self._copy(headers, text)
        topology = self._transport.topology
        over = header_frame(copy) - await frame_max(self._session.channel)
        if over > 0:
            # RabbitMQ closes the connection on a header frame over frame_max (every delivery
            # on it given back, this one to fail again at once): the reason is cut to fit.
            try:
                headers[REASON_HEADER] = cut_reason(headers[REASON_HEADER], over)
            except BrokerError:
                self._transport._hold(self, _DEAD_LETTER_RETRY.total_seconds())
                raise
            copy = self._copy(headers, text)
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
            # Unconfirmed in time (a blocked connection, a queue without a leader), the
            # channel may well stay open: RabbitMQ would never redeliver the original, which
            # would hold a prefetch slot for good. Give it back (a closed channel has already).
            self._transport._hold(self, _DEAD_LETTER_RETRY.total_seconds())
            raise_translated(exc, f"publish to the dead-letter exchange {topology.dead_letter!r}")
        await self.ack()

    def _copy(self, headers: dict[str, Any], text: dict[str, str | None]) -> WholeHeaderNames:
        message = self._message
        return WholeHeaderNames(
            message.body,
            headers=headers,
            delivery_mode=DeliveryMode.PERSISTENT,
            timestamp=message.timestamp,
            **text,  # type: ignore[arg-type]
        )

    async def extend(self) -> None:
        """Nothing to do: RabbitMQ does not redeliver a message its live consumer holds."""


def _sendable_property(name: str, value: str | None, headers: dict[str, Any]) -> str | None:
    """A short-string property for the copy; one that is not UTF-8 moves to a header with its
    exact bytes (``x-oncely-raw-<name>``), as the client can only send UTF-8."""
    if value is None or not escaped(value):
        return value
    headers[RAW_PROPERTY_HEADER + name] = bytearray(_bytes_of(value))
    return None


def _sendable_headers(headers: Mapping[str, Any]) -> dict[str, Any]:
    """The original's headers as the client can send them again, every byte kept: text
    values that are not UTF-8 go as byte arrays, and a header whose name is not UTF-8 goes
    into ``x-oncely-raw-headers`` as a ``[name bytes, value]`` pair."""
    sendable: dict[str, Any] = {}
    raw_names: list[Any] = []
    for name, value in headers.items():
        if name == DELIVERY_COUNT_HEADER:
            continue
        if escaped(name):
            raw_names.append([bytearray(_bytes_of(name)), _sendable_value(value)])
        else:
            sendable[name] = _sendable_value(value)
    if raw_names:
        sendable[RAW_HEADERS_HEADER] = raw_names
    return sendable


def _sendable_value(value: Any) -> Any:
    if isinstance(value, str):
        return bytearray(_bytes_of(value)) if escaped(value) else value
    if isinstance(value, bytes):
        return bytearray(value)
    if isinstance(value, dict):
        return _sendable_headers(value)
    if isinstance(value, list):
        return [_sendable_value(item) for item in value]
    return value


def _bytes_of(text: str) -> bytes:
    try:
        return raw_bytes(text)
    except UnicodeEncodeError:  # a lone surrogate no byte decodes to
        return text.encode("utf-8", "backslashreplace")
