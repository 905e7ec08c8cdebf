"""The SQS transport: long polls the queue, holds each message by its receipt handle, keeps its
visibility timeout extended while the handler runs, and settles it."""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import math
from collections.abc import Iterator, Mapping, Sequence
from datetime import timedelta
from typing import Any, Self

from oncely.brokers._common import not_utf8
from oncely.brokers._shape import REASON_HEADER, BrokerLimits, DeadLetter, Delivery
from oncely.brokers.sqs._endpoint import (
    BODY_ENCODING_ATTRIBUTE,
    CONSUMER_URL_OPTIONS,
    CONTENT_TYPE_ATTRIBUTE,
    CORRELATION_ATTRIBUTE,
    LOGGER,
    MAX_ATTRIBUTES,
    MESSAGE_ID_ATTRIBUTE,
    SHARED_URL_OPTIONS,
    Endpoint,
    check_queue,
    queue_missing,
)
from oncely.brokers.sqs._producer import SQSProducer, text_attributes
from oncely.errors import BrokerError, BrokerUnavailable, ConfigurationError
from oncely.keys import Envelope
from oncely.wire import wire_text

_TRANSPORT_OPTIONS = (*CONSUMER_URL_OPTIONS, *SHARED_URL_OPTIONS)
_MOST_VISIBILITY = 12 * 3600
"""SQS's ceiling on a visibility timeout, in seconds."""
_DEFAULT_MOST = 262_144
"""SQS's default ``MaximumMessageSize`` (bytes), for a queue that does not say its own."""
_CUT = " ... [cut to fit the queue's MaximumMessageSize]"
PACKED_ATTRIBUTE = "x-oncely-attributes"
"""On a dead-letter copy whose attributes would pass SQS's ten: the original's application
attributes, as one JSON object (a ``String`` attribute as its text, any other type as an
object with its ``DataType`` and its ``StringValue`` or base64 ``BinaryValue``)."""


def dead_letter_name(source: str) -> str:
    """``<source>-dead``, or ``<name>-dead.fifo`` for a FIFO queue (SQS queue names allow no
    dot but the FIFO suffix's)."""
    if source.endswith(".fifo"):
        return f"{source.removesuffix('.fifo')}-dead.fifo"
    return f"{source}-dead"


