"""Dedup keys: where they come from and what makes one acceptable (R2-R5).

A key names the *logical* message on every redelivery (R2): the producer's message id, the
CloudEvents pair ``(source, id)`` (R3), or a business idempotency key. It is never a transport id
the broker regenerates per delivery, nor anything derived from the attempt or the receive time
(R4). Records are scoped by consumer (R5), so the consumer name is validated here too.

Keys are lossless: an id whose bytes are not UTF-8 (kept as escapes by
:func:`oncely.wire.wire_text`) is refused by every key source with the field named, never
replaced, so two different byte strings can never become one key (R2).
"""

from __future__ import annotations

import hashlib
import sys
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, Final, Protocol

from oncely import cloudevents
from oncely._core.policy import Limits
from oncely.errors import ConfigurationError, InvalidIdentifier, InvalidKey, KeyTooLong, MissingKey
from oncely.wire import Repeated, escaped, undecodable_reason

__all__ = [
    "TRANSPORT_FIELDS",
    "BusinessKey",
    "CloudEventsKey",
    "CorrelationIdKey",
    "Envelope",
    "FirstOf",
    "HeaderKey",
    "KeySource",
    "KeyWarning",
    "MessageIdKey",
    "hashed_key",
    "is_transport_field",
    "key_source",
    "validate_consumer",
    "validate_key",
]

_MAX_CONSUMER_CHARS = 200


class KeyWarning(UserWarning):
    """A key source that works but may merge different messages into one key, such as a
    correlation id shared by a request and its replies (R2). Warned when it is built."""


def _normal(name: str) -> str:
    # Header names compared case-insensitively, with "-" and "_" alike (and CamelCase equal to
    # its snake and kebab spellings): "X-Opt-Lock-Token" == "x_opt_lock_token" == "XOptLockToken".
    return name.lower().replace("-", "").replace("_", "")


_PER_DELIVERY = (
    "the broker sets it on each delivery and it changes on redelivery, so as a dedup key it "
    "would let a redelivered copy through"
)
_PER_SEND = (
    "the broker assigns it when it stores the message, so a producer's retry or a copy "
    "resubmitted from a dead-letter queue gets a new one: as a dedup key it would let those "
    "duplicates through"
)
_TIME = (
    "the broker records it per send or delivery, so a retry or a redelivery carries another "
    "one: as a dedup key it would let those copies through (and merge messages of one instant)"
)
_PLACE = (
    "it says where the broker put the message, not which message it is: as a dedup key it "
    "would merge every message put there"
)
_DEAD_LETTER = (
    "the broker extends it each time the message is dead-lettered, so a copy redelivered from "
    "a dead-letter queue carries another one: as a dedup key it would let such copies through"
)

_TRANSPORT_GROUPS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("the AMQP delivery tag", _PER_DELIVERY, ("delivery-tag", "amqp_deliveryTag")),
    ("a redelivered flag", _PER_DELIVERY, ("redelivered", "amqp_redelivered", "JMSRedelivered")),
    ("a delivery count", _PER_DELIVERY, (
        "x-delivery-count",  # RabbitMQ quorum queues
        "delivery-count", "DeliveryCount",  # Azure Service Bus
        "JMSXDeliveryCount",  # JMS
        "ApproximateReceiveCount",  # SQS
        "Nats-Num-Delivered", "num-delivered",  # NATS JetStream metadata
        "kafka_deliveryAttempt", "delivery-attempt", "deliveryAttempt",  # Spring Kafka, Pub/Sub
    )),
    ("RabbitMQ's dead-letter history", _DEAD_LETTER, (
        "x-death",
        "x-first-death-queue", "x-first-death-reason", "x-first-death-exchange",
        "x-last-death-queue", "x-last-death-reason", "x-last-death-exchange",
    )),
    ("a lock token or receipt handle", _PER_DELIVERY, (
        "lock-token", "LockToken", "x-opt-lock-token",  # Azure Service Bus
        "ReceiptHandle", "receipt-handle",  # SQS
        "ack-id", "ackId",  # Google Pub/Sub
    )),
    ("a sequence number or offset", _PER_SEND, (
        "sequence-number", "SequenceNumber", "x-opt-sequence-number",  # Azure
        "EnqueuedSequenceNumber", "x-opt-enqueue-sequence-number",
        "x-opt-offset",  # Azure Event Hubs
        "x-stream-offset",  # RabbitMQ streams
        "offset", "kafka_offset", "message-offset",  # Kafka
        "Nats-Sequence",  # NATS JetStream
        "entry-id", "stream-id", "stream-entry-id",  # Redis stream entry ids
    )),
    ("a broker time stamp", _TIME, (
        "timestamp", "kafka_timestamp", "kafka_receivedTimestamp",  # Kafka
        "JMSTimestamp", "JMSXRcvTimestamp",  # JMS
        "x-opt-enqueued-time", "EnqueuedTimeUtc", "EnqueuedTime",  # Azure
        "x-opt-locked-until", "LockedUntilUtc", "LockedUntil",
        "SentTimestamp", "ApproximateFirstReceiveTimestamp",  # SQS
        "Nats-Time-Stamp",  # NATS JetStream
        "publishTime", "publish-time",  # Google Pub/Sub
        "received-at",
    )),
    ("a partition", _PLACE, (
        "partition", "kafka_partition", "kafka_partitionId", "kafka_receivedPartitionId",
    )),
)  # fmt: skip

