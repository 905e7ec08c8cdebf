"""FastStream's Kafka (aiokafka) messages as oncely reads and settles them: the record's
headers the source of truth (never its partition and offset), the offset committed by
FastStream only once the record is done or a copy of it is confirmed by the broker."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
from dataclasses import replace
from datetime import timedelta
from typing import Any

from aiokafka import ConsumerRecord
from faststream.kafka.message import FakeConsumer
from faststream.kafka.schemas import Topic

from oncely.brokers._shape import DeadLetter
from oncely.brokers.kafka._records import MESSAGE_ID_HEADER, TOMBSTONE_REFUSAL, envelope_of
from oncely.cloudevents import event_key
from oncely.errors import OncelyError
from oncely.integrations.faststream._adapter import DEAD_LETTER_SUFFIX, Delivery, Settling
from oncely.wire import wire_text

_TOMBSTONE_REFUSAL = (
    "the record has no value: a tombstone (on a compacted topic, the deletion of its record "
    "key); a FastStream subscriber under oncely takes none, so it is dead-lettered for you to "
    "act on (its copy keeps the record key)"
)

__all__ = ["ADAPTER", "DELIVERIES_HEADER", "KafkaAdapter"]

DELIVERIES_HEADER = "x-oncely-delivered"
"""On a copy written back to the topic for a retry: how many times the message was delivered
before (Kafka counts no deliveries)."""
FASTSTREAM_ID_HEADER = "message_id"
RAW_HEADERS_HEADER = "x-oncely-raw-headers"
"""On a dead letter: the original's header lines that are not UTF-8, base64-encoded."""
_WHY = frozenset(DeadLetter(outcome="", reason="", consumer="", deliveries=0).headers())
_WHERE = ("x-oncely-topic", "x-oncely-partition", "x-oncely-offset")
LOGGER = logging.getLogger("oncely.faststream")


class KafkaAdapter:
    """FastStream's KafkaBroker (aiokafka) with a consumer group and manual commits (see
    :mod:`oncely.integrations.faststream`)."""

    broker_name = "Kafka"

    def __init__(self) -> None:
        self._topics: set[tuple[int, str]] = set()

    def source_of(self, subscriber: Any) -> str | None:
        topics = getattr(subscriber, "topics", None) or []
        if len(topics) == 1 and isinstance(getattr(topics[0], "name", None), str):
            name: str = topics[0].name
            return name
        return None

    def unprotectable(self, subscriber: Any) -> str | None:
        if type(subscriber).__name__.startswith("Batch"):
            return "it takes records in batches; claim them with a subscriber of one at a time"
        if not getattr(subscriber, "group_id", None):
            return (
                "it has no consumer group (group_id=), so no offset is ever committed and a "
                "new worker starts over or skips what the last one left unfinished"
            )
        return None

    def is_delivery(self, raw: object) -> bool:
        return isinstance(raw, ConsumerRecord)

    async def read(self, message: Any, *, trust_hex: bool) -> Delivery:
        record: Any = message.raw_message
        earlier = 0
        headers: list[tuple[str, bytes | None]] = []
        for name, value in record.headers or ():
            if name == DELIVERIES_HEADER:
                text = wire_text(value or b"")
                earlier = int(text) if text.isdigit() else 0
            else:
                headers.append((name, value))
        envelope, refusal = envelope_of(_Record(record, headers), "", earlier + 1)
        if refusal == TOMBSTONE_REFUSAL:  # its advice is the transport's option, not ours
            refusal = _TOMBSTONE_REFUSAL
        given: object = envelope.message_id
        if given is None:
            given = envelope.headers.get(FASTSTREAM_ID_HEADER)
            if isinstance(given, str) and given:
                envelope = replace(envelope, message_id=given)
            else:
                # CloudEvents' Kafka binding: the pair (ce_source, ce_id) is the key (R3).
                given = None
                with contextlib.suppress(OncelyError):
                    envelope = replace(envelope, message_id=event_key(envelope))
        if refusal is None and isinstance(given, str) and " " in given:
            # An event's id here is "<source> <id>", which a producer's id with a space
            # could equal: two messages would share one key.
            refusal = (
                f"the message id {given!r} has a space, so it could be the id this subscriber "
                "gives a CloudEvent without one ('<source> <id>'), and two messages would "
                "share one key; have the producer send ids without spaces (R2, R3)"
            )
        return Delivery(envelope, refusal)

    def delivery_limit(self, subscriber: Any) -> int | None:
        return None

    def counted_give_back(self, held: Settling) -> None:
        """None: Kafka counts no deliveries, and a give-back is a rewind to the record."""
        return None

    def extend_every(self, held: Settling) -> timedelta | None:
        return None  # aiokafka's heartbeats keep the partition while the member lives

    async def extend(self, held: Settling) -> None:
        return None

    async def give_back(self, held: Settling, delay: timedelta) -> None:
        # The partition waits out the delay, then the consumer is rewound to the record
        # (FastStream's nack: a seek, nothing committed past it), so it is read again in its
        # place: a copy meeting a running first one, a store that cannot answer, a dead
        # letter that could not be sent. Nothing is written meanwhile, order is kept.
        await asyncio.sleep(delay.total_seconds())
        if isinstance(held.message.consumer, FakeConsumer):
            # FastStream's TestKafkaBroker has no consumer to rewind: a copy is sent again.
            await _publish(held, held.raw.topic, {DELIVERIES_HEADER: str(_count(held.raw))})
            return
        await held.message.nack()

    async def retry(self, held: Settling, delay: timedelta, count: int) -> None:
        # Kafka counts no deliveries, and a rewound record could not say how often it failed
        # (nor could a restarted worker): after the delay a copy carrying its count goes to
        # the topic's tail, confirmed, and then FastStream commits past the original. Should
        # the copy fail, the consumer is rewound to the original instead.
        await asyncio.sleep(delay.total_seconds())
        try:
            await _publish(held, held.raw.topic, {DELIVERIES_HEADER: str(count)})
        except Exception:
            await held.message.nack()
            raise

    async def dead_letter(self, held: Settling, why: DeadLetter) -> None:
        record = held.raw
        target = record.topic + DEAD_LETTER_SUFFIX
        await self._declare(
            held.broker, target, fake=isinstance(held.message.consumer, FakeConsumer)
        )
        extra = why.headers()
        where = (record.topic, str(record.partition), str(record.offset))
        extra.update(zip(_WHERE, where, strict=True))
        await _publish(held, target, extra)

    async def _declare(self, broker: Any, topic: str, *, fake: bool) -> None:
        """Create the dead-letter topic unless it exists (FastStream's admin client; none in
        FastStream's ``TestKafkaBroker`` (``fake``), or with ``consumer_only``)."""
        marker = (id(broker), topic)
        if marker in self._topics or fake:
            return
        config = getattr(getattr(broker, "config", None), "broker_config", None)
        admin = getattr(config, "admin", None)
        if admin is not None and not getattr(config, "consumer_only", False):
            for result in await admin.create_topics([Topic(topic)]):
                if result.error and "exist" not in str(result.error).lower():
                    LOGGER.warning(
                        "oncely faststream could not create the dead-letter topic %s: %s",
                        topic,
                        result.error,
                    )
        self._topics.add(marker)

    async def dead_letter_unread(
        self, raw: Any, subscriber: Any, broker: Any, why: DeadLetter
    ) -> bool:
        """FastStream's Kafka parser decodes every header value as UTF-8 and fails on one that
        is not, or is null: such a record reaches no handler, and the next commit would pass
        it. It is copied to ``<topic>.dead``, its text headers as they are and the others,
        byte for byte, base64-encoded in ``x-oncely-raw-headers``; the reason names a null
        header (copied empty) and says whether the record is a tombstone (copied as one)."""
        if not isinstance(raw, ConsumerRecord):
            return False
        why = replace(why, reason=_unread_reason(raw, why.reason))
        target = raw.topic + DEAD_LETTER_SUFFIX
        await self._declare(broker, target, fake=False)
        headers: dict[str, str] = {}
        undecodable: list[bytes] = []
        for name, value in raw.headers or ():
            try:
                headers[name] = (value or b"").decode()
            except UnicodeDecodeError:
                undecodable.append(name.encode() + b": " + (value or b"") + b"\r\n")
        if undecodable:
            headers[RAW_HEADERS_HEADER] = base64.b64encode(b"".join(undecodable)).decode()
        headers.update(why.headers())
        where = (raw.topic, str(raw.partition), str(raw.offset))
        headers.update(zip(_WHERE, where, strict=True))
        await broker.publish(
            raw.value,  # a tombstone stays one (see _publish)
            target,
            key=raw.key,
            headers=headers,
            correlation_id=headers.get("correlation_id"),
        )
        return True

    def settled(self, held: Settling) -> None:
        return None  # FastStream commits past the record: it is done, or its copy is

    def stamp(self, cmd: Any, message_id: str) -> None:
        headers = getattr(cmd, "headers", None)
        if isinstance(headers, dict) and not (
            headers.get(MESSAGE_ID_HEADER) or headers.get(FASTSTREAM_ID_HEADER)
        ):
            headers[MESSAGE_ID_HEADER] = message_id


