"""FastStream's Redis messages as oncely reads and settles them: stream subscribers of a
consumer group only (pub/sub and lists cannot deliver a message again), the stream entry
the source of truth, settled as :mod:`oncely.brokers.redis_streams` settles its own: a
retry is a copy of the entry at the stream's tail, and a dead letter a copy in
``<stream>.dead``, each written together with the original's ``XACK`` in one script."""

from __future__ import annotations

import asyncio
import logging
from datetime import timedelta
from typing import Any

from faststream.message import AckStatus
from faststream.redis.parser.binary import BinaryMessageFormatV1

from oncely.brokers._common import not_utf8
from oncely.brokers._shape import DeadLetter
from oncely.brokers.redis_streams._layout import EntryLayout, as_text
from oncely.brokers.redis_streams._scripts import DEAD_LETTER, SET_IDLE
from oncely.integrations.faststream._adapter import DEAD_LETTER_SUFFIX, Delivery, Settling
from oncely.keys import Envelope

__all__ = ["ADAPTER", "DELIVERIES_FIELD", "ID_HEADER", "RedisAdapter"]

ID_HEADER = "message_id"
"""The header of FastStream's Redis message format that holds the producer's id
(``broker.publish(..., headers={"message_id": ...})``)."""
DELIVERIES_FIELD = "x-oncely-delivered"
"""On a copy written back to the stream (a field of the entry, beside FastStream's
``__data__``): how many times the message was delivered before, a delivery given back unrun
not counted."""
_DATA = b"__data__"
_DELIVERIES = DELIVERIES_FIELD.encode()
_WHY = frozenset(
    name.encode() for name in DeadLetter(outcome="", reason="", consumer="", deliveries=0).headers()
)
_PLAIN_LAYOUT = EntryLayout("body", "message_id")
LOGGER = logging.getLogger("oncely.faststream")


