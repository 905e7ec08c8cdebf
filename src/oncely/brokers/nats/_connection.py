"""A NATS connection as the transport and the producer keep it: opened on first use, left to
nats-py to reconnect, and opened anew once closed."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Callable
from datetime import timedelta

import nats.aio.client
from nats.aio.client import Client
from nats.js.client import JetStreamContext

from oncely._core.said import said
from oncely._urls import redact
from oncely.brokers._common import positive, server_url
from oncely.brokers.nats._settings import LOGGER, SCHEMES, UNAVAILABLE
from oncely.errors import BrokerUnavailable
from oncely.wire import wire_text


class Headers(dict[str, str]):
    """A message's headers as nats-py hands them on, one value a name (the last line's),
    plus ``repeated``: each line of a name the message repeats, exact and in order (a dict
    keeps one of them, and a dead-letter copy must keep them all)."""

    repeated: tuple[tuple[bytes, bytes], ...] = ()


class LosslessClient(Client):
    """nats-py's client, reading message headers losslessly.

    nats-py decodes header values with ``errors="replace"`` and drops a header whose name is
    not ASCII, so ``Nats-Msg-Id: inv-\\xff`` and ``inv-\\xfe`` would arrive as one id. Here
    names and values are decoded by :func:`oncely.wire.wire_text` (lossless; text that
    is not UTF-8 is refused as a key). Status lines (the server's own, ASCII) are left to
    nats-py, as is everything when the optional ``fast_mail_parser`` is what nats-py uses.
    """

    async def _process_headers(self, headers: bytes) -> dict[str, str] | None:
        if not headers:
            return None
        raw = headers[_HEADER_LINE_SIZE:]
        if raw[:1] == b" " or getattr(nats.aio.client, "parse_email", None) is not None:
            return await super()._process_headers(headers)
        found = Headers()
        lines: list[tuple[bytes, bytes]] = []
        for line in raw[2:].split(b"\r\n"):
            name, colon, value = line.partition(b":")
            key = wire_text(name.strip())
            if colon and key and not any(ch.isspace() for ch in key):
                found[key] = wire_text(value.strip())
                lines.append((name.strip(), value.strip()))
        if len(lines) > len(found):
            names = Counter(name for name, _ in lines)
            found.repeated = tuple(line for line in lines if names[line[0]] > 1)
        return found or None


_HEADER_LINE_SIZE = len(b"NATS/1.0")


async def connect(
    server: str,
    connect_timeout: timedelta,
    reconnect_wait: timedelta,
    role: str,
    after_reconnect: Callable[[], None] | None = None,
) -> Client:
    """A client connected to ``server`` that reconnects by itself, or BrokerUnavailable."""

    async def on_error(exc: Exception) -> None:
        LOGGER.debug("oncely broker=nats %s connection: %s", role, exc)

    async def on_disconnected() -> None:
        if client.is_closed:
            return  # closed on purpose
        LOGGER.warning("oncely broker=nats %s disconnected from %s", role, redact(server))

    async def on_reconnected() -> None:
        if after_reconnect is not None:
            after_reconnect()
        LOGGER.info("oncely broker=nats %s reconnected to %s", role, redact(server))

    client = LosslessClient()
    try:
        # nats-py retries a first connection without end when reconnects are unlimited, so
        # the first connection gets a deadline of its own.
        await asyncio.wait_for(
            client.connect(
                servers=[server],
                name=f"oncely-{role}",
                connect_timeout=max(1, round(connect_timeout.total_seconds())),
                allow_reconnect=True,
                max_reconnect_attempts=-1,
                reconnect_time_wait=reconnect_wait.total_seconds(),  # type: ignore[arg-type]
                ping_interval=10,
                max_outstanding_pings=3,
                error_cb=on_error,
                disconnected_cb=on_disconnected,
                reconnected_cb=on_reconnected,
            ),
            connect_timeout.total_seconds(),
        )
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            await client.close()
        raise
    except UNAVAILABLE as exc:
        with contextlib.suppress(Exception):
            await client.close()
        # nats-py keeps trying a server that refuses connections until the deadline: its
        # TimeoutError, which says nothing, means no connection in that time.
        why = (
            f"no connection within {connect_timeout.total_seconds():g}s"
            if isinstance(exc, TimeoutError)
            else said(exc)
        )
        raise BrokerUnavailable(f"cannot connect to NATS at {redact(server)}: {why}") from None
    return client


class Link:
    """One client and its JetStream context, for a transport or a producer (``role``).

    ``declared`` says whether the streams (and consumer) the owner needs were declared on
    this connection; it turns false on a new connection and after nats-py reconnected, in
    case the server came back without them.
    """

    __slots__ = (
        "client",
        "connect_timeout",
        "declared",
        "js",
        "reconnect_wait",
        "role",
        "server",
        "timeout",
    )

    def __init__(
        self,
        url: str,
        role: str,
        *,
        timeout: timedelta,
        connect_timeout: timedelta,
        reconnect_wait: timedelta,
    ) -> None:
        self.server = server_url(url, SCHEMES, "NATS")
        self.role = role
        self.timeout = positive(timeout, "timeout")
        self.connect_timeout = positive(connect_timeout, "connect_timeout")
        self.reconnect_wait = reconnect_wait
        self.client: Client | None = None
        self.js: JetStreamContext | None = None
        self.declared = False

    @property
    def connected(self) -> bool:
        """Whether the connection is up now (nats-py reconnects in the background)."""
        return self.client is not None and self.client.is_connected

    async def jetstream(self) -> JetStreamContext:
        """The JetStream context of a live connection, connecting first when there is none
        (or it was closed). Raises :class:`~oncely.BrokerUnavailable` when NATS cannot be
        reached or nats-py is still reconnecting."""
        client = self.client
        if client is None or client.is_closed:
            self.client = self.js = None
            self.declared = False
            client = await connect(
                self.server, self.connect_timeout, self.reconnect_wait, self.role, self._forget
            )
            self.client = client
            self.js = client.jetstream(timeout=self.timeout.total_seconds())
        if not client.is_connected:
            raise BrokerUnavailable(f"NATS at {redact(self.server)} is reconnecting")
        assert self.js is not None
        return self.js

    def _forget(self) -> None:
        # The server may have come back without the stream or the consumer.
        self.declared = False

    async def close(self) -> None:
        client, self.client, self.js = self.client, None, None
        self.declared = False
        if client is not None:
            with contextlib.suppress(Exception):
                await client.close()
