"""Dedup keys: where they come from and what makes one acceptable (R2-R5).

A key names the *logical* message on every redelivery (R2): the producer's message id, the
CloudEvents pair ``(source, id)`` (R3), or a business idempotency key. It is never a transport id
the broker regenerates per delivery, nor anything derived from the attempt or the receive time
(R4). Records are scoped by consumer (R5), so the consumer name is validated here too.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from oncely._core.policy import Limits
from oncely.errors import ConfigurationError, InvalidIdentifier, InvalidKey, KeyTooLong, MissingKey

__all__ = [
    "TRANSPORT_FIELDS",
    "BusinessKey",
    "CloudEventsKey",
    "Envelope",
    "FirstOf",
    "HeaderKey",
    "KeySource",
    "MessageIdKey",
    "key_source",
    "validate_consumer",
    "validate_key",
]

_MAX_CONSUMER_CHARS = 200

TRANSPORT_FIELDS = frozenset(
    {
        "delivery_tag",
        "delivery-tag",
        "deliverytag",
        "redelivered",
        "x-delivery-count",
        "delivery_count",
        "lock_token",
        "locktoken",
        "lock-token",
        "sequence_number",
        "sequencenumber",
        "stream_id",
        "entry_id",
        "message_offset",
        "offset",
        "nats-sequence",
        "num_delivered",
        "receipt_handle",
        "receipthandle",
        "received_at",
        "timestamp",
    }
)
"""Header names that carry per-delivery transport data. Refused as key sources (R4)."""


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


def validate_key(key: object, limits: Limits) -> str:
    """Check a dedup key and return it (hashed if too long and ``limits.hash_long_keys``).

    Raises :class:`MissingKey` for ``None`` or an empty string, :class:`InvalidKey` for a
    non-string or a NUL character, :class:`KeyTooLong` over ``limits.max_key_bytes``.
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
            raise InvalidKey(
                "a dedup key must be valid Unicode text; this one holds a lone surrogate"
            ) from None
    if size > limits.max_key_bytes:
        if limits.hash_long_keys:
            return "sha256:" + hashlib.sha256(key.encode("utf-8")).hexdigest()
        raise KeyTooLong(
            f"the dedup key is {size} bytes, over the limit of {limits.max_key_bytes}; use a "
            "shorter key or Limits(hash_long_keys=True)"
        )
    if "\x00" in key:
        raise InvalidKey("a dedup key must not contain NUL characters")
    return key


@dataclass(frozen=True, slots=True, kw_only=True)
class Envelope:
    """A broker message as adapters hand it to the inbox.

    ``message_id`` is the *producer-assigned* id (AMQP ``message_id``, ``Nats-Msg-Id``), never a
    broker-assigned one. ``transport`` holds per-delivery data (delivery tag, stream entry id,
    sequence, redelivered flag) for logs only: no key source reads it (R4).
    """

    body: object
    message_id: str | None = None
    headers: Mapping[str, object] = field(default_factory=dict)
    correlation_id: str | None = None
    delivery_count: int | None = None
    transport: Mapping[str, object] = field(default_factory=dict)


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


def _text(value: object) -> object:
    # Binary-mode headers often arrive as bytes (Kafka always sends them so).
    if isinstance(value, bytes | bytearray):
        return bytes(value).decode("utf-8", "replace")
    return value


@dataclass(frozen=True, slots=True)
class MessageIdKey:
    """The producer-assigned message id (R2, R20 step 1)."""

    def __call__(self, envelope: Envelope) -> str:
        if not envelope.message_id:
            raise MissingKey(
                "the message has no producer-assigned message id; set one in the producer "
                "(oncely's producer helpers do) or choose another key source"
            )
        return envelope.message_id


@dataclass(frozen=True, slots=True)
class CloudEventsKey:
    """The CloudEvents pair ``(source, id)`` (R3), from binary-mode headers (``ce-source``,
    ``ce_source``, ``cloudEvents:source``) or a structured-mode body (a mapping with
    ``specversion``). The key is ``"<source> <id>"``: a URI reference has no spaces, so the
    pair is recovered unambiguously."""

    def __call__(self, envelope: Envelope) -> str:
        source = _text(_header(envelope.headers, "ce-source", "ce_source", "cloudEvents:source"))
        event_id = _text(_header(envelope.headers, "ce-id", "ce_id", "cloudEvents:id"))
        body = envelope.body
        structured = isinstance(body, Mapping) and "specversion" in body
        if (source is None or event_id is None) and isinstance(body, Mapping) and structured:
            source, event_id = body.get("source"), body.get("id")
        if not isinstance(source, str) or not source or not isinstance(event_id, str):
            raise MissingKey("the message carries no CloudEvents source and id")
        if not event_id:
            raise MissingKey("the CloudEvents id is empty")
        if any(ch.isspace() for ch in source):
            raise InvalidKey("a CloudEvents source is a URI reference and has no white space")
        return f"{source} {event_id}"