class SQS:
    """Reads the queue ``source`` (see the module docstring).

    ``ack_wait`` is the visibility timeout each received message gets (SQS hands it to
    another consumer once it lapses; running handlers extend it every third of it);
    ``dead_letter`` the queue that receives dead letters (default: the queue's redrive
    policy's target where it has one, so that every dead letter is in one queue, else
    ``<source>-dead``);
    ``create`` whether missing queues are created (with ``ack_wait`` as their visibility
    timeout).
    """

    name = "sqs"
    batch_default = 10
    """Batches by default: a receive's messages (up to 10) are claimed and completed together."""

    def __init__(
        self,
        url: str,
        source: str,
        *,
        group: str,
        dead_letter: str | None = None,
        ack_wait: timedelta | None = None,
        create: bool = True,
        connect_timeout: timedelta | None = None,
    ) -> None:
        endpoint, options = Endpoint.from_url(url)
        url_wait = options.seconds("visibility_timeout", timedelta(seconds=30))
        create = options.boolean("create", create)
        options.done(_TRANSPORT_OPTIONS)
        if connect_timeout is not None:
            endpoint = Endpoint(
                endpoint.region,
                endpoint.endpoint_url,
                endpoint.timeout,
                connect_timeout,
                endpoint.shown,
            )
        self.endpoint = endpoint
        self.source = check_queue("queue", source)
        self.group = group or source
        self.inbox_consumer = self.group
        """What this transport's own dead letters record in ``x-oncely-consumer``."""
        self._dead_given = dead_letter is not None
        self.dead_letter = check_queue(
            "dead-letter queue",
            dead_letter if dead_letter is not None else dead_letter_name(source),
        )
        """The dead-letter queue; without one given, the source's redrive target once open
        (where it has a redrive policy), else ``<source>-dead``."""
        if self.dead_letter == self.source:
            raise ConfigurationError("the dead-letter queue must not be the queue it serves")
        if self.source.endswith(".fifo") != self.dead_letter.endswith(".fifo"):
            raise ConfigurationError("a FIFO queue's dead-letter queue is a FIFO queue too")
        wait = ack_wait if ack_wait is not None else url_wait
        seconds = math.ceil(wait.total_seconds())
        if not 1 <= seconds <= _MOST_VISIBILITY:
            raise ConfigurationError("ack_wait (the visibility timeout) is 1 s to 12 h on SQS")
        self.visibility = seconds
        self.create = create
        self._producer = SQSProducer.on(endpoint, self.source)
        self._queue_url: str | None = None
        self._dead_url: str | None = None
        self._attributes: dict[str, str] = {}
        self._dead_most = _DEFAULT_MOST
        """The dead-letter queue's ``MaximumMessageSize``, read when the transport opens."""
        self._stopped = False
        self._gone = False
        """The queue was found deleted while read: found again by name before each receive,
        never created again, until a receive succeeds."""

    def set_inbox_consumer(self, consumer: str) -> None:
        """The inbox consumer name that the dead letters this transport writes by itself
        (on the last receive the queue's redrive policy allows) record in
        ``x-oncely-consumer``, as every other dead letter does;
        :class:`~oncely.brokers.BrokerConsumer` gives it. Until then, the group's name."""
        self.inbox_consumer = consumer

    @classmethod
    def from_url(
        cls,
        url: str,
        source: str,
        *,
        group: str,
        dead_letter: str | None = None,
        ack_wait: timedelta | None = None,
    ) -> Self:
        """The transport for ``sqs://HOST:PORT``, ``sqs://REGION`` or ``sqs://``. Options:
        ``visibility_timeout``, ``timeout``, ``connect_timeout`` (seconds), ``region``,
        ``secure`` (HTTPS to HOST:PORT), ``create`` (create missing queues, true)."""
        return cls(url, source, group=group, dead_letter=dead_letter, ack_wait=ack_wait)

    @property
    def extend_every(self) -> timedelta:
        return timedelta(seconds=self.visibility) / 3

    @property
    def limits(self) -> BrokerLimits:
        """The queue's own numbers once open: the visibility timeout, ``MessageRetention
        Period`` and the redrive policy's ``maxReceiveCount`` (none without one)."""
        retention = self._attributes.get("MessageRetentionPeriod")
        return BrokerLimits(
            ack_wait=timedelta(seconds=self.visibility),
            message_ttl=timedelta(seconds=int(retention)) if retention else None,
            max_deliveries=self.redrive_limit,
            source=f"SQS queue {self.source!r} visibility timeout, retention and redrive policy",
        )

    @property
    def redrive_limit(self) -> int | None:
        """The queue's redrive policy ``maxReceiveCount`` once open: SQS moves a message
        received that many times to the policy's queue, with no reason, on its next receive
        (``None``: no redrive policy)."""
        redrive = self._attributes.get("RedrivePolicy")
        if redrive:
            with contextlib.suppress(ValueError, TypeError, KeyError):
                return int(json.loads(redrive)["maxReceiveCount"])
        return None

    # ------------------------------------------------------------------ the connection

    async def _client(self) -> Any:
        client, _url = await self._producer._ready_client()
        return client

    async def open(self, prefetch: int) -> None:
        self._stopped = False
        if self._queue_url is not None:
            return
        client = await self._client()
        fifo = self.source.endswith(".fifo")
        self._queue_url = await self._queue(client, self.source, fifo, self.visibility)
        with self.endpoint.errors(f"read the attributes of {self.source!r}"):
            found = await client.get_queue_attributes(
                QueueUrl=self._queue_url, AttributeNames=["All"]
            )
        self._attributes = dict(found.get("Attributes", {}))
        target = self._redrive_target()
        if target is not None:  # dead letters where SQS moves the rest: one place to look
            self.dead_letter = target
        self._dead_url = await self._queue(client, self.dead_letter, fifo, None)
        with self.endpoint.errors(f"read the attributes of {self.dead_letter!r}"):
            found = await client.get_queue_attributes(
                QueueUrl=self._dead_url, AttributeNames=["MaximumMessageSize"]
            )
        most = found.get("Attributes", {}).get("MaximumMessageSize")
        self._dead_most = int(most) if most and str(most).isdigit() else _DEFAULT_MOST
        self._producer._queue_url = self._queue_url

    def _redrive_target(self) -> str | None:
        """The queue the source's redrive policy moves messages to, when no dead-letter
        queue was given (the name at the end of ``deadLetterTargetArn``; SQS keeps it in the
        same account and region); None without one."""
        if self._dead_given:
            return None
        try:
            arn = json.loads(self._attributes.get("RedrivePolicy") or "{}")["deadLetterTargetArn"]
        except (ValueError, KeyError, TypeError):
            return None
        name = str(arn).rsplit(":", 1)[-1]
        return name if name and name != self.source else None

    async def _queue(self, client: Any, name: str, fifo: bool, visibility: int | None) -> str:
        with self.endpoint.errors(f"find the queue {name!r}"):
            try:
                return str((await client.get_queue_url(QueueName=name))["QueueUrl"])
            except Exception as exc:
                if not queue_missing(exc):
                    raise
                if not self.create:
                    raise BrokerError(
                        f"sqs {self.endpoint.shown}: no queue {name!r} (create=false)"
                    ) from None
        attributes: dict[str, str] = {}
        if fifo:
            attributes["FifoQueue"] = "true"
        if visibility is not None:
            attributes["VisibilityTimeout"] = str(visibility)
        with self.endpoint.errors(f"create the queue {name!r}"):
            made = await client.create_queue(QueueName=name, Attributes=attributes)
        if name == self.source:  # nothing to read yet: a mistyped name reads nothing, forever
            LOGGER.warning(
                "oncely broker=sqs created queue %s to read, which did not exist (create=false "
                "refuses a missing queue instead)",
                name,
            )
        else:
            LOGGER.info("oncely broker=sqs created queue %s", name)
        return str(made["QueueUrl"])

    @contextlib.contextmanager
    def _on_source(self, what: str) -> Iterator[None]:
        """:meth:`Endpoint.errors`, where the queue found missing (deleted while read) is
        :class:`~oncely.BrokerUnavailable`: the consumer rides it out with its reconnect
        backoff, logging each try, rather than stopping."""
        with self.endpoint.errors(what):
            try:
                yield
            except Exception as exc:
                if not queue_missing(exc):
                    raise
                raise self._lost() from None

    def _lost(self) -> BrokerUnavailable:
        if not self._gone:
            self._gone = True
            LOGGER.error(
                "oncely broker=sqs queue %s does not exist any more (deleted while this consumer "
                "read it): nothing is read until it exists again. The consumer never creates it "
                "again while it runs (a queue it made would lack the attributes it was given: "
                "redrive policy, retention, encryption, access policy); create it as it was, "
                "and the consumer reads it again",
                self.source,
            )
        return BrokerUnavailable(
            f"sqs {self.endpoint.shown}: the queue {self.source!r} does not exist (deleted "
            "while read); waiting for it to be created again"
        )

    async def _find_again(self, client: Any) -> None:
        """While the queue is gone: its URL by name (the same once it is created again, on
        AWS and emulators alike), or :class:`~oncely.BrokerUnavailable` while it is still
        missing."""
        with self._on_source(f"find the queue {self.source!r}"):
            found = await client.get_queue_url(QueueName=self.source)
        self._queue_url = self._producer._queue_url = str(found["QueueUrl"])

    async def _found_again(self, client: Any) -> None:
        """The queue answered a receive again: its attributes read anew (a queue created again
        may carry another redrive policy or retention), and said."""
        self._gone = False
        with contextlib.suppress(BrokerError), self.endpoint.errors("read the attributes"):
            found = await client.get_queue_attributes(
                QueueUrl=self._queue_url, AttributeNames=["All"]
            )
            self._attributes = dict(found.get("Attributes", {}))
        LOGGER.warning("oncely broker=sqs queue %s exists again; reading it", self.source)

    async def stop(self) -> None:
        self._stopped = True

    async def close(self) -> None:
        self._stopped = True
        self._queue_url = None
        await self._producer.close()

    # ------------------------------------------------------------------ reading

    async def fetch(self, limit: int, timeout: timedelta) -> list[Delivery]:
        if self._stopped or limit < 1:
            return []
        if self._queue_url is None:
            await self.open(limit)
        client = await self._client()
        if self._gone:
            await self._find_again(client)
        wait = min(20, int(timeout.total_seconds()))
        with self._on_source(f"receive from {self.source!r}"):
            got = await client.receive_message(
                QueueUrl=self._queue_url,
                MaxNumberOfMessages=min(10, limit),
                WaitTimeSeconds=wait,
                VisibilityTimeout=self.visibility,
                MessageAttributeNames=["All"],
                MessageSystemAttributeNames=["All"],
            )
        if self._gone:
            await self._found_again(client)
        messages = got.get("Messages", [])
        if not messages and wait < timeout.total_seconds():
            await asyncio.sleep(timeout.total_seconds() - wait)
        return [SQSDelivery(self, m) for m in messages]

    # ------------------------------------------------------------------ settling

    async def _change(self, receipt: str, seconds: int, what: str) -> None:
        client = await self._client()
        with self._on_source(what):
            await client.change_message_visibility(
                QueueUrl=self._queue_url, ReceiptHandle=receipt, VisibilityTimeout=seconds
            )

    async def _delete(self, receipt: str) -> None:
        client = await self._client()
        with self._on_source("delete a message"):
            await client.delete_message(QueueUrl=self._queue_url, ReceiptHandle=receipt)

    async def ack_many(self, deliveries: Sequence[Delivery]) -> None:
        """Acknowledge a batch's deliveries with ``DeleteMessageBatch`` (10 per call). A message
        SQS could not delete is logged and comes again (the inbox answers it ``duplicate``);
        the call itself failing raises :class:`~oncely.BrokerUnavailable` for all of them."""
        mine = [d for d in deliveries if isinstance(d, SQSDelivery) and not d._settled]
        client = await self._client()
        for start in range(0, len(mine), 10):
            chunk = mine[start : start + 10]
            entries = [{"Id": str(i), "ReceiptHandle": d._receipt} for i, d in enumerate(chunk)]
            with self._on_source("delete messages"):
                answer = await client.delete_message_batch(
                    QueueUrl=self._queue_url, Entries=entries
                )
            for d in chunk:
                d._settled = True
            for failed in answer.get("Failed", []):
                LOGGER.warning(
                    "oncely broker=sqs could not delete a message (%s: %s); it comes again and "
                    "meets its record%s",
                    failed.get("Code"),
                    failed.get("Message"),
                    f" sqs_message_id={chunk[int(failed['Id'])].describe()['sqs_message_id']}",
                )

    async def _copy_to_dead_letter(self, message: Mapping[str, Any], why: DeadLetter) -> None:
        reasons = {**why.headers(), "x-oncely-queue": self.source}
        original = {
            name: value
            for name, value in message.get("MessageAttributes", {}).items()
            if name not in reasons and name != PACKED_ATTRIBUTE
        }
        if len(original) + len(reasons) > MAX_ATTRIBUTES:
            own = (MESSAGE_ID_ATTRIBUTE, CONTENT_TYPE_ATTRIBUTE, CORRELATION_ATTRIBUTE)
            kept = {n: v for n, v in original.items() if n in own or n == BODY_ENCODING_ATTRIBUTE}
            packed = {n: _packable(v) for n, v in original.items() if n not in kept}
            original = {**kept, **text_attributes({PACKED_ATTRIBUTE: json.dumps(packed)})}
        body = str(message.get("Body", ""))
        reasons[REASON_HEADER] = _fit(reasons, original, body, self._dead_most)
        attributes = {**original, **text_attributes(reasons)}
        message_id = _text(message.get("MessageAttributes", {}).get(MESSAGE_ID_ATTRIBUTE))
        group = message.get("Attributes", {}).get("MessageGroupId")
        await self._producer.send(
            body,
            attributes,
            message_id=message_id or str(message.get("MessageId")),
            group=group,
            queue_url=self._dead_url,
            # One copy per message SQS delivered (its own MessageId), not per message id: two
            # messages reusing one id (a key_conflict) are two dead letters, and a copy
            # written again for one redelivered message is dropped by the FIFO queue.
            dedup=f"dead:{message.get('MessageId')}",
        )