class RedisAdapter:
    """FastStream's RedisBroker with stream subscribers of a consumer group (see
    :mod:`oncely.integrations.faststream`)."""

    broker_name = "Redis"

    def __init__(self) -> None:
        self._scripts: dict[int, Any] = {}
        self._set_idle: dict[int, Any] = {}

    def source_of(self, subscriber: Any) -> str | None:
        for attribute in ("stream_sub", "list_sub", "channel"):
            name = getattr(getattr(subscriber, attribute, None), "name", None)
            if isinstance(name, str) and name:
                return name
        return None

    def unprotectable(self, subscriber: Any) -> str | None:
        stream = getattr(subscriber, "stream_sub", None)
        if stream is None:
            if getattr(subscriber, "list_sub", None) is not None:
                return (
                    "a list subscriber pops each message off the list before its handler "
                    "runs, so a crash loses it and a failure cannot be given back; use a "
                    "stream with a consumer group (StreamSub(..., group=..., consumer=...))"
                )
            return (
                "Redis pub/sub never delivers a message again (not after a failure, not after "
                "a crash); use a stream with a consumer group (StreamSub(..., group=..., "
                "consumer=...))"
            )
        if not stream.group:
            return (
                "a stream read without a consumer group (XREAD) keeps no pending entries, so "
                "nothing is delivered again; give StreamSub a group= and a consumer="
            )
        if stream.no_ack:
            return "it reads with NOACK, so a failed or crashed delivery is never pending"
        if stream.batch:
            return "it takes entries in batches; claim them with a subscriber of one at a time"
        return None

    def is_delivery(self, raw: object) -> bool:
        return isinstance(raw, dict) and raw.get("type") == "stream"

    async def read(self, message: Any, *, trust_hex: bool) -> Delivery:
        raw: dict[str, Any] = message.raw_message
        fields: dict[bytes, bytes] = raw["data"]
        entry_ids: list[bytes] = raw.get("message_ids") or []
        headers_in: dict[str, Any] = dict(message.headers or {})
        earlier = _whole(fields.get(_DELIVERIES)) or _whole(headers_in.pop(DELIVERIES_FIELD, None))
        times = await _times_delivered(message, raw, entry_ids)
        count = None if times is None and earlier is None else (earlier or 0) + (times or 1)
        transport: dict[str, object] = {
            "stream": raw.get("channel"),
            "entry_id": as_text(entry_ids[0]) if entry_ids else None,
            "delivery_count": count,
            "redelivered": (count or 1) > 1,
        }
        if _DATA not in fields and _PLAIN_LAYOUT.body in fields:
            # An entry in oncely's own layout (RedisStreamsProducer): its fields hold the id.
            plain = [(k, v) for k, v in fields.items() if k != _DELIVERIES]
            envelope, refusal = _PLAIN_LAYOUT.envelope(plain, count or 1, transport)
            return Delivery(envelope, refusal)
        headers = {str(k): str(v) for k, v in headers_in.items()}
        message_id = headers.get(ID_HEADER) or None
        correlation_id = headers.get("correlation_id") or None
        transport["content_type"] = headers.get("content-type")
        envelope = Envelope(
            body=message.body,
            message_id=message_id,
            headers=headers,
            correlation_id=correlation_id,
            delivery_count=count,
            transport=transport,
        )
        refusal = not_utf8(
            (
                (f"message id (header {ID_HEADER!r})", message_id),
                ("correlation id (header 'correlation_id')", correlation_id),
            )
        )
        return Delivery(envelope, refusal)

    def delivery_limit(self, subscriber: Any) -> int | None:
        return None

    def counted_give_back(self, held: Settling) -> None:
        """None: a give-back is a copy of the entry carrying the deliveries before it."""
        return None

    def extend_every(self, held: Settling) -> timedelta | None:
        """A third of the shortest ``min_idle_time`` of the broker's subscribers that take
        over this stream's pending entries for this group (none: nobody takes them over)."""
        raw = held.message.raw_message
        if not raw.get("message_ids"):
            return None
        mine = held.subscriber.stream_sub
        idle = [
            stream.min_idle_time
            for each in getattr(held.broker, "subscribers", ())
            if (stream := getattr(each, "stream_sub", None)) is not None
            and stream.name == mine.name
            and stream.group == mine.group
            and stream.min_idle_time
        ]
        return timedelta(milliseconds=min(idle)) / 3 if idle else None

    async def extend(self, held: Settling) -> None:
        """Reset the entry's idle time while this consumer still owns it (``XCLAIM ... IDLE 0
        JUSTID``, which leaves the delivery count alone)."""
        raw = held.message.raw_message
        client = held.message.consumer
        script = self._set_idle.get(id(client))
        if script is None:
            script = self._set_idle[id(client)] = client.register_script(SET_IDLE)
        stream = held.subscriber.stream_sub
        args = [stream.group, stream.consumer, raw["message_ids"][0], 0]
        await script(keys=[raw["channel"]], args=args, client=client)

    async def give_back(self, held: Settling, delay: timedelta) -> None:
        # Redis has no negative acknowledgement: a copy goes to the stream's tail after the
        # delay, with the original's XACK, and the entry stays pending meanwhile. The copy
        # carries the deliveries before this one, which ran nothing: read then from Redis
        # (XPENDING), takeovers of the entry included. A takeover is a worker that died
        # holding it, most often mid-run; the count the entry was written with would lose
        # it, and a message that kills its worker on every run would run for ever.
        held.later(self._copy_later(held, delay, None))

    async def retry(self, held: Settling, delay: timedelta, count: int) -> None:
        held.later(self._copy_later(held, delay, count))

    async def _copy_later(self, held: Settling, delay: timedelta, count: int | None) -> None:
        """After ``delay``, the entry's copy at the stream's tail carrying ``count`` (``None``:
        a give-back, its deliveries before this one), and the original's ``XACK``."""
        await asyncio.sleep(delay.total_seconds())
        try:
            if count is None:
                count = await _delivered_before(held)
            fields = await _fields(held, {DELIVERIES_FIELD: str(count)})
            await self._write(held, held.source, fields)
        except Exception as exc:  # the entry stays pending; a takeover subscriber claims it
            LOGGER.error(
                "oncely faststream source=%s could not give an entry back (%s: %s); it stays "
                "pending for a min_idle_time subscriber of the group to claim",
                held.source,
                type(exc).__name__,
                exc,
            )

    async def dead_letter(self, held: Settling, why: DeadLetter) -> None:
        fields = await _fields(held, why.headers())
        for i, (name, data) in enumerate(fields):
            if name == _DATA and isinstance(data, bytes):
                # The reason also goes into the headers of FastStream's message format, where
                # a FastStream subscriber of the dead-letter stream reads them (headers).
                fields[i] = (name, await _with_headers(held, data, why.headers()))
        await self._write(held, held.source + DEAD_LETTER_SUFFIX, fields)

    async def _write(self, held: Settling, target: str, fields: _Fields) -> None:
        """Add ``fields`` to the stream ``target`` and acknowledge the original entry, in one
        script, while this subscriber's consumer still owns it; in FastStream's
        ``TestRedisBroker``, publish them to ``target`` through the broker instead."""
        raw = held.message.raw_message
        entry_ids: list[bytes] = raw.get("message_ids") or []
        if not entry_ids:  # TestRedisBroker: no Redis, no entry
            headers = dict(held.message.headers or {})
            headers.pop(DELIVERIES_FIELD, None)
            headers.update({k.decode(): as_text(v) if isinstance(v, bytes) else v
                            for k, v in fields if k != _DATA})  # fmt: skip
            correlation_id = headers.pop("correlation_id", None)
            await held.broker.publish(
                held.message.body, stream=target, headers=headers, correlation_id=correlation_id
            )
            return
        client = held.message.consumer
        script = self._scripts.get(id(client))
        if script is None:
            script = self._scripts[id(client)] = client.register_script(DEAD_LETTER)
        stream = held.subscriber.stream_sub
        args: list[bytes | str] = [stream.group, stream.consumer, entry_ids[0]]
        for name, value in fields:
            args += [name, value]
        if await script(keys=[raw["channel"], target], args=args, client=client) is None:
            LOGGER.info(
                "oncely faststream source=%s entry %s is no longer held by consumer %r (taken "
                "over or settled); left to its owner",
                held.source,
                as_text(entry_ids[0]),
                stream.consumer,
            )

    async def dead_letter_unread(
        self, raw: Any, subscriber: Any, broker: Any, why: DeadLetter
    ) -> bool:
        return False  # FastStream's parser of this broker reads every message its client gives

    def settled(self, held: Settling) -> None:
        if held.message.committed is None:
            held.message.committed = AckStatus.ACKED  # FastStream's ack then does nothing

    def stamp(self, cmd: Any, message_id: str) -> None:
        headers = getattr(cmd, "headers", None)
        if isinstance(headers, dict) and not headers.get(ID_HEADER):
            headers[ID_HEADER] = message_id


