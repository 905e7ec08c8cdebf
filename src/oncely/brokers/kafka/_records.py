"""How a Kafka record becomes an :class:`~oncely.Envelope`, and the URL both clients share."""

from __future__ import annotations

import logging
import re
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any
from urllib.parse import unquote

from oncely._repeats import Repeats
from oncely._urls import UrlOptions, redact
from oncely.brokers._common import not_utf8
from oncely.errors import ConfigurationError
from oncely.keys import Envelope
from oncely.wire import Repeated, wire_text

LOGGER = logging.getLogger("oncely.broker.kafka")


_TIMINGS = re.compile(r"\(after \d+ms in state [A-Z_]+\)|\d+ms")


def _librdkafka_kind(record: logging.LogRecord) -> Hashable:
    """librdkafka formats its lines itself: one kind is the line without its timings."""
    return _TIMINGS.sub("", record.getMessage())


LIBRDKAFKA_LOGGER = logging.getLogger("oncely.broker.kafka.librdkafka")
"""librdkafka's own lines (the producer's client), each repeat once per 10 s at most."""
LIBRDKAFKA_LOGGER.addFilter(Repeats(window=10.0, kind=_librdkafka_kind))

MESSAGE_ID_HEADER = "message-id"
CONTENT_TYPE_HEADER = "content-type"
CORRELATION_HEADER = "correlation-id"
SCHEMES = ("kafka",)
SHARED_URL_OPTIONS = ("security_protocol", "sasl_mechanism", "client_id")
CONSUMER_URL_OPTIONS = (
    "session_timeout",
    "revoke_grace",
    "partitions",
    "max_buffered",
    "tombstones",
)
"""The URL options only the transport reads: the producer refuses them as the consumer's (a
topic the producer's first record creates does not get the transport's ``partitions``)."""
PRODUCER_URL_OPTIONS = ("idempotence", "linger")
"""The URL options only the producer reads: the transport refuses them as the producer's."""
_SECURITY = ("plaintext", "ssl", "sasl_plaintext", "sasl_ssl")
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://([^/?#]*)(.*)$", re.DOTALL)
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


@dataclass(frozen=True, slots=True)
class Cluster:
    """Where the brokers are and how to log in, read from ``kafka://[user:password@]host:port
    [,host:port...]``; the same for the consumer (aiokafka) and the producer (librdkafka)."""

    servers: str
    security_protocol: str = "PLAINTEXT"
    sasl_mechanism: str | None = None
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    client_id: str = "oncely"
    shown: str = ""

    @classmethod
    def from_url(cls, url: str) -> tuple[Cluster, UrlOptions]:
        """The cluster of ``url`` and the rest of its options (for the caller to read and
        then check with ``done``)."""
        match = _URL.match(url)
        if match is None or match.group(1).lower() not in SCHEMES:
            raise ConfigurationError(f"{redact(url)}: a Kafka URL starts with kafka://")
        userinfo, _, hosts = match.group(2).rpartition("@")
        servers = [_server(url, h.strip()) for h in hosts.split(",") if h.strip()]
        if not servers:
            raise ConfigurationError(f"{redact(url)}: name at least one broker (kafka://host:port)")
        # Parsed with one stand-in host (urlsplit refuses a list of them), named as given.
        options = UrlOptions(f"kafka://localhost{match.group(3)}", shown=url)
        user, has_password, secret = userinfo.partition(":")
        username = unquote(user) if user else None
        password = unquote(secret) if has_password else None
        default = "sasl_ssl" if username else "plaintext"
        protocol = options.choice("security_protocol", default, _SECURITY).upper()
        mechanism = options.optional_text("sasl_mechanism")
        if username and mechanism is None:
            mechanism = "PLAIN"
        if protocol.startswith("SASL") and not (username and password):
            raise ConfigurationError(
                f"{redact(url)}: security_protocol={protocol} needs a user and password in the "
                "URL (kafka://USER:PASSWORD@host:port)"
            )
        client_id = options.text("client_id", "oncely")
        return (
            cls(
                servers=",".join(servers),
                security_protocol=protocol,
                sasl_mechanism=mechanism,
                username=username,
                password=password,
                client_id=client_id,
                shown=redact(url.split("?", 1)[0]),
            ),
            options,
        )

    def aiokafka(self) -> dict[str, Any]:
        """Keyword arguments for aiokafka's clients."""
        config: dict[str, Any] = {
            "bootstrap_servers": self.servers,
            "client_id": self.client_id,
            "security_protocol": self.security_protocol,
        }
        if self.sasl_mechanism is not None:
            config.update(
                sasl_mechanism=self.sasl_mechanism,
                sasl_plain_username=self.username,
                sasl_plain_password=self.password,
            )
        if "SSL" in self.security_protocol:
            from aiokafka.helpers import create_ssl_context  # noqa: PLC0415 - TLS only

            config["ssl_context"] = create_ssl_context()
        return config

    def librdkafka(self) -> dict[str, Any]:
        """The configuration of a librdkafka (confluent-kafka) client."""
        config: dict[str, Any] = {
            "bootstrap.servers": self.servers,
            "client.id": self.client_id,
            "security.protocol": self.security_protocol.lower(),
        }
        if self.sasl_mechanism is not None:
            config.update(
                {
                    "sasl.mechanism": self.sasl_mechanism,
                    "sasl.username": self.username,
                    "sasl.password": self.password,
                }
            )
        return config