def _size(body: str, attributes: Mapping[str, Mapping[str, Any]]) -> int:
    """A message's size as SQS counts it against ``MaximumMessageSize``: the body, and each
    attribute's name, data type and value, in bytes."""
    size = len(body.encode("utf-8", "surrogatepass"))
    for name, attribute in attributes.items():
        size += len(name.encode()) + len(str(attribute.get("DataType", "")).encode())
        if "StringValue" in attribute:
            size += len(str(attribute["StringValue"]).encode("utf-8", "surrogatepass"))
        raw = attribute.get("BinaryValue")
        if isinstance(raw, bytes | bytearray):
            size += len(raw)
        elif raw is not None:
            size += len(str(raw).encode())
    return size


def _fit(
    reasons: Mapping[str, str],
    original: Mapping[str, Mapping[str, Any]],
    body: str,
    most: int,
) -> str:
    """``x-oncely-reason``, cut so that the dead-letter copy is at most ``most`` bytes (a
    handler's error may be of any length: a copy over the queue's limit is refused, and the
    message would loop). The body and the other attributes are kept whole."""
    reason = reasons[REASON_HEADER]
    over = _size(body, {**original, **text_attributes(reasons)}) - most
    if over <= 0:
        return reason
    raw = reason.encode("utf-8", "surrogatepass")
    room = max(0, len(raw) - over - len(_CUT.encode()))
    return raw[:room].decode("utf-8", "ignore") + _CUT