@dataclass(frozen=True, slots=True)
class HeaderKey:
    """A producer-set header holding a business idempotency key."""

    name: str

    def __post_init__(self) -> None:
        if self.name.lower() in TRANSPORT_FIELDS:
            raise ConfigurationError(
                f"{self.name!r} is set by the broker per delivery and changes on redelivery, so "
                "as a dedup key it lets every redelivered copy through (R4); use the "
                "producer's message id, the CloudEvents (source, id) or a business key"
            )

    def __call__(self, envelope: Envelope) -> str:
        value = _text(_header(envelope.headers, self.name))
        if value is None or value == "":
            raise MissingKey(f"the message has no {self.name!r} header")
        return str(value)


@dataclass(frozen=True, slots=True)
class BusinessKey:
    """A key computed from the decoded body, e.g. ``BusinessKey(lambda o: o["order_id"])``."""

    read: Callable[[object], object]

    def __call__(self, envelope: Envelope) -> str:
        try:
            value = self.read(envelope.body)
        except (KeyError, IndexError, TypeError, AttributeError) as exc:
            raise MissingKey(f"the business key is missing from the body ({exc!r})") from exc
        if value is None or value == "":
            raise MissingKey("the business key is empty")
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            raise InvalidKey(
                f"a business key must be a string or an integer, got {type(value).__name__}"
            )
        return str(value)


@dataclass(frozen=True, slots=True)
class FirstOf:
    """The first source that finds a key, e.g. ``FirstOf(CloudEventsKey(), MessageIdKey())``."""

    sources: tuple[KeySource, ...]

    def __init__(self, *sources: KeySource) -> None:
        if not sources:
            raise ConfigurationError("FirstOf needs at least one key source")
        object.__setattr__(self, "sources", sources)

    def __call__(self, envelope: Envelope) -> str:
        reasons: list[str] = []
        for source in self.sources:
            try:
                return source(envelope)
            except MissingKey as exc:
                reasons.append(str(exc))
        raise MissingKey("no key source found a key: " + "; ".join(reasons))


_TRANSPORT_SPECS = frozenset(
    {
        "delivery-tag",
        "delivery_tag",
        "entry-id",
        "entry_id",
        "stream-id",
        "stream_id",
        "sequence",
        "stream-sequence",
        "consumer-sequence",
        "offset",
        "receipt-handle",
        "lock-token",
    }
)


def key_source(spec: str) -> KeySource:
    """A key source from its text form, as the command line and configuration files give it.

    ``message-id`` (the producer's message id), ``cloudevents`` (the pair (source, id)),
    ``header:NAME`` (a producer-set header or stream field) and ``body:FIELD`` (a field of the
    decoded JSON body; ``body:a.b`` reads a nested field), or several joined by ``,`` (the
    first that finds a key). Transport ids (a delivery tag, a stream entry id, a sequence
    number) are refused with the reason: the broker assigns them per delivery, so a
    redelivered copy would look new (R4).
    """
    parts = [part.strip() for part in spec.split(",")]
    if len(parts) > 1:
        return FirstOf(*(key_source(part) for part in parts))
    text = parts[0]
    kind, _, name = text.partition(":")
    kind = kind.lower()
    if kind in _TRANSPORT_SPECS or text.lower() in TRANSPORT_FIELDS:
        raise ConfigurationError(
            f"{text!r} is assigned by the broker to each delivery, so a redelivered or "
            "retried copy of a message would carry a new one and pass as a new message (R4); "
            "use message-id, cloudevents, header:NAME or body:FIELD"
        )
    if kind == "message-id" and not name:
        return MessageIdKey()
    if kind == "cloudevents" and not name:
        return CloudEventsKey()
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
        value = body
        for name in self.path:
            if not isinstance(value, Mapping):
                raise KeyError(".".join(self.path))
            value = value[name]
        return value