ADAPTER = RedisAdapter


_Fields = list[tuple[bytes, bytes | str]]

_ENTRY = "return redis.call('XRANGE', KEYS[1], ARGV[1], ARGV[1])"
"""The fields of one entry as Redis keeps them (a list: a name may repeat)."""


async def _fields(held: Settling, extra: dict[str, str]) -> _Fields:
    """The original entry's fields (FastStream's ``__data__`` and any other), every one in
    order, without an earlier copy's oncely fields, plus ``extra``. Read from Redis by the
    entry's id: FastStream's reading is a dict, which keeps one of the fields an entry
    repeats (``XADD s * a 1 a 2``); that reading only without an entry (TestRedisBroker)
    or once the entry is gone."""
    raw = held.message.raw_message
    entry_ids: list[bytes] = raw.get("message_ids") or []
    pairs: list[tuple[bytes, bytes]] = list(raw["data"].items())
    if entry_ids:
        found = await held.message.consumer.eval(_ENTRY, 1, raw["channel"], entry_ids[0])
        if found and found[0][1]:
            flat = found[0][1]
            pairs = list(zip(flat[::2], flat[1::2], strict=True))
    fields: _Fields = [(n, v) for n, v in pairs if n != _DELIVERIES and n not in _WHY]
    fields += [(name.encode(), value) for name, value in extra.items()]
    return fields


async def _delivered_before(held: Settling) -> int:
    """How many times the message was delivered before the delivery ``held``: the count an
    earlier copy carried, plus what Redis counts of this entry now (``XPENDING``: its
    takeovers), less this delivery."""
    message = held.message
    raw: dict[str, Any] = message.raw_message
    earlier = _whole(raw["data"].get(_DELIVERIES)) or _whole(
        (message.headers or {}).get(DELIVERIES_FIELD)
    )
    times = await _times_delivered(message, raw, raw.get("message_ids") or [])
    return (earlier or 0) + (times or 1) - 1


async def _times_delivered(message: Any, raw: dict[str, Any], entry_ids: list[bytes]) -> int | None:
    """Redis's own count of deliveries of the entry (``XPENDING``): 1 when read first, one
    more each time a consumer claimed it; ``None`` without an entry (TestRedisBroker)."""
    counts = raw.get("delivery_counts")  # XREADGROUP CLAIM (Redis 8.4) says it already
    if counts:
        return int(counts[0]) + 1
    if not entry_ids or getattr(message, "group", None) is None:
        return None
    pending = await message.consumer.xpending_range(
        name=raw["channel"],
        groupname=message.group,
        min=entry_ids[0],
        max=entry_ids[0],
        count=1,
    )
    return int(pending[0]["times_delivered"]) if pending else 1


async def _with_headers(held: Settling, data: bytes, extra: dict[str, str]) -> bytes:
    """FastStream's encoded message ``data`` with ``extra`` added to its headers, in the
    subscriber's message format; the body's bytes are kept as they are."""
    config = getattr(held.subscriber, "config", None)
    message_format: Any = getattr(config, "message_format", None) or BinaryMessageFormatV1
    body, headers = message_format.parse(data)
    headers = {**headers, **extra}
    encoded: bytes = await message_format.encode(
        message=body,
        reply_to=headers.pop("reply_to", None),
        headers=headers,
        correlation_id=str(headers.get("correlation_id", "")),
    )
    return encoded


def _whole(value: object) -> int | None:
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    if isinstance(value, str) and value.isdigit():
        return int(value)
    return None
