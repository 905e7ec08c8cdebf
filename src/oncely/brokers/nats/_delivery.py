"""One JetStream delivery: a message held unacknowledged by the durable pull consumer, settled
with a request the server answers."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from datetime import timedelta
from typing import TYPE_CHECKING

import nats.errors
from nats.aio.msg import Msg

from oncely.brokers._common import not_utf8
from oncely.brokers._shape import DeadLetter
from oncely.brokers.nats._settings import (
    CONTENT_TYPE_HEADER,
    CORRELATION_HEADER,
    LOGGER,
    MSG_ID_HEADER,
    ONCELY_ID_HEADER,
)
from oncely.errors import BrokerError
from oncely.keys import Envelope

if TYPE_CHECKING:
    from oncely.brokers.nats._transport import JetStream


class JetStreamDelivery:
    """One JetStream message held unacknowledged by the durable pull consumer."""

    __slots__ = (
        "_count",
        "_envelope",
        "_identity",
        "_msg",
        "_refusal",
        "_settled",
        "_transport",
    )

    def __init__(self, transport: JetStream, msg: Msg) -> None:
        self._transport = transport
        self._msg = msg
        self._settled = False
        meta = msg.metadata
        self._count = meta.num_delivered
        self._identity = (meta.stream, meta.sequence.stream)
        self._envelope, self._refusal = read_message(msg)

    @property
    def envelope(self) -> Envelope:
        return self._envelope

    @property
    def delivery_count(self) -> int | None:
        return self._count

    @property
    def refusal(self) -> str | None:
        return self._refusal

    @property
    def identity(self) -> tuple[str, int]:
        """The stream and the message's sequence in it: the same on each delivery."""
        return self._identity

    def describe(self) -> Mapping[str, object]:
        return self._envelope.transport

    async def ack(self) -> None:
        await self._settle(b"+ACK", "ack")

    async def retry(self, delay: timedelta) -> None:
        limit = self._transport.max_deliver
        if limit > 0 and self._count >= limit:
            # JetStream would not deliver it again and would leave it unacknowledged for good.
            LOGGER.warning(
                "oncely broker=nats a message on its last delivery (%s, the consumer's "
                "max_deliver) is dead-lettered instead of given back",
                self._count,
            )
            await self.dead_letter(
                DeadLetter(
                    outcome="rejected",
                    reason=(
                        f"delivered {self._count} times, the JetStream consumer's max_deliver: "
                        "the broker would not deliver it again (raise max_deliver above "
                        "ConsumerSettings.max_deliveries)"
                    ),
                    consumer=self._transport.inbox_consumer,
                    deliveries=self._count,
                )
            )
            return
        nanos = int(delay.total_seconds() * 1_000_000_000)
        payload = b"-NAK" if nanos <= 0 else b"-NAK " + json.dumps({"delay": nanos}).encode()
        await self._settle(payload, "retry")

    @property
    def _last(self) -> bool:
        """Whether JetStream will not deliver the message again (its ``max_deliver``)."""
        limit = self._transport.max_deliver
        return limit > 0 and self._count >= limit

    async def dead_letter(self, why: DeadLetter) -> None:
        """Write the copy, then ``+TERM`` the message. On its last delivery a copy that
        could not be written is tried again in the background, the message kept meanwhile
        (``+WPI``): given back, JetStream would never deliver it again."""
        try:
            await self._transport._publish_dead_letter(self._msg, why)
        except BrokerError as exc:
            if not self._last:
                raise  # JetStream delivers it again after ack_wait
            self._transport._keep(self._dead_letter_until_written(why))
            raise BrokerError(
                f"{exc}; the message is on its last delivery (max_deliver): it is kept and its "
                "dead-letter copy tried again until written"
            ) from None
        await self._settle(b"+TERM", "dead-letter")

    async def _dead_letter_until_written(self, why: DeadLetter) -> None:
        every = self._transport.ack_wait.total_seconds() / 3
        tries, written = 1, False
        try:
            while True:
                await asyncio.sleep(every)
                tries += 1
                try:
                    await self._transport._reply(self._msg, b"+WPI", "extend")
                    if not written:  # a copy written once is not written again
                        await self._transport._publish_dead_letter(self._msg, why)
                        written = True
                    await self._settle(b"+TERM", "dead-letter")
                except BrokerError as exc:
                    LOGGER.warning(
                        "oncely broker=nats a message on its last delivery is still not "
                        "dead-lettered (try %d: %s)%s",
                        tries,
                        exc,
                        _fields(self.describe()),
                    )
                    continue
                LOGGER.warning(
                    "oncely broker=nats a message on its last delivery was dead-lettered at "
                    "try %d%s",
                    tries,
                    _fields(self.describe()),
                )
                return
        except asyncio.CancelledError:
            LOGGER.error(
                "oncely broker=nats the transport closed before a message on its last "
                "delivery was dead-lettered: JetStream will not deliver it again (it stays "
                "in the stream)%s",
                _fields(self.describe()),
            )
            raise

    async def extend(self) -> None:
        if not self._settled:
            await self._transport._reply(self._msg, b"+WPI", "extend")

    async def _settle(self, payload: bytes, what: str) -> None:
        if self._settled:
            raise BrokerError(f"this delivery was already settled; cannot {what} it")
        await self._transport._reply(self._msg, payload, what)
        self._settled = True


def _fields(fields: Mapping[str, object]) -> str:
    return "".join(f" {name}={value}" for name, value in fields.items())


def read_message(msg: Msg) -> tuple[Envelope, str | None]:
    """The envelope of a JetStream message, and why it cannot be read (``None`` when it
    can): the producer's id is ``Oncely-Message-Id`` (oncely's producer) or ``Nats-Msg-Id``;
    the delivery count is JetStream's ``num_delivered``. A message that did not come through
    a JetStream consumer (no metadata) has no delivery count."""
    headers = {str(k): str(v) for k, v in (msg.headers or {}).items()}
    # oncely's producer sends the id on its own (and Nats-Msg-Id with a body hash); any
    # other producer's id is its Nats-Msg-Id.
    id_header = ONCELY_ID_HEADER if ONCELY_ID_HEADER in headers else MSG_ID_HEADER
    message_id = headers.get(id_header) or None
    refusal = not_utf8(
        (
            (f"message id (header {id_header})", message_id),
            (f"correlation id (header {CORRELATION_HEADER})", headers.get(CORRELATION_HEADER)),
        )
    )
    transport: dict[str, object] = {
        "subject": msg.subject,
        "content_type": headers.get(CONTENT_TYPE_HEADER),
    }
    count: int | None = None
    if msg.reply:
        try:
            meta = msg.metadata
        except nats.errors.NotJSMessageError:
            meta = None
        if meta is not None:
            count = meta.num_delivered
            transport.update(
                stream=meta.stream,
                stream_seq=meta.sequence.stream,
                consumer_seq=meta.sequence.consumer,
                redelivered=meta.num_delivered > 1,
            )
    envelope = Envelope(
        body=msg.data,
        message_id=message_id,
        headers=headers,
        correlation_id=headers.get(CORRELATION_HEADER) or None,
        delivery_count=count,
        transport=transport,
    )
    return envelope, refusal
