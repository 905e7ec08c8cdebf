"""The JetStream producer: publishes with ``Nats-Msg-Id`` and waits for the stream's ack."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Mapping
from datetime import timedelta
from typing import Self

import nats.js.errors
from nats.js import api
from nats.js.client import JetStreamContext

from oncely._urls import UrlOptions, redact
from oncely.brokers._common import positive, require_message_id
from oncely.brokers.nats._connection import Link
from oncely.brokers.nats._settings import (
    CONSUMER_ONLY_OPTIONS,
    CONTENT_TYPE_HEADER,
    CORRELATION_HEADER,
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_RECONNECT_WAIT,
    DEFAULT_TIMEOUT,
    MSG_ID_HEADER,
    ONCELY_ID_HEADER,
    PRODUCER_OPTIONS,
    UNAVAILABLE,
    check_subject,
    has_wildcard,
    seconds_option,
    unavailable,
)
from oncely.brokers.nats._topology import ensure_stream
from oncely.brokers.nats._transport import header_bytes
from oncely.errors import BrokerError, ConfigurationError


def window_id(message_id: str, body: bytes) -> str:
    """The ``Nats-Msg-Id`` oncely's producer sends: the message id and a hash of the body.
    A retry (same id, same body) has the same one, so the stream's duplicate window stores it
    once (R14, R23); the id reused for another body has another one, so the window cannot
    drop it silently and the consumer sees it as a ``key_conflict`` (R20 step 6)."""
    return f"{message_id}|sha256:{hashlib.sha256(body).hexdigest()[:32]}"


def _check_header_value(name: str, value: str) -> None:
    """Refuse a header value that NATS would not carry as it is: nats-py strips the white
    space around a value and turns CR and LF into spaces, so ``order-7 `` would reach the
    consumer as ``order-7``, and ``a\nb`` as ``a b``: two message ids merged into one key,
    and the second message acknowledged as a duplicate of the first when their bodies match."""
    if value != value.strip() or "\r" in value or "\n" in value:
        raise ConfigurationError(
            f"the {name} header {value!r} has white space around it or a line break, which "
            "NATS headers cannot carry (the client strips or replaces them, so the consumer "
            "would read another value); remove it"
        )


# A stream that cannot be declared: the server unreachable, or JetStream refusing.
_DECLARE_FAILURES: tuple[type[Exception], ...] = (*UNAVAILABLE, nats.js.errors.APIError)


class JetStreamProducer:
    """Publishes to ``destination`` (a subject) with the producer's message id in
    ``Oncely-Message-Id`` and in ``Nats-Msg-Id`` together with a hash of the body
    (:func:`window_id`), and returns once the stream acknowledged the message.

    The stream that captures the subject is used; when none does, one is created as
    :class:`JetStream` creates it (``stream``, ``duplicate_window``). Within the stream's
    duplicate window a retry with the same id and body is stored once (R14, R23); outside it
    the consumer's inbox answers it as ``duplicate``. The same id with another body is always
    stored, for the consumer to dead-letter as a ``key_conflict``. :meth:`send` returns
    JetStream's answer, whose ``duplicate`` says whether the window dropped the message.
    """

    def __init__(
        self,
        url: str,
        destination: str,
        *,
        stream: str | None = None,
        duplicate_window: timedelta | None = None,
        timeout: timedelta = DEFAULT_TIMEOUT,
        connect_timeout: timedelta = DEFAULT_CONNECT_TIMEOUT,
        reconnect_wait: timedelta = DEFAULT_RECONNECT_WAIT,
    ) -> None:
        self._link = Link(
            url,
            "producer",
            timeout=timeout,
            connect_timeout=connect_timeout,
            reconnect_wait=reconnect_wait,
        )
        self.destination = check_subject(destination, "destination")
        if has_wildcard(destination):
            raise ConfigurationError("a producer publishes to a subject without wildcards")
        if duplicate_window is not None:
            positive(duplicate_window, "duplicate_window")
        self._stream = stream
        self._duplicate_window = duplicate_window
        self._lock = asyncio.Lock()

    @classmethod
    def from_url(cls, url: str, destination: str) -> Self:
        options = UrlOptions(url)
        stream = options.optional_text("stream")
        window = options.optional_text("duplicate_window")
        timeout = options.seconds("timeout", DEFAULT_TIMEOUT)
        connect_timeout = options.seconds("connect_timeout", DEFAULT_CONNECT_TIMEOUT)
        reconnect_wait = options.seconds("reconnect_wait", DEFAULT_RECONNECT_WAIT)
        options.done(PRODUCER_OPTIONS, theirs=CONSUMER_ONLY_OPTIONS)
        return cls(
            url,
            destination,
            stream=stream,
            duplicate_window=seconds_option(url, "duplicate_window", window),
            timeout=timeout,
            connect_timeout=connect_timeout,
            reconnect_wait=reconnect_wait,
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({redact(self._link.server)!r}, {self.destination!r})"

    async def _ready(self) -> JetStreamContext:
        async with self._lock:
            link = self._link
            js = await link.jetstream()
            if not link.declared:
                try:
                    await ensure_stream(js, self.destination, self._stream, self._duplicate_window)
                except _DECLARE_FAILURES as exc:
                    raise unavailable("stream declaration", exc) from None
                link.declared = True
            return js

    async def send(
        self,
        body: bytes,
        *,
        message_id: str,
        headers: Mapping[str, str] | None = None,
        content_type: str = "application/json",
        correlation_id: str | None = None,
    ) -> api.PubAck:
        """:meth:`publish`, returning JetStream's acknowledgement (``seq``, ``duplicate``)."""
        fields = {str(k): str(v) for k, v in (headers or {}).items()}
        fields[ONCELY_ID_HEADER] = require_message_id(message_id)
        if correlation_id is not None:
            fields[CORRELATION_HEADER] = correlation_id
        for name, value in fields.items():
            _check_header_value(name, value)
        fields[MSG_ID_HEADER] = window_id(message_id, body)
        fields[CONTENT_TYPE_HEADER] = content_type
        js = await self._ready()
        self._check_size(body, fields)
        try:
            return await js.publish(
                self.destination, body, timeout=self._link.timeout.total_seconds(), headers=fields
            )
        except nats.js.errors.NoStreamResponseError as exc:
            self._link.declared = False  # JetStream is restarting, or the stream was deleted
            raise unavailable("publish", exc) from None
        except nats.js.errors.APIError as exc:
            raise BrokerError(f"JetStream refused the message: {exc}") from None
        except UNAVAILABLE as exc:
            raise unavailable("publish", exc) from None

    def _check_size(self, body: bytes, headers: Mapping[str, str]) -> None:
        """Refuse a message larger than the server's ``max_payload`` (its body and headers):
        the server would close the connection on it (nats-py checks the body alone), and a
        caller told the broker is unavailable would retry it for good."""
        client = self._link.client
        if client is None:
            return
        size = len(body) + header_bytes(headers)
        if size > client.max_payload:
            raise BrokerError(
                f"the message is {size} bytes with its headers, over the NATS server's "
                f"max_payload of {client.max_payload}; it was not sent (retrying cannot help)"
            )

    async def publish(
        self,
        body: bytes,
        *,
        message_id: str,
        headers: Mapping[str, str] | None = None,
        content_type: str = "application/json",
        correlation_id: str | None = None,
    ) -> None:
        """Publish ``body`` and return once the stream has stored it (or dropped it as a
        duplicate within its window). Raises :class:`~oncely.BrokerUnavailable`; retrying
        with the same ``message_id`` is then safe. A message larger than the server's
        ``max_payload`` (body and headers) raises :class:`~oncely.BrokerError` unsent."""
        await self.send(
            body,
            message_id=message_id,
            headers=headers,
            content_type=content_type,
            correlation_id=correlation_id,
        )

    async def close(self) -> None:
        await self._link.close()