def _server(url: str, host: str) -> str:
    name, colon, port = host.rpartition(":") if "]" not in host.rsplit(":", 1)[-1] else ("", "", "")
    if not colon:
        return f"{host}:9092"
    if not name or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigurationError(f"{redact(url)}: {host!r} is not host:port")
    return host


def check_topic(what: str, name: str) -> str:
    """A topic name Kafka accepts: 1 to 249 of ``[a-zA-Z0-9._-]``, not ``.`` or ``..``."""
    if not name or len(name) > 249 or name in (".", "..") or not set(name) <= _NAME_CHARS:
        raise ConfigurationError(
            f"the {what} {name!r} is not a Kafka topic name (1 to 249 letters, digits, '.', "
            "'_' or '-')"
        )
    return name


def ms(value: timedelta) -> int:
    return int(value.total_seconds() * 1000)


def header_map(
    headers: Sequence[tuple[str, bytes | None]],
) -> tuple[dict[str, str], str | None]:
    """The record's headers as text (undecodable bytes kept as escapes, R2) and the refusal
    of a record whose message id header is given twice with two values (two messages must
    never be read as one key). Any other name given with two values reads as its first, a
    :class:`~oncely.wire.Repeated` that no key source takes as a key."""
    out: dict[str, str] = {}
    refusal = None
    repeated: dict[str, list[str]] = {}
    for name, raw in headers:
        text = "" if raw is None else wire_text(raw)
        if name in out:
            if out[name] != text and name.lower() in (MESSAGE_ID_HEADER, CORRELATION_HEADER):
                refusal = f"the record has two {name} headers with different values"
            values = repeated.setdefault(name, [out[name]])
            if text not in values:
                values.append(text)
            continue
        out[name] = text
    for name, values in repeated.items():
        if len(values) > 1:  # read as the first, as before; refused as a key (Repeated)
            out[name] = Repeated(tuple(values))
    return out, refusal


TOMBSTONE_CHOICES = ("dead_letter", "handle")
"""What a consumer does with a tombstone: dead-letter it (the default) or hand it out."""