_TRANSPORT_WHY = {
    _normal(name): f"{what}: {why}" for what, why, names in _TRANSPORT_GROUPS for name in names
}


def _spellings(names: Iterable[str]) -> frozenset[str]:
    out: set[str] = set()
    for name in names:
        low = name.lower()
        out.update({low, low.replace("_", "-"), low.replace("-", "_"), _normal(low)})
    return frozenset(out)


TRANSPORT_FIELDS = _spellings(name for _, _, names in _TRANSPORT_GROUPS for name in names)
"""Header names that carry per-delivery transport data (RabbitMQ, Azure Service Bus and Event
Hubs, JMS, Kafka, SQS, NATS JetStream, Redis streams, Pub/Sub), in lower case, each with ``-``,
``_`` and no separator. Refused as key sources (R4); test a name with
:func:`is_transport_field`, which also matches mixed spellings."""


def is_transport_field(name: str) -> bool:
    """True when ``name`` is a per-delivery transport field (case-insensitive, ``-`` and
    ``_`` alike): refused as a key source and as a stream's id or body field (R4)."""
    return _normal(name) in _TRANSPORT_WHY


_USE_INSTEAD = "use the producer's message id, the CloudEvents (source, id) or a business key"


def _transport_refusal(name: str, instead: str = _USE_INSTEAD) -> str | None:
    why = _TRANSPORT_WHY.get(_normal(name))
    return None if why is None else f"{name!r} is {why} (R4); {instead}"


_SHARED_BY_REPLIES = (
    "usually shared by a request and its replies (and often by every message of one conversation)"
)
_CORRELATION = f"a correlation id, {_SHARED_BY_REPLIES}"
_TRACE = (
    "trace context, shared by every message of one trace (and its span part may change when a "
    "producer retries)"
)
_SHARED_IDS: dict[str, str] = {
    _normal(name): what
    for what, names in (
        (_CORRELATION, (
            "correlation-id", "x-correlation-id", "JMSCorrelationID", "amqp_correlationId",
            "kafka_correlationId", "causation-id", "x-causation-id", "conversation-id",
            "x-conversation-id",
        )),
        (_TRACE, (
            "traceparent", "tracestate", "trace-id", "x-trace-id", "b3", "x-b3-traceid",
            "x-b3-spanid", "uber-trace-id", "x-amzn-trace-id", "x-cloud-trace-context",
        )),
    )
    for name in names
}  # fmt: skip


