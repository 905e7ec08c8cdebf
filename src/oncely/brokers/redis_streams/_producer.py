"""The Redis Streams producer: one ``XADD`` per message, in the entry layout."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from datetime import timedelta

from redis.exceptions import RedisError

from oncely._urls import UrlOptions, redact
from oncely.brokers.redis_streams._layout import (
    CONSUMER_URL_OPTIONS,
    PRODUCER_URL_OPTIONS,
    SHARED_URL_OPTIONS,
    EntryLayout,
    Translated,
    check_name,
    open_client,
    plain_url,
    shared_options,
)
from oncely.errors import ConfigurationError

_PRODUCER_URL_OPTIONS = (*PRODUCER_URL_OPTIONS, *SHARED_URL_OPTIONS)


class RedisStreamsProducer:
    """Writes messages to the stream ``stream`` (``XADD``) in the entry layout of the module
    docstring. ``maxlen`` trims the stream to about that many entries on each write (never
    trim below what consumers may not have read yet)."""

    def __init__(
        self,
        url: str,
        stream: str,
        *,
        maxlen: int | None = None,
        timeout: timedelta = timedelta(seconds=10),
        connect_timeout: timedelta = timedelta(seconds=5),
        body_field: str = "body",
        message_id_field: str = "message_id",
    ) -> None:
        plain_url(url)
        self.stream = check_name("stream", stream)
        if maxlen is not None and maxlen < 1:
            raise ConfigurationError("maxlen must be at least 1 (or None)")
        self.maxlen = maxlen
        self._layout = EntryLayout(body_field, message_id_field)
        self._errors = Translated(f"redis-streams {redact(url)} stream {stream!r}").errors
        self._client = open_client(url, timeout, connect_timeout)

    @classmethod
    def from_url(cls, url: str, destination: str) -> RedisStreamsProducer:
        """The producer for ``redis://host:port/db?options`` writing to the stream
        ``destination``. Options: ``maxlen``, ``timeout`` and ``connect_timeout`` (seconds),
        ``body_field``, ``message_id_field``."""
        options = UrlOptions(url)
        maxlen = options.integer("maxlen", 0)
        shared = shared_options(options)
        options.done(_PRODUCER_URL_OPTIONS, theirs=CONSUMER_URL_OPTIONS)
        return cls(url, destination, maxlen=maxlen or None, **shared)

    async def publish(
        self,
        body: bytes,
        *,
        message_id: str,
        headers: Mapping[str, str] | None = None,
        content_type: str = "application/json",
        correlation_id: str | None = None,
    ) -> None:
        """``XADD`` one entry; returns once Redis has replied with its entry id. Retrying after
        :class:`~oncely.BrokerUnavailable` with the same ``message_id`` may write a second
        entry, which consumers answer as a duplicate (R2, R14)."""
        fields = self._layout.entry(
            body,
            message_id=message_id,
            headers=headers,
            content_type=content_type,
            correlation_id=correlation_id,
        )
        with self._errors("publish"):
            await self._client.xadd(
                self.stream,
                fields,  # type: ignore[arg-type]
                maxlen=self.maxlen,
                approximate=True,
            )

    async def close(self) -> None:
        with contextlib.suppress(RedisError, OSError):
            await self._client.aclose()