@dataclass(frozen=True, slots=True)
class Tombstone:
    """The payload a handler gets for a Kafka tombstone, a record whose value is null, when
    its transport hands tombstones out (``Kafka(..., tombstones="handle")``, the URL option
    ``tombstones=handle``). On a compacted topic a tombstone means "delete what is kept for
    this record key": ``key`` is that record key, its bytes as the producer wrote them
    (``None`` for a record without one). A record with an empty value is not a tombstone: its
    body is ``b""`` (the default decoder refuses it as JSON), so ``isinstance(payload,
    Tombstone)`` tells the two apart. A tombstone is keyed like any record (its
    ``message-id`` header by default) and its fingerprint is its record key's."""

    key: bytes | None

    @property
    def text(self) -> str | None:
        """The record key as text (bytes that are not UTF-8 kept as escapes), or ``None``."""
        return None if self.key is None else wire_text(self.key)


TOMBSTONE_REFUSAL = (
    "the record has no value: a tombstone (on a compacted topic, the deletion of its record "
    "key), and this consumer takes none; to handle tombstones (delete what the key names), "
    "open the transport with tombstones='handle' (URL option tombstones=handle): the handler "
    "then gets an oncely.brokers.kafka.Tombstone holding the record key"
)


def envelope_of(
    record: Any, group: str, attempt: int, *, tombstones: bool = False
) -> tuple[Envelope, str | None]:
    """The envelope of an aiokafka ``ConsumerRecord`` and why it cannot be read, if it
    cannot. The partition and offset go to ``Envelope.transport`` only: a producer retry is a
    new record at a new offset, so they are never a key (R4). A tombstone (a null value) is
    refused, with a reason saying how to take tombstones; with ``tombstones``, its body is a
    :class:`Tombstone` (and ``transport["tombstone"]`` is true)."""
    headers, refusal = header_map(record.headers or ())
    message_id = headers.get(MESSAGE_ID_HEADER) or None
    correlation_id = headers.get(CORRELATION_HEADER) or None
    content_type = headers.get(CONTENT_TYPE_HEADER) or None
    key = record.key
    transport: dict[str, object] = {
        "topic": record.topic,
        "partition": record.partition,
        "offset": record.offset,
        "timestamp": record.timestamp,
        "group": group,
        "delivery_count": attempt,
        "redelivered": attempt > 1,
        "content_type": content_type,
    }
    if key is not None:
        transport["record_key"] = wire_text(key)
    if refusal is None:
        refusal = not_utf8(
            (
                (f"message id (header {MESSAGE_ID_HEADER})", message_id),
                (f"correlation id (header {CORRELATION_HEADER})", correlation_id),
                (f"content type (header {CONTENT_TYPE_HEADER})", content_type),
            )
        )
    body: object = record.value
    if body is None:
        transport["tombstone"] = True
        if tombstones:
            body = Tombstone(None if key is None else bytes(key))
        elif refusal is None:
            refusal = TOMBSTONE_REFUSAL
    return (
        Envelope(
            body=body if body is not None else b"",
            message_id=message_id,
            headers=headers,
            correlation_id=correlation_id,
            delivery_count=attempt,
            transport=transport,
        ),
        refusal,
    )


def record_headers(
    message_id: str,
    headers: Mapping[str, str] | None,
    content_type: str | None,
    correlation_id: str | None,
) -> list[tuple[str, str | bytes | None]]:
    """The headers a producer writes: the message id first, then the content type, the
    correlation id and the application's own."""
    out: list[tuple[str, str | bytes | None]] = [(MESSAGE_ID_HEADER, message_id.encode())]
    if content_type:
        out.append((CONTENT_TYPE_HEADER, content_type.encode()))
    if correlation_id:
        out.append((CORRELATION_HEADER, correlation_id.encode()))
    for name, value in (headers or {}).items():
        if name.lower() in (MESSAGE_ID_HEADER, CONTENT_TYPE_HEADER, CORRELATION_HEADER):
            raise ConfigurationError(
                f"the header {name!r} is the producer's own; pass it as an argument"
            )
        out.append((name, value.encode()))
    return out