def _warn_shared(subject: str, what: str) -> None:
    message = (
        f"{subject} is {what}: as a dedup key it makes several messages one, and all but the "
        "first are dropped as duplicates (R2). Keep it only if your producers set a distinct "
        "one per message; otherwise key on the message id, the CloudEvents (source, id) or a "
        "business key"
    )
    # Point the warning at the code that chose the key, past this module's frames (and the
    # __init__ dataclasses generate).
    frame = sys._getframe(1)
    level = 2
    while frame.f_back is not None and (
        frame.f_code.co_filename == __file__
        or (frame.f_code.co_filename == "<string>" and frame.f_code.co_name == "__init__")
    ):
        frame = frame.f_back
        level += 1
    warnings.warn(message, KeyWarning, stacklevel=level)


def validate_consumer(consumer: object) -> str:
    """A consumer name: a non-empty, stable string that scopes every record (R5)."""
    if not isinstance(consumer, str):
        raise InvalidIdentifier(f"consumer must be a string, got {type(consumer).__name__}")
    if not consumer or consumer.strip() != consumer:
        raise InvalidIdentifier(
            "consumer must be a non-empty name without surrounding spaces; it scopes every "
            "record, so independent subscribers of one channel each keep their own (R5)"
        )
    if len(consumer) > _MAX_CONSUMER_CHARS or "\x00" in consumer:
        raise InvalidIdentifier(
            f"consumer must be at most {_MAX_CONSUMER_CHARS} characters with no NUL"
        )
    return consumer


def hashed_key(key: str) -> str:
    """The form a key over ``Limits.max_key_bytes`` is stored in with ``hash_long_keys``:
    ``sha256:`` and the hex SHA-256 of its UTF-8 bytes (71 characters, under every limit)."""
    return "sha256:" + hashlib.sha256(key.encode("utf-8")).hexdigest()


def validate_key(key: object, limits: Limits) -> str:
    """Check a dedup key and return it (hashed if too long and ``limits.hash_long_keys``).

    Raises :class:`MissingKey` for ``None`` or an empty string, :class:`InvalidKey` for a
    non-string, a NUL character or text that is not UTF-8 (bytes :func:`~oncely.wire.
    wire_text` kept as escapes, or a lone surrogate), :class:`KeyTooLong` over
    ``limits.max_key_bytes``. ASCII keys take the fast path: no encoding at all.
    """
    if type(key) is not str:
        if key is None:
            raise MissingKey("the message has no dedup key")
        raise InvalidKey(
            f"a dedup key must be a string, got {type(key).__name__}; convert ids explicitly "
            "(str(order_id)) so every producer spells the key the same way"
        )
    if not key:
        raise MissingKey("the dedup key is empty")
    if key.isascii():
        size = len(key)
    else:
        try:
            size = len(key.encode("utf-8"))
        except UnicodeEncodeError:
            # Bytes that were not UTF-8 (escaped by wire_text), or a lone surrogate.
            raise InvalidKey(undecodable_reason("dedup key", key)) from None
    if size > limits.max_key_bytes:
        if limits.hash_long_keys:
            return hashed_key(key)
        raise KeyTooLong(
            f"the dedup key is {size} bytes, over the limit of {limits.max_key_bytes}; use a "
            "shorter key or Limits(hash_long_keys=True) (oncely consume --hash-long-keys)"
        )
    if "\x00" in key:
        raise InvalidKey("a dedup key must not contain NUL characters")
    return key


@dataclass(frozen=True, slots=True, kw_only=True)
class Envelope:
    """A broker message as adapters hand it to the inbox.

    ``message_id`` is the *producer-assigned* id (AMQP ``message_id``, ``Nats-Msg-Id``), never a
    broker-assigned one. ``transport`` holds per-delivery data (delivery tag, stream entry id,
    sequence, redelivered flag) for logs only: no key source reads an id from it (R4); only
    its ``content_type`` is read, to tell a structured-mode CloudEvent.

    Adapters decode wire bytes with :func:`oncely.wire.wire_text`, so an id that is not
    UTF-8 arrives as text with escape code points; every key source refuses it (R2).

    ``message_id_refusal`` says why the message's id was not taken as the producer's (an id
    the client library made up for a message published without one, as aio-pika does):
    ``message_id`` is then ``None``, and :class:`MessageIdKey` gives this as its reason.
    """

    body: object
    message_id: str | None = None
    headers: Mapping[str, object] = field(default_factory=dict)
    correlation_id: str | None = None
    delivery_count: int | None = None
    transport: Mapping[str, object] = field(default_factory=dict)
    message_id_refusal: str | None = None