ADAPTER = KafkaAdapter


class _Record:
    """A record seen with other headers (the copy count taken out)."""

    def __init__(self, record: Any, headers: list[tuple[str, bytes | None]]) -> None:
        self._record = record
        self.headers = headers

    def __getattr__(self, name: str) -> Any:
        return getattr(self._record, name)


def _unread_reason(record: Any, reason: str) -> str:
    """``reason`` (FastStream's parser failed on ``record``) with what it failed on where the
    error does not say: a null header value, which it cannot decode (its copy then has an
    empty one); and that the record is a tombstone, where it is one."""
    nulls = [name for name, value in record.headers or () if value is None]
    if nulls:
        named = ", ".join(repr(name) for name in nulls)
        reason += (
            f" (the header {named} is null, which FastStream's parser cannot read; the copy "
            "has it empty)"
            if len(nulls) == 1
            else f" (the headers {named} are null, which FastStream's parser cannot read; the "
            "copy has them empty)"
        )
    if record.value is None:
        reason = f"{_TOMBSTONE_REFUSAL}; and {reason}"
    return reason


def _count(record: Any) -> int:
    for name, value in record.headers or ():
        if name == DELIVERIES_HEADER:
            text = wire_text(value or b"")
            return int(text) if text.isdigit() else 0
    return 0


async def _publish(held: Settling, topic: str, extra: dict[str, str]) -> None:
    """Publish a copy of the record (its value, key and headers, without an earlier copy's
    oncely headers) with ``extra`` to ``topic``, and wait for the broker's acknowledgement.
    The copy of a tombstone is a tombstone (a null value; FastStream writes one for a null
    body with a record key): an empty value is another record, which a consumer of the
    copies would take for a message. A tombstone without a record key, which the client
    cannot write, is copied with an empty value."""
    record = held.raw
    headers = {
        name: wire_text(value or b"")
        for name, value in record.headers or ()
        if name != DELIVERIES_HEADER and name not in _WHY and name not in _WHERE
    }
    headers.update(extra)
    await held.broker.publish(
        record.value,
        topic,
        key=record.key,
        headers=headers,
        correlation_id=headers.get("correlation_id"),
    )