def _packable(attribute: Mapping[str, Any]) -> object:
    """A message attribute as a value of the packed JSON attribute: a ``String`` one's text;
    any other (``Number``, ``Binary``, custom types) as ``{"DataType": ..., "StringValue":
    ...}`` or ``{"DataType": ..., "BinaryValue": base64}``, so nothing is lost in the copy."""
    kind = str(attribute.get("DataType", "String"))
    if "StringValue" in attribute:
        if kind == "String":
            return str(attribute["StringValue"])
        return {"DataType": kind, "StringValue": str(attribute["StringValue"])}
    raw = attribute.get("BinaryValue", b"")
    raw = raw if isinstance(raw, bytes | bytearray) else str(raw).encode()
    return {"DataType": kind, "BinaryValue": base64.b64encode(raw).decode("ascii")}


def _text(attribute: Mapping[str, Any] | None) -> str | None:
    """A message attribute's value as text (a binary one's bytes kept as escapes)."""
    if attribute is None:
        return None
    if "StringValue" in attribute:
        return str(attribute["StringValue"])
    raw = attribute.get("BinaryValue")
    return wire_text(raw) if isinstance(raw, bytes | bytearray) else None


class SQSDelivery:
    """One received message, held by its receipt handle until settled."""

    __slots__ = ("_count", "_envelope", "_message", "_refusal", "_settled", "_transport")

    def __init__(self, transport: SQS, message: Mapping[str, Any]) -> None:
        self._transport = transport
        self._message = message
        self._settled = False
        system = message.get("Attributes", {})
        self._count = int(system.get("ApproximateReceiveCount", "1"))
        headers = {
            name: text
            for name, value in message.get("MessageAttributes", {}).items()
            if (text := _text(value)) is not None
        }
        message_id = headers.get(MESSAGE_ID_ATTRIBUTE) or None
        correlation_id = headers.get(CORRELATION_ATTRIBUTE) or None
        content_type = headers.get(CONTENT_TYPE_ATTRIBUTE) or None
        self._refusal = not_utf8(
            (
                (f"message id (attribute {MESSAGE_ID_ATTRIBUTE})", message_id),
                (f"correlation id (attribute {CORRELATION_ATTRIBUTE})", correlation_id),
                (f"content type (attribute {CONTENT_TYPE_ATTRIBUTE})", content_type),
            )
        )
        text = str(message.get("Body", ""))
        body = text.encode("utf-8", "surrogatepass")
        if headers.get(BODY_ENCODING_ATTRIBUTE) == "base64":
            try:
                body = base64.b64decode(text, validate=True)
            except (binascii.Error, ValueError):
                self._refusal = self._refusal or "the body says base64 and is not base64"
        self._envelope = Envelope(
            body=body,
            message_id=message_id,
            headers=headers,
            correlation_id=correlation_id,
            delivery_count=self._count,
            transport={
                "queue": transport.source,
                "sqs_message_id": message.get("MessageId"),
                "delivery_count": self._count,
                "redelivered": self._count > 1,
                "sent_at": system.get("SentTimestamp"),
                "message_group": system.get("MessageGroupId"),
                "content_type": content_type,
            },
        )

    @property
    def envelope(self) -> Envelope:
        return self._envelope

    @property
    def delivery_count(self) -> int:
        """SQS's ``ApproximateReceiveCount`` (approximate only across regions' replicas)."""
        return self._count

    @property
    def refusal(self) -> str | None:
        return self._refusal

    @property
    def group(self) -> str | None:
        """A FIFO queue's ``MessageGroupId`` (a batch keeps each group's order); ``None`` on a
        standard queue."""
        group = self._envelope.transport["message_group"]
        return str(group) if group is not None else None

    @property
    def identity(self) -> tuple[str, str] | None:
        """The queue and SQS's own ``MessageId``: the same on each receive of the message."""
        message_id = self._message.get("MessageId")
        return (self._transport.source, str(message_id)) if message_id else None

    def describe(self) -> Mapping[str, object]:
        t = self._envelope.transport
        return {k: t[k] for k in ("queue", "sqs_message_id", "delivery_count")}

    @property
    def _receipt(self) -> str:
        return str(self._message["ReceiptHandle"])

    def _settling(self, what: str) -> None:
        if self._settled:
            raise BrokerError(f"this delivery was already settled; cannot {what} it")

    async def ack(self) -> None:
        self._settling("ack")
        await self._transport._delete(self._receipt)
        self._settled = True

    async def retry(self, delay: timedelta) -> None:
        """Visible again after ``delay`` (whole seconds, rounded up; at most 12 h). On its
        last receive under the queue's redrive policy it is dead-lettered instead, with the
        reason: SQS would move it to the policy's queue without one."""
        self._settling("retry")
        limit = self._transport.redrive_limit
        if limit is not None and self._count >= limit:
            LOGGER.warning(
                "oncely broker=sqs a message on its last receive (%s, the queue's redrive "
                "maxReceiveCount) is dead-lettered instead of given back",
                self._count,
            )
            await self.dead_letter(
                DeadLetter(
                    outcome="rejected",
                    reason=(
                        f"received {self._count} times, the queue's redrive maxReceiveCount: "
                        "SQS would move it to the redrive queue with no reason (raise "
                        "maxReceiveCount above ConsumerSettings.max_deliveries"
                        + (
                            ", with room for the receives a message spends held back behind "
                            "earlier ones of its group, which SQS counts too)"
                            if self.group is not None
                            else ")"
                        )
                    ),
                    consumer=self._transport.inbox_consumer,
                    deliveries=self._count,
                )
            )
            return
        seconds = min(_MOST_VISIBILITY, max(0, math.ceil(delay.total_seconds())))
        await self._transport._change(self._receipt, seconds, "give a message back")
        self._settled = True

    async def dead_letter(self, why: DeadLetter) -> None:
        self._settling("dead-letter")
        await self._transport._copy_to_dead_letter(self._message, why)
        await self._transport._delete(self._receipt)
        self._settled = True

    async def extend(self) -> None:
        if not self._settled:
            await self._transport._change(
                self._receipt, self._transport.visibility, "extend a message's visibility"
            )
