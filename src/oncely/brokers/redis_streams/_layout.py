"""What the Redis Streams transport and producer share: the entry layout (which field holds
what), the names they accept, the client they open and how redis-py's errors become oncely's."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping, Sequence
from datetime import timedelta
from typing import Any, TypedDict

import redis.asyncio
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import (
    AuthenticationError,
    AuthorizationError,
    NoPermissionError,
    RedisError,
    ResponseError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from oncely._urls import UrlOptions
from oncely.brokers._common import not_utf8, require_message_id, server_url
from oncely.errors import BrokerError, BrokerUnavailable, ConfigurationError
from oncely.keys import Envelope, is_transport_field
from oncely.wire import wire_text

LOGGER = logging.getLogger("oncely.broker")

CONTENT_TYPE_FIELD = "content_type"
CORRELATION_ID_FIELD = "correlation_id"
_CONTENT_TYPE = CONTENT_TYPE_FIELD.encode()
_CORRELATION_ID = CORRELATION_ID_FIELD.encode()
_TRANSIENT_CODES = ("LOADING", "BUSY", "READONLY", "TRYAGAIN", "CLUSTERDOWN", "MASTERDOWN")
SHARED_URL_OPTIONS = ("timeout", "connect_timeout", "body_field", "message_id_field")
CONSUMER_URL_OPTIONS = (
    "consumer",
    "ack_wait",
    "dead_letter",
    "claim_every",
    "start",
    "delivery_limit",
    "prune_idle_consumers",
    "allow_eviction",
)
"""The URL options only the transport reads: the producer refuses them as the consumer's."""
PRODUCER_URL_OPTIONS = ("maxlen",)
"""The URL options only the producer reads: the transport refuses them as the producer's."""


def ms(value: timedelta) -> int:
    """``value`` in whole milliseconds, never below zero."""
    return max(0, int(value.total_seconds() * 1000))


def as_text(value: bytes) -> str:
    """A field name or value as text, losslessly (bytes that are not UTF-8 are kept as escape
    code points and refused wherever they would be a key: :mod:`oncely.wire`)."""
    return wire_text(value)


def check_name(what: str, value: str) -> str:
    if not isinstance(value, str) or not value or value.strip() != value:
        raise ConfigurationError(f"{what} must be a non-empty name without surrounding spaces")
    return value


def _check_field(what: str, value: str) -> str:
    check_name(what, value)
    if is_transport_field(value):
        raise ConfigurationError(
            f"{what} {value!r} names per-delivery transport data, which changes on redelivery (R4)"
        )
    return value


class EntryLayout:
    """The fields of a stream entry (see the package docstring): ``body``, ``message_id``
    (both renamable), ``content_type``, ``correlation_id``, and headers for the rest."""

    __slots__ = ("body", "message_id", "reserved")

    def __init__(self, body_field: str, message_id_field: str) -> None:
        self.body = _check_field("body_field", body_field).encode()
        self.message_id = _check_field("message_id_field", message_id_field).encode()
        if self.body == self.message_id:
            raise ConfigurationError("body_field and message_id_field must differ")
        self.reserved = frozenset({self.body, self.message_id, _CONTENT_TYPE, _CORRELATION_ID})

    def entry(
        self,
        body: bytes,
        *,
        message_id: str,
        headers: Mapping[str, str] | None,
        content_type: str,
        correlation_id: str | None,
    ) -> dict[bytes, bytes | str]:
        """The fields ``XADD`` writes for one message. A header named like a field of the
        layout is refused."""
        fields: dict[bytes, bytes | str] = {self.body: bytes(body)}
        fields[self.message_id] = require_message_id(message_id)
        if content_type:
            fields[_CONTENT_TYPE] = content_type
        if correlation_id is not None:
            fields[_CORRELATION_ID] = correlation_id
        for name, value in (headers or {}).items():
            field = name.encode()
            if field in self.reserved:
                raise ConfigurationError(
                    f"header {name!r} collides with a field of the entry layout; pass it as "
                    "an argument or rename it"
                )
            fields[field] = value
        return fields

    def envelope(
        self, fields: Sequence[tuple[bytes, bytes]], count: int, transport: dict[str, object]
    ) -> tuple[Envelope, str | None]:
        """The message an entry holds, and why it cannot be read (``None`` when it can): a
        message id or correlation id that is not UTF-8, or no body field. ``transport``
        (per-delivery data) gains its content type."""
        values = dict(fields)
        headers = {as_text(k): as_text(v) for k, v in fields if k not in self.reserved}
        message_id = values.get(self.message_id)
        correlation_id = values.get(_CORRELATION_ID)
        content_type = values.get(_CONTENT_TYPE)
        if content_type is not None:
            transport["content_type"] = as_text(content_type)
        envelope = Envelope(
            body=values.get(self.body, b""),
            message_id=as_text(message_id) if message_id else None,
            headers=headers,
            correlation_id=as_text(correlation_id) if correlation_id else None,
            delivery_count=count,
            transport=transport,
        )
        refusal = not_utf8(
            (
                (f"message id (field {self.message_id.decode()!r})", envelope.message_id),
                (f"correlation id (field {CORRELATION_ID_FIELD!r})", envelope.correlation_id),
            )
        )
        if refusal is None and len(values) < len(fields):
            refusal = self._ambiguous(fields)
        if refusal is None and self.body not in values:
            refusal = (
                f"the entry has no {self.body.decode()!r} field, which holds the message body "
                "(the producer wrote another layout; set body_field= to read it)"
            )
        return envelope, refusal

    def _ambiguous(self, fields: Sequence[tuple[bytes, bytes]]) -> str | None:
        """Why an entry that repeats a field oncely reads (the id, the body, the correlation
        id, the content type) with different values cannot be read: which one is the
        message's is anyone's guess, and taking the last would key (or run) it on one the
        producer may not have meant (``None``: no such field)."""
        read = (self.message_id, self.body, _CORRELATION_ID, _CONTENT_TYPE)
        seen: dict[bytes, bytes] = {}
        for name, value in fields:
            if name in read and seen.setdefault(name, value) != value:
                return (
                    f"the entry holds the field {as_text(name)!r} more than once, with "
                    "different values: which is the message's cannot be told"
                )
        return None