class KeySource(Protocol):
    """Reads the dedup key of an envelope; raises :class:`MissingKey` when there is none."""

    def __call__(self, envelope: Envelope) -> str: ...


def _header(headers: Mapping[str, object], *names: str) -> object:
    for name in names:
        if name in headers:
            return headers[name]
    lowered = {k.lower(): v for k, v in headers.items()}
    for name in names:
        if name.lower() in lowered:
            return lowered[name.lower()]
    return None


def _kind(value: object) -> str:
    if isinstance(value, Mapping):
        return "a table (a mapping)"
    if isinstance(value, list | tuple):
        return "an array"
    if isinstance(value, bool):
        return f"a flag ({value!r})"
    if isinstance(value, float):
        return f"a floating-point number ({value!r})"
    return f"a {type(value).__name__}"


_text = cloudevents.header_text  # bytes -> wire_text: lossless, never "replace"


def _refuse_undecodable(field: str, text: str) -> None:
    # Callers test text.isascii() first, so an ASCII key costs nothing more.
    if escaped(text):
        raise InvalidKey(undecodable_reason(field, text))


@dataclass(frozen=True, slots=True)
class MessageIdKey:
    """The producer-assigned message id (R2, R20 step 1)."""

    def __call__(self, envelope: Envelope) -> str:
        if not envelope.message_id:
            if envelope.message_id_refusal:
                # An id the client made up, not the producer's: as good as none (R2, R4).
                raise MissingKey(envelope.message_id_refusal)
            raise MissingKey(
                "the message has no producer-assigned message id; set one in the producer "
                "(oncely's producer helpers do) or choose another key source"
            )
        message_id = envelope.message_id
        if not message_id.isascii():
            _refuse_undecodable("message id", message_id)
        return message_id


@dataclass(frozen=True, slots=True)
class CorrelationIdKey:
    """The message's correlation id (AMQP ``correlation_id``). A correlation id is usually
    shared by several messages (a request and its replies), so building this source warns
    with a :class:`KeyWarning` (R2); it works for producers that set one per message."""

    def __post_init__(self) -> None:
        _warn_shared("the message's correlation id", _SHARED_BY_REPLIES)

    def __call__(self, envelope: Envelope) -> str:
        value = envelope.correlation_id
        if not value:
            raise MissingKey("the message has no correlation id")
        if not value.isascii():
            _refuse_undecodable("correlation id", value)
        return value


@dataclass(frozen=True, slots=True)
class CloudEventsKey:
    """The CloudEvents pair ``(source, id)`` (R3), as ``"<source> <id>"``: a URI reference has
    no white space, so the pair is recovered unambiguously.

    Binary mode reads the headers of every protocol binding (``ce-`` for HTTP and NATS, ``ce_``
    for Kafka, ``cloudEvents_`` and ``cloudEvents:`` for AMQP, in any case; MQTT user
    properties when unmistakable); structured mode reads a body with ``specversion`` (content
    type ``application/cloudevents+json``), decoded or not. See
    :mod:`oncely.cloudevents`."""

    def __call__(self, envelope: Envelope) -> str:
        return cloudevents.event_key(envelope)


@dataclass(frozen=True, slots=True)
class HeaderKey:
    """A producer-set header holding a business idempotency key."""

    name: str

    def __post_init__(self) -> None:
        refusal = _transport_refusal(self.name)
        if refusal is not None:
            raise ConfigurationError(refusal)
        shared = _SHARED_IDS.get(_normal(self.name))
        if shared is not None:
            _warn_shared(f"the {self.name!r} header", shared)

    def __call__(self, envelope: Envelope) -> str:
        value = _text(_header(envelope.headers, self.name))
        if isinstance(value, Repeated):
            raise InvalidKey(value.refusal(self.name))
        if value is None or value == "":
            raise MissingKey(f"the message has no {self.name!r} header")
        if type(value) is str:
            if not value.isascii():
                _refuse_undecodable(f"{self.name!r} header", value)
            return value
        if isinstance(value, bool) or not isinstance(value, str | int | Decimal):
            # A table, an array, a float, a flag: no single spelling of it is the producer's
            # key (1.0 and 1, True and "True"), so two copies could key apart or two
            # messages alike.
            raise InvalidKey(
                f"the {self.name!r} header is {_kind(value)}, not text; have the producer "
                "send the key as a string"
            )
        return str(value)


