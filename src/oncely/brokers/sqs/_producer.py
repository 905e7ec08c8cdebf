"""The SQS producer: one ``SendMessage`` per publish, the message id in a message attribute."""

from __future__ import annotations

import base64
import contextlib
import hashlib
from collections.abc import Mapping
from typing import Any

from oncely.brokers._common import require_message_id
from oncely.brokers.sqs._endpoint import (
    BODY_ENCODING_ATTRIBUTE,
    CONSUMER_URL_OPTIONS,
    CONTENT_TYPE_ATTRIBUTE,
    CORRELATION_ATTRIBUTE,
    MAX_ATTRIBUTES,
    MESSAGE_ID_ATTRIBUTE,
    SHARED_URL_OPTIONS,
    Endpoint,
    check_queue,
    queue_missing,
)
from oncely.errors import BrokerError, ConfigurationError

_OWN = (MESSAGE_ID_ATTRIBUTE, CONTENT_TYPE_ATTRIBUTE, CORRELATION_ATTRIBUTE)


def text_attributes(values: Mapping[str, str]) -> dict[str, dict[str, str]]:
    return {name: {"DataType": "String", "StringValue": value} for name, value in values.items()}


def sendable_body(body: bytes) -> tuple[str, dict[str, str]]:
    """An SQS body is text: UTF-8 bytes go as they are, other bytes base64-encoded with
    ``x-oncely-body-encoding: base64`` (the consumer decodes them back)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        return base64.b64encode(body).decode("ascii"), {BODY_ENCODING_ATTRIBUTE: "base64"}
    if text and not any(ch in text for ch in "\x00\ufffe\uffff"):
        return text, {}
    return base64.b64encode(body).decode("ascii"), {BODY_ENCODING_ATTRIBUTE: "base64"}


def fifo_id(value: str) -> str:
    """``value`` as a FIFO deduplication or group id (up to 128 printable ASCII characters):
    as it is when it fits, its SHA-256 otherwise (never cut short: two long ids sharing a
    prefix must stay two ids)."""
    if len(value) <= 128 and value.isascii() and value.isprintable() and " " not in value:
        return value
    return hashlib.sha256(value.encode("utf-8", "surrogateescape")).hexdigest()


class SQSProducer:
    """Sends messages to the queue ``queue`` with the producer's ``message-id`` attribute
    (R2) and returns once SQS has them. To a FIFO queue (``.fifo``) the message id and the
    body make the ``MessageDeduplicationId``, so SQS itself drops a resend within five
    minutes (R14) while a reused id with other content still reaches the consumer's inbox as
    a ``key_conflict`` (R20); ``group`` (default: the message id) is its ``MessageGroupId``,
    the unit of order."""

    def __init__(self, url: str, queue: str) -> None:
        endpoint, options = Endpoint.from_url(url)
        options.done(SHARED_URL_OPTIONS, theirs=CONSUMER_URL_OPTIONS)
        self._setup(endpoint, queue)

    @classmethod
    def on(cls, endpoint: Endpoint, queue: str) -> SQSProducer:
        """A producer on an endpoint already read from a URL (the transport's own, for its
        dead-letter copies)."""
        made = cls.__new__(cls)
        made._setup(endpoint, queue)
        return made

    def _setup(self, endpoint: Endpoint, queue: str) -> None:
        self.endpoint = endpoint
        self.queue = check_queue("queue", queue)
        self.fifo = queue.endswith(".fifo")
        self._stack: contextlib.AsyncExitStack | None = None
        self._client: Any = None
        self._queue_url: str | None = None

    @classmethod
    def from_url(cls, url: str, destination: str) -> SQSProducer:
        """The producer for ``sqs://...`` sending to the queue ``destination``."""
        return cls(url, destination)

    async def _ready_client(self) -> tuple[Any, str | None]:
        if self._client is None:
            stack = contextlib.AsyncExitStack()
            with self.endpoint.errors("connect"):
                self._client = await stack.enter_async_context(self.endpoint.client())
            self._stack = stack
        return self._client, self._queue_url

    async def _ready(self) -> tuple[Any, str]:
        await self._ready_client()
        if self._queue_url is None:
            with self.endpoint.errors(f"find the queue {self.queue!r}"):
                try:
                    found = await self._client.get_queue_url(QueueName=self.queue)
                except Exception as exc:
                    if not queue_missing(exc):
                        raise
                    raise BrokerError(
                        f"sqs {self.endpoint.shown}: no queue {self.queue!r} to send to: a "
                        "producer never creates one (the consumer creates its queue when it "
                        "starts, or create it yourself)"
                    ) from None
            self._queue_url = str(found["QueueUrl"])
        return self._client, self._queue_url

    async def publish(
        self,
        body: bytes,
        *,
        message_id: str,
        headers: Mapping[str, str] | None = None,
        content_type: str = "application/json",
        correlation_id: str | None = None,
        group: str | None = None,
    ) -> None:
        """Send one message; raises :class:`~oncely.BrokerUnavailable` when SQS could not be
        reached (retrying with the same ``message_id`` is then safe)."""
        require_message_id(message_id)
        values = {MESSAGE_ID_ATTRIBUTE: message_id}
        if content_type:
            values[CONTENT_TYPE_ATTRIBUTE] = content_type
        if correlation_id:
            values[CORRELATION_ATTRIBUTE] = correlation_id
        for name, value in (headers or {}).items():
            if name.lower() in _OWN or name == BODY_ENCODING_ATTRIBUTE:
                raise ConfigurationError(
                    f"the header {name!r} is the producer's own; pass it as an argument"
                )
            values[name] = value
        text, extra = sendable_body(body)
        values.update(extra)
        if len(values) > MAX_ATTRIBUTES:
            raise ConfigurationError(
                f"SQS carries at most {MAX_ATTRIBUTES} message attributes; this message has "
                f"{len(values)} (the id, content type and correlation id count)"
            )
        # The deduplication id holds the content too: SQS drops a resend with the same id
        # silently, and a reused id with other content must reach the consumer, whose inbox
        # answers it key_conflict (R20), rather than vanish. A retry sends the same content.
        content = hashlib.sha256(f"{message_id}\n{text}".encode("utf-8", "surrogateescape"))
        await self.send(
            text,
            text_attributes(values),
            message_id=message_id,
            group=group,
            dedup=content.hexdigest(),
        )

    async def send(
        self,
        body: str,
        attributes: Mapping[str, Any],
        *,
        message_id: str | None,
        group: str | None = None,
        queue_url: str | None = None,
        dedup: str | None = None,
    ) -> None:
        """Send one message as it is (also the dead-letter copy's path). On a FIFO queue its
        deduplication id is ``dedup`` (default: ``message_id``)."""
        client, own_url = await self._ready()
        request: dict[str, Any] = {
            "QueueUrl": queue_url or own_url,
            "MessageBody": body,
            "MessageAttributes": dict(attributes),
        }
        if (queue_url or own_url).endswith(".fifo"):
            if message_id is None:
                raise BrokerError("a FIFO queue needs a deduplication id for every message")
            request["MessageDeduplicationId"] = fifo_id(dedup or message_id)
            request["MessageGroupId"] = fifo_id(group or message_id)
        with self.endpoint.errors(f"send to {self.queue!r}"):
            await client.send_message(**request)

    async def close(self) -> None:
        stack, self._stack = self._stack, None
        self._client = None
        if stack is not None:
            await stack.aclose()