class SharedOptions(TypedDict):
    """The URL options the transport and the producer both read."""

    timeout: timedelta
    connect_timeout: timedelta
    body_field: str
    message_id_field: str


def shared_options(options: UrlOptions) -> SharedOptions:
    return SharedOptions(
        timeout=options.seconds("timeout", timedelta(seconds=10)),
        connect_timeout=options.seconds("connect_timeout", timedelta(seconds=5)),
        body_field=options.text("body_field", "body"),
        message_id_field=options.text("message_id_field", "message_id"),
    )


def plain_url(url: str) -> str:
    """``url`` without its query (the options are the transport's, not redis-py's)."""
    return server_url(url, ("redis", "rediss"), "Redis Streams")


def open_client(url: str, timeout: timedelta, connect_timeout: timedelta) -> redis.asyncio.Redis:
    # No retries inside redis-py: the consumer loop reconnects with its own backoff, and a
    # producer's caller retries with the same message id. A blocking pool: more calls at
    # once than it has connections wait (up to the timeout) for one, where redis-py's plain
    # pool refuses the 101st with "Too many connections".
    pool = redis.asyncio.BlockingConnectionPool.from_url(
        plain_url(url),
        max_connections=MAX_CONNECTIONS,
        timeout=timeout.total_seconds(),
        decode_responses=False,
        socket_timeout=timeout.total_seconds(),
        socket_connect_timeout=connect_timeout.total_seconds(),
        retry=Retry(NoBackoff(), 0),
    )
    return redis.asyncio.Redis.from_pool(pool)


MAX_CONNECTIONS = 100
"""Connections one producer or transport opens to Redis at most; calls beyond wait."""


_REFUSED = (AuthenticationError, AuthorizationError, NoPermissionError)
"""What Redis answers a client it will not serve: wrong credentials, a user without the
commands' permissions."""


class Translated:
    """Turns redis-py's exceptions into oncely's at the boundary."""

    def __init__(self, where: str) -> None:
        self.where = where

    @contextlib.contextmanager
    def errors(self, doing: str, on_missing: Any = None) -> Iterator[None]:
        try:
            yield
        except _REFUSED as exc:  # a ConnectionError to redis-py, but retrying cannot help
            raise BrokerError(
                f"{self.where}: Redis refused the credentials or permissions to {doing}: {exc}"
            ) from exc
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            raise BrokerUnavailable(f"{self.where}: could not {doing}: {exc}") from exc
        except ResponseError as exc:
            text = str(exc)
            if text.startswith(("NOGROUP", "UNBLOCKED")):
                # UNBLOCKED: Redis 7 ends a blocked XREADGROUP with it when the stream key is
                # deleted meanwhile (its group went with it): like NOGROUP, make them again.
                if on_missing is not None:
                    on_missing()
                gone = (
                    "the stream or its group is gone (a restart without persistence?)"
                    if text.startswith("NOGROUP")
                    else "the stream was deleted while this consumer waited on it"
                )
                raise BrokerUnavailable(
                    f"{self.where}: could not {doing}: {gone}; it is created again ({text})"
                ) from exc
            if text.startswith(_TRANSIENT_CODES):
                raise BrokerUnavailable(f"{self.where}: could not {doing}: {text}") from exc
            raise BrokerError(f"{self.where}: could not {doing}: {text}") from exc
        except RedisError as exc:
            raise BrokerError(f"{self.where}: could not {doing}: {exc}") from exc