@dataclass(frozen=True, slots=True)
class BusinessKey:
    """A key computed from the decoded body, e.g. ``BusinessKey(lambda o: o["order_id"])``."""

    read: Callable[[object], object]

    def __call__(self, envelope: Envelope) -> str:
        try:
            value = self.read(envelope.body)
        except (KeyError, IndexError, TypeError, AttributeError) as exc:
            has = (
                f"; the body has {_some_names(envelope.body)}"
                if isinstance(exc, KeyError) and isinstance(envelope.body, Mapping)
                else ""
            )
            raise MissingKey(f"the business key is missing from the body ({exc!r}){has}") from exc
        if value is None or value == "":
            raise MissingKey("the business key is empty")
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            raise InvalidKey(
                f"a business key must be a string or an integer, got {type(value).__name__}"
            )
        text = str(value)
        if not text.isascii():
            _refuse_undecodable("business key", text)
        return text


@dataclass(frozen=True, slots=True)
class FirstOf:
    """The first source that finds a key, e.g. ``FirstOf(CloudEventsKey(), MessageIdKey())``.

    A source that finds no key (:class:`~oncely.errors.MissingKey`) passes to the next; one
    that finds a malformed key (:class:`~oncely.errors.InvalidKey`) does not.

    With a :class:`CloudEventsKey` among the sources, a key found by any *other* source that
    holds a space is refused (:class:`~oncely.errors.InvalidKey`, so the consumer
    dead-letters the message with the reason): a CloudEvents key is ``"<source> <id>"``, so a
    message id ``"/shop e1"`` would share its key with the event (source ``/shop``, id ``e1``)
    and one of the two would be skipped as a duplicate (R2, R3). Keys without a space are kept
    as they are."""

    sources: tuple[KeySource, ...]
    _cloudevents: bool = field(default=False, init=False, repr=False, compare=False)

    def __init__(self, *sources: KeySource) -> None:
        if not sources:
            raise ConfigurationError("FirstOf needs at least one key source")
        object.__setattr__(self, "sources", sources)
        object.__setattr__(self, "_cloudevents", any(map(_keys_events, sources)))

    def __call__(self, envelope: Envelope) -> str:
        reasons: list[str] = []
        for source in self.sources:
            try:
                key = source(envelope)
            except MissingKey as exc:
                reasons.append(str(exc))
                continue
            if self._cloudevents and " " in key and not _keys_events(source):
                raise InvalidKey(
                    f"the key {key!r} holds a space, so it could be taken for a CloudEvents key "
                    '"<source> <id>" and two messages would share it (this FirstOf also '
                    "reads CloudEvents keys); send a key without spaces, or key by one "
                    "source only (R2, R3)"
                )
            return key
        raise MissingKey("no key source found a key: " + "; ".join(reasons))


def _keys_events(source: KeySource) -> bool:
    # A CloudEventsKey, or a FirstOf that has one (it refuses its other sources' spaced keys).
    return isinstance(source, CloudEventsKey) or (
        isinstance(source, FirstOf) and source._cloudevents
    )


_SEQUENCE_SPECS = frozenset(map(_normal, ("sequence", "stream-sequence", "consumer-sequence")))
"""Bare specs refused besides the transport fields: JetStream's per-delivery sequences. (A
``header:sequence`` stays allowed: a producer's version counter, R15.)"""


