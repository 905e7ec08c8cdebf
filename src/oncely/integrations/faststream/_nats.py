"""FastStream's NATS messages as oncely reads and settles them: JetStream subscribers only
(core NATS never redelivers), the raw nats-py message the source of truth, settled the way
:mod:`oncely.brokers.nats` settles its own."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import replace
from datetime import timedelta
from typing import Any

import nats.js.errors
from nats.aio.msg import Msg
from nats.js.client import JetStreamContext

from oncely.brokers._shape import DeadLetter
from oncely.brokers.nats._delivery import read_message
from oncely.brokers.nats._settings import (
    DEAD_LETTER_WINDOW,
    DEFAULT_TIMEOUT,
    MSG_ID_HEADER,
    ONCELY_ID_HEADER,
)
from oncely.brokers.nats._topology import ensure_stream
from oncely.brokers.nats._transport import publish_dead_letter, sendable_headers
from oncely.errors import ConfigurationError
from oncely.integrations.faststream._adapter import DEAD_LETTER_SUFFIX, Delivery, Settling

__all__ = ["ADAPTER", "FASTSTREAM_ID_HEADER", "NatsAdapter"]

_TEST_DELIVERIES = "x-oncely-delivered"
FASTSTREAM_ID_HEADER = "message_id"
"""The header FastStream's NATS parser reads a message id from (``headers={"message_id":
...}``); read after ``Oncely-Message-Id`` and ``Nats-Msg-Id``."""


class NatsAdapter:
    """FastStream's NatsBroker with JetStream subscribers (see
    :mod:`oncely.integrations.faststream`)."""

    broker_name = "NATS"

    def __init__(self) -> None:
        self._dead_streams: set[tuple[int, str]] = set()

    def source_of(self, subscriber: Any) -> str | None:
        address = getattr(subscriber, "subject", None)
        name = getattr(address, "broker_address", None)
        return name if isinstance(name, str) and name else None

    def unprotectable(self, subscriber: Any) -> str | None:
        kind = type(subscriber).__name__
        if "KeyValue" in kind or "ObjectStorage" in kind:
            return "it watches a key-value or object store, which holds no messages to claim"
        stream = getattr(subscriber, "stream", None)
        if stream is None:
            return (
                "it is a core NATS subscription, which never delivers a message again (not "
                "after a failure, not after a crash); subscribe through JetStream "
                "(stream=...) with a durable consumer"
            )
        if kind.startswith("Batch"):
            return "it takes messages in batches; claim them with a subscriber of one at a time"
        config = getattr(subscriber, "config", None)
        options = getattr(subscriber, "extra_options", None) or {}
        durable = (
            getattr(config, "durable_name", None)
            or options.get("durable")
            or getattr(subscriber, "queue", None)
        )
        if not durable:
            return (
                "its JetStream consumer is not durable: a new worker gets a new consumer, which "
                "reads the stream again from its start (or skips what the last one left "
                "unacknowledged); give it durable=... (a pull subscriber) or queue=... (push)"
            )
        return None

    def is_delivery(self, raw: object) -> bool:
        return isinstance(raw, Msg)

    async def read(self, message: Any, *, trust_hex: bool) -> Delivery:
        raw: Msg = message.raw_message
        envelope, refusal = read_message(raw)
        if envelope.message_id is None:
            given = envelope.headers.get(FASTSTREAM_ID_HEADER)
            if isinstance(given, str) and given:
                envelope = replace(envelope, message_id=given)
        if envelope.delivery_count is None:  # TestNatsBroker: the count a retry's copy says
            headers = dict(envelope.headers)
            earlier = str(headers.pop(_TEST_DELIVERIES, ""))
            count = int(earlier) + 1 if earlier.isdigit() else None
            envelope = replace(envelope, headers=headers, delivery_count=count)
        return Delivery(envelope, refusal)

    def delivery_limit(self, subscriber: Any) -> int | None:
        limit = getattr(getattr(subscriber, "config", None), "max_deliver", None)
        return limit if isinstance(limit, int) and limit > 0 else None

    def counted_give_back(self, held: Settling) -> tuple[str, int] | None:
        """The stream and the message's sequence in it: JetStream's ``num_delivered``
        counts a ``-NAK`` as a delivery (not FastStream's TestNatsBroker, which counts
        none)."""
        if not _from_jetstream(held.raw):
            return None
        meta = held.raw.metadata
        return (meta.stream, meta.sequence.stream)

    def extend_every(self, held: Settling) -> timedelta | None:
        if not _from_jetstream(held.raw):
            return None
        wait = getattr(getattr(held.subscriber, "config", None), "ack_wait", None)
        seconds = wait if isinstance(wait, int | float) and wait > 0 else 30.0  # server default
        return timedelta(seconds=seconds) / 3

    async def extend(self, held: Settling) -> None:
        await held.raw.in_progress()  # +WPI: JetStream's ack wait starts again

    async def give_back(self, held: Settling, delay: timedelta) -> None:
        if not _from_jetstream(held.raw):
            await _send_again(held, delay, None)
            return
        await held.raw.nak(delay=max(delay.total_seconds(), 0.0) or None)

    async def retry(self, held: Settling, delay: timedelta, count: int) -> None:
        if not _from_jetstream(held.raw):
            await _send_again(held, delay, count)
            return
        await held.raw.nak(delay=max(delay.total_seconds(), 0.0) or None)  # JetStream counts

    async def dead_letter(self, held: Settling, why: DeadLetter) -> None:
        raw: Msg = held.raw
        subject = raw.subject + DEAD_LETTER_SUFFIX
        if not _from_jetstream(raw):  # FastStream's TestNatsBroker: its subscriber gets it
            headers = sendable_headers({str(k): str(v) for k, v in (raw.headers or {}).items()})
            headers.pop(_TEST_DELIVERIES, None)
            headers.update(why.headers())
            await held.broker.publish(raw.data, subject, headers=headers)
            return
        js: JetStreamContext = held.subscriber.jetstream
        await self._declare(js, subject, held.subscriber)
        await publish_dead_letter(js, subject, raw, why, DEFAULT_TIMEOUT.total_seconds())
        await raw.term()

    async def _declare(self, js: JetStreamContext, subject: str, subscriber: Any) -> None:
        """The stream that keeps ``subject``'s dead letters: created (with the server's
        smallest duplicate window, so it keeps every copy) unless one captures it; refused
        when it is the subscriber's own stream, which would deliver the copies again."""
        marker = (id(js), subject)
        if marker in self._dead_streams:
            return
        own = getattr(getattr(subscriber, "stream", None), "name", None)
        captor: str | None = None
        with contextlib.suppress(nats.js.errors.NotFoundError):
            captor = await js.find_stream_name_by_subject(subject)
        if captor is not None and captor == own:
            raise ConfigurationError(
                f"the stream {own!r} captures the dead-letter subject {subject!r}, so "
                "dead-lettered copies would be delivered again: narrow the stream's subjects"
            )
        if captor is None:
            await ensure_stream(js, subject, None, DEAD_LETTER_WINDOW)
        self._dead_streams.add(marker)

    async def dead_letter_unread(
        self, raw: Any, subscriber: Any, broker: Any, why: DeadLetter
    ) -> bool:
        return False  # FastStream's parser of this broker reads every message its client gives

    def settled(self, held: Settling) -> None:
        held.raw._ackd = True  # FastStream's NatsMessage.ack() then does nothing

    def stamp(self, cmd: Any, message_id: str) -> None:
        headers = getattr(cmd, "headers", None)
        if isinstance(headers, dict) and not (
            headers.get(MSG_ID_HEADER) or headers.get(ONCELY_ID_HEADER)
        ):
            headers[MSG_ID_HEADER] = message_id


ADAPTER = NatsAdapter


async def _send_again(held: Settling, delay: timedelta, count: int | None) -> None:
    """FastStream's ``TestNatsBroker`` has nothing to give a message back to: after the delay
    it is published again (in the test, to the same subscriber), with its count."""
    await asyncio.sleep(delay.total_seconds())
    raw: Msg = held.raw
    headers = {str(k): str(v) for k, v in (raw.headers or {}).items()}
    if count is not None:
        headers[_TEST_DELIVERIES] = str(count)
    await held.broker.publish(raw.data, raw.subject, headers=headers)


def _from_jetstream(raw: Msg) -> bool:
    if not raw.reply or getattr(raw, "_client", None) is None:
        return False
    try:
        raw.metadata  # noqa: B018 - parsing it is the check
    except nats.errors.NotJSMessageError:
        return False
    return True
