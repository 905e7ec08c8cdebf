"""CloudEvents: the dedup key ``(source, id)`` (R3) and the event data, in every content mode.

*Binary mode* puts the attributes in protocol headers, named by each binding:

* HTTP and NATS: ``ce-`` (``ce-id``, ``ce-source``);
* Kafka: ``ce_``;
* AMQP: ``cloudEvents_`` or ``cloudEvents:`` (the binding allows both separators and asks
  consumers to understand both; ``_`` is the one JMS clients can use);
* MQTT 5: user properties named exactly as the attributes (``id``, ``source``), no prefix.

Prefixed names are matched case-insensitively and may mix within one message (a bridge may add
its own spelling of the same attributes); two spellings of the id or the source that disagree
are refused, as nothing says which one is the event's. Unprefixed names are common in messages
that are not events (an ``id`` or ``source`` header), so they count only when all four required
attributes (``specversion``, ``id``, ``source``, ``type``) are present in lower case, as the MQTT
binding writes them, and no prefixed attribute is.

*Structured mode* puts the whole event in the body, content type
``application/cloudevents+json``: a JSON object with ``specversion``. The body is usually
decoded before the key source runs (:func:`oncely.brokers.decode_body` parses every ``+json``
type); one that still arrives as bytes or text is parsed here under the same rule (a JSON
content type, or none), so the key never depends on whether a decoder ran first. A structured
content type makes the body the event even when ``ce-`` headers travel beside it (the bindings
allow copies there); without one, complete binary headers win, then a body with
``specversion``.

Header values are used as they arrive (bytes decoded losslessly as UTF-8, see
:mod:`oncely.wire`); HTTP/NATS percent-encoding is not undone, so the key of a message is
the one earlier versions computed for it.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, NoReturn, TypeAlias

from oncely.errors import InvalidKey, MissingKey
from oncely.wire import Repeated, escaped, undecodable_reason, wire_text

if TYPE_CHECKING:
    from oncely._core.keys import Envelope

__all__ = [
    "BINARY_PREFIXES",
    "REQUIRED_ATTRIBUTES",
    "attribute",
    "event_data",
    "event_key",
    "header_text",
    "structured_event",
]

BINARY_PREFIXES = ("ce-", "ce_", "cloudEvents_", "cloudEvents:")
"""The binary-mode header prefixes of the protocol bindings (matched case-insensitively)."""

REQUIRED_ATTRIBUTES = ("specversion", "id", "source", "type")
"""The attributes every event has; all of them mark unprefixed (MQTT) headers as an event."""

_STRUCTURED = "application/cloudevents"
_BATCH = "application/cloudevents-batch"
_KEY_ATTRIBUTES = frozenset({"id", "source"})
_REQUIRED = frozenset(REQUIRED_ATTRIBUTES)
_CT = "content-type"

_C = ("c", "C")
_BYTES = (bytes, bytearray, memoryview)

# attribute -> (the header it was found in, or "" for a structured body; its value)
_Found: TypeAlias = dict[str, tuple[str, object]]


def _where(header: str) -> str:
    return f"header {header!r}" if header else "structured body"


def header_text(value: object) -> object:
    """A header value as text when it arrives as bytes (Kafka always sends them so), decoded
    with :func:`~oncely.wire.wire_text`: lossless, never replaced."""
    if isinstance(value, _BYTES):  # a tuple: faster than a union on the per-message path
        return wire_text(value)
    return value


_EXACT = ("ce-", "ce_")
_EXACT_AMQP = ("cloudEvents_", "cloudEvents:")
_ANY_CASE = ("cloudevents_", "cloudevents:")


def _attribute_name(header: str) -> str | None:
    # "ce-id" / "ce_id" / "cloudEvents_id" / "cloudEvents:id", in any case -> "id" (or "ID":
    # the caller lower-cases a name it does not know). The usual spellings skip lower().
    if header.startswith(_EXACT):
        return header[3:] or None
    if header[:1] not in _C:
        return None
    if header.startswith(_EXACT_AMQP):
        return header[12:] or None
    low = header.lower()
    if low.startswith(_EXACT):
        return low[3:] or None
    if low.startswith(_ANY_CASE):
        return low[12:] or None
    return None


def _binary(
    headers: Mapping[str, object], *, strict: bool, wanted: frozenset[str] = _KEY_ATTRIBUTES
) -> _Found:
    found: _Found = {}
    prefixed = False
    for header, raw in headers.items():
        name = _attribute_name(header)
        if name is None:
            continue
        prefixed = True
        if name not in wanted:
            name = name.lower()
            if name not in wanted:
                continue
        value = header_text(raw)
        if strict and isinstance(value, Repeated):
            raise InvalidKey(value.refusal(header))
        seen = found.get(name)
        if seen is None:
            found[name] = (header, value)
        elif strict and seen[1] != value:
            _conflict(name, seen, header, value)
    if not prefixed and "specversion" in headers and all(n in headers for n in _REQUIRED):
        for name in wanted & _REQUIRED:
            found[name] = (name, header_text(headers[name]))
    return found


_STANDARD = tuple((name, tuple(p + name for p in BINARY_PREFIXES)) for name in ("id", "source"))
_SPELLINGS = frozenset(header.lower() for _, spellings in _STANDARD for header in spellings)
_SPELLED = _SPELLINGS.__contains__


def _standard(headers: Mapping[str, object]) -> _Found | None:
    # The per-message fast path: the id and source under the bindings' own spellings (eight
    # lookups, no scan). Two spellings that disagree are refused here too; None sends the
    # caller to the full, case-insensitive scan, as does another case of a name ("CE-ID"
    # beside "ce-id"), which the full scan compares: one count of the lower-cased names
    # (in C, no Python per header) finds it.
    found: _Found = {}
    spelled = 0
    for name, spellings in _STANDARD:
        for header in spellings:
            raw = headers.get(header)
            if raw is None:
                continue
            spelled += 1
            value = header_text(raw)
            if isinstance(value, Repeated):
                raise InvalidKey(value.refusal(header))
            seen = found.get(name)
            if seen is None:
                found[name] = (header, value)
            elif seen[1] != value:
                _conflict(name, seen, header, value)
    if len(found) != 2:
        return None
    if sum(map(_SPELLED, map(str.lower, headers))) != spelled:
        return None
    return found


def _conflict(name: str, seen: tuple[str, object], header: str, value: object) -> NoReturn:
    raise InvalidKey(
        f"the message carries two different CloudEvents {name}s (header {seen[0]!r} is "
        f"{seen[1]!r}, header {header!r} is {value!r}) and nothing says which is the event's; "
        "have the producer send one spelling (R3)"
    )


def attribute(headers: Mapping[str, object], name: str) -> object | None:
    """The binary-mode attribute ``name`` (``"id"``, ``"type"``...) under any binding's
    prefix, or ``None``; bytes values are decoded losslessly."""
    name = name.lower()
    entry = _binary(headers, strict=False, wanted=frozenset({name})).get(name)
    return None if entry is None else entry[1]


def _media_type(envelope: Envelope) -> str:
    value = envelope.transport.get("content_type")
    if value is None:
        headers = envelope.headers
        value = headers.get("content-type")
        if value is None:
            value = next(
                (v for k, v in headers.items() if isinstance(k, str) and k.lower() == _CT), None
            )
    value = header_text(value)
    if not isinstance(value, str):
        return ""
    return value.split(";", 1)[0].strip().lower()


def _structured_type(media: str) -> bool:
    return media.startswith(_STRUCTURED) and media.endswith("+json") and not _batch(media)


def _batch(media: str) -> bool:
    return media.startswith(_BATCH)


def _json_type(media: str) -> bool:
    # The rule decode_body reads bodies by: no content type, application/json or any +json.
    return not media or media == "application/json" or media.endswith("+json")


def structured_event(envelope: Envelope) -> Mapping[str, object] | None:
    """The event a structured-mode message carries in its body (a mapping with
    ``specversion``), parsing a body still in bytes or text; ``None`` if there is none.

    Raises :class:`~oncely.errors.InvalidKey` when the content type says structured mode and
    the body is not JSON."""
    return _structured(envelope, _media_type(envelope))


def _structured(envelope: Envelope, media: str) -> Mapping[str, object] | None:
    body = envelope.body
    if isinstance(body, Mapping):
        return body if "specversion" in body else None
    if not isinstance(body, bytes | bytearray | memoryview | str) or not _json_type(media):
        return None
    text = bytes(body) if isinstance(body, memoryview) else body
    structured = _structured_type(media)
    if not structured:
        # No event in there: spare the parse (the key source runs per message).
        if isinstance(text, str):
            if "specversion" not in text:
                return None
        elif b"specversion" not in text:
            return None
    try:
        event = json.loads(text)
    except ValueError as exc:
        if structured:
            raise InvalidKey(
                f"the body is {media} but not JSON ({exc}); a structured-mode CloudEvent is "
                "a JSON object"
            ) from None
        return None
    if isinstance(event, Mapping) and "specversion" in event:
        return event
    return None


def _from_event(event: Mapping[str, object]) -> _Found:
    version = event.get("specversion")
    if not isinstance(version, str) or not version:
        raise InvalidKey(
            f"the structured-mode event's specversion must be a non-empty string, got {version!r}"
        )
    return {name: ("", event[name]) for name in ("id", "source") if name in event}


def _text_attribute(found: _Found, name: str) -> str:
    header, value = found[name]
    field = f"CloudEvents {name} ({_where(header)})"
    if not isinstance(value, str):
        raise MissingKey(f"the {field} is not a string but {type(value).__name__}")
    if not value:
        raise MissingKey(f"the {field} is empty")
    if not value.isascii() and escaped(value):
        raise InvalidKey(undecodable_reason(field, value))
    return value


def _key(found: _Found) -> str:
    event_id = _text_attribute(found, "id")
    source = _text_attribute(found, "source")
    if " " in source or not source.isprintable():
        raise InvalidKey(
            f"a CloudEvents source is a URI reference and has no white space or control "
            f"characters; got {source!r} ({_where(found['source'][0])})"
        )
    # A source has no white space, so "<source> <id>" splits back into the pair at its first
    # space: two different pairs never share a key.
    return f"{source} {event_id}"


def event_key(envelope: Envelope) -> str:
    """The dedup key ``"<source> <id>"`` of a CloudEvent in either mode (R3).

    Raises :class:`~oncely.errors.MissingKey` naming what is missing (no event, no id, no
    source, an empty one, a batch) and :class:`~oncely.errors.InvalidKey` for attributes that
    are present but wrong (white space in the source, bytes that are not UTF-8, two spellings
    that disagree, a structured body that is not JSON).
    """
    media = _media_type(envelope)
    if _batch(media):
        raise MissingKey(
            f"the message is a CloudEvents batch ({media}): each of its events has its own "
            "(source, id), so the message has no single CloudEvents key; send one event per "
            "message, or key the batch as a whole by its message id"
        )
    if _structured_type(media):
        event = _structured(envelope, media)
        if event is None:
            raise MissingKey(
                f"the content type is {media} but the body is not a structured-mode event "
                "(a JSON object with specversion)"
            )
        return _key_of(_from_event(event), "the structured-mode event has no")
    found = _standard(envelope.headers) or _binary(envelope.headers, strict=True)
    if "id" in found and "source" in found:
        return _key(found)
    event = _structured(envelope, media)
    if event is not None:
        return _key_of(_from_event(event), "the structured-mode event has no")
    if not found.keys() & _KEY_ATTRIBUTES:
        raise MissingKey(
            "the message carries no CloudEvents source and id: no ce-, ce_, cloudEvents_ or "
            "cloudEvents: headers, and the body is not a structured-mode event (a JSON "
            "object with specversion)"
        )
    return _key_of(found, "the message has no CloudEvents")


def _key_of(found: _Found, lacks: str) -> str:
    for name, other in (("id", "source"), ("source", "id")):
        if name not in found:
            if other in found:
                raise MissingKey(f"{lacks} {name}, only its {other} ({_where(found[other][0])})")
            raise MissingKey(f"{lacks} id and no source")
    return _key(found)


def event_data(envelope: Envelope) -> object:
    """The event's ``data``, for a handler that wants the payload rather than the envelope.

    Binary mode: the (decoded) body as it is. Structured mode: the event's ``data``, or its
    ``data_base64`` decoded to bytes; ``None`` when it has neither. A message that is no
    CloudEvent is binary mode by the bindings' rule: its body as it is. The mode is decided
    as :func:`event_key` decides it, so the data is that of the keyed event.

    Raises :class:`ValueError` for a batch and for a malformed structured event (``data``
    and ``data_base64`` both present, ``data_base64`` that is not base64 text).
    """
    media = _media_type(envelope)
    if _batch(media):
        raise ValueError(
            f"the message is a CloudEvents batch ({media}): it holds the data of several "
            "events, not one"
        )
    if _structured_type(media):
        event = _structured(envelope, media)
    else:
        found = _binary(envelope.headers, strict=False)
        event = None if "id" in found and "source" in found else _structured(envelope, media)
    if event is None:
        return envelope.body
    if "data" in event:
        if "data_base64" in event:
            raise ValueError("a CloudEvent carries data or data_base64, not both")
        return event["data"]
    encoded = event.get("data_base64")
    if encoded is None:
        return None
    if not isinstance(encoded, str):
        raise ValueError(f"the event's data_base64 is {type(encoded).__name__}, not base64 text")
    try:
        return base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"the event's data_base64 is not base64 ({exc})") from None