def key_source(spec: str) -> KeySource:
    """A key source from its text form, as the command line and configuration files give it.

    ``message-id`` (the producer's message id), ``cloudevents`` (the pair (source, id)),
    ``header:NAME`` (a producer-set header or stream field), ``body:FIELD`` (a field of the
    decoded JSON body; ``body:a.b`` reads a nested field) and ``correlation-id`` (the
    message's correlation id; warns, see :class:`KeyWarning`), or several joined by ``,`` (the
    first that finds a key, see :class:`FirstOf`: next to ``cloudevents``, a key with a space
    from another source is refused). Transport ids (a delivery tag, a stream entry id, a sequence
    number, an offset) are refused with the reason: the broker assigns them per delivery or
    per send, so a redelivered or retried copy would look new (R4).
    """
    parts = [part.strip() for part in spec.split(",")]
    if len(parts) > 1:
        return FirstOf(*(key_source(part) for part in parts))
    text = parts[0]
    head, _, name = text.partition(":")
    kind = head.lower()
    if kind not in ("header", "body"):
        instead = "use message-id, cloudevents, header:NAME or body:FIELD"
        refusal = _transport_refusal(head, instead)
        if refusal is None and _normal(kind) in _SEQUENCE_SPECS:
            refusal = (
                f"{text!r} is assigned by the broker to each delivery, so a redelivered or "
                f"retried copy of a message would carry a new one and pass as a new message "
                f"(R4); {instead}"
            )
        if refusal is not None:
            raise ConfigurationError(refusal)
    if kind == "message-id" and not name:
        return MessageIdKey()
    if _normal(kind) == "messageid" and not name:
        # messageId is how AWS Lambda events (and AWS Lambda Powertools' event_key_jmespath)
        # name SQS's own id: say why that one is no key rather than "unknown key source".
        raise ConfigurationError(
            f"{text!r} is not a key source: message-id is the producer's message id (the "
            f"message-id attribute on SQS, a header on other brokers), which oncely's "
            f"producers set and send again unchanged on every retry. SQS's own MessageId (the "
            f"messageId of a Lambda event's record) is assigned by SQS to each send, so a "
            f"producer's retry gets a new one and would pass as a new message (R4); use "
            f"message-id, or a business key from the body (body:FIELD)"
        )
    if kind == "cloudevents" and not name:
        return CloudEventsKey()
    if kind in ("correlation-id", "correlation_id") and not name:
        return CorrelationIdKey()
    if kind == "header" and name:
        return HeaderKey(name)
    if kind == "body" and name:
        return BusinessKey(_FieldPath(tuple(name.split("."))))
    raise ConfigurationError(
        f"unknown key source {text!r}; use message-id, cloudevents, header:NAME or body:FIELD"
    )


@dataclass(frozen=True, slots=True)
class _FieldPath:
    path: tuple[str, ...]

    def __call__(self, body: object) -> object:
        # A field that is not there is the usual sign of a mistyped spec (body:orderId for
        # order_id): the refusal names the fields that are there, so the dead letter's
        # reason says what to write instead.
        value = body
        for at, name in enumerate(self.path):
            if not isinstance(value, Mapping):
                whose = f"field {'.'.join(self.path[:at])!r}" if at else "body"
                raise MissingKey(
                    f"the {whose} is {_a_kind(value)}, not a JSON object with the field "
                    f"{name if at else '.'.join(self.path)!r}"
                )
            if name not in value:
                where = "" if not at else f": {'.'.join(self.path[:at])!r}"
                raise MissingKey(
                    f"the body has no field {'.'.join(self.path)!r}{where}"
                    f"{'; it' if not at else ''} has {_some_names(value)}"
                )
            value = value[name]
        return value


_NAMES_SHOWN: Final = 10


def _some_names(mapping: Mapping[Any, Any]) -> str:
    """The first field names of ``mapping``, quoted, for a refusal: at most ten."""
    names = [repr(str(name)[:64]) for name in list(mapping)[:_NAMES_SHOWN]]
    if not names:
        return "no fields"
    more = len(mapping) - len(names)
    return ", ".join(names) + (f" and {more} more" if more else "")


def _a_kind(value: object) -> str:
    kinds = {
        list: "a list",
        str: "a string",
        bytes: "bytes",
        type(None): "null",
        bool: "true or false",
        int: "a number",
        float: "a number",
    }
    return kinds.get(type(value), f"a {type(value).__name__}")
