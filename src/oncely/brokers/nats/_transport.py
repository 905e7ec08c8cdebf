"""The JetStream transport: fetches from the durable pull consumer of a group and settles
what it fetched."""

from __future__ import annotations

import asyncio
import base64
import contextlib
from collections import deque
from collections.abc import Coroutine, Mapping
from datetime import timedelta
from typing import Self

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js.client import JetStreamContext

from oncely._urls import UrlOptions, redact
from oncely.brokers._shape import REASON_HEADER, BrokerLimits, DeadLetter, Delivery
from oncely.brokers.nats._connection import Link
from oncely.brokers.nats._delivery import JetStreamDelivery
from oncely.brokers.nats._settings import (
    DEFAULT_ACK_WAIT,
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_MAX_DELIVER,
    DEFAULT_RECONNECT_WAIT,
    DEFAULT_TIMEOUT,
    LOGGER,
    MESSAGE_ID_COPY_HEADER,
    MSG_ID_HEADER,
    ORIGINAL_HEADER_PREFIX,
    RAW_HEADERS_HEADER,
    TRANSPORT_OPTIONS,
    UNAVAILABLE,
    int_option,
    seconds_option,
    unavailable,
)
from oncely.brokers.nats._topology import Topology
from oncely.errors import BrokerError, BrokerUnavailable
from oncely.wire import escaped, raw_bytes, wire_text

_CHECK_EVERY = timedelta(seconds=5)
"""How often, at most, an idle transport checks that its durable consumer still exists."""
_CHECK_FAILURES: tuple[type[Exception], ...] = (*UNAVAILABLE, nats.js.errors.APIError)


class JetStream:
    """Reads ``source`` (a subject) through the durable pull consumer ``group`` (see the
    module docstring for what is declared and how outcomes are carried out).

    ``ack_wait`` is how long JetStream waits for a settlement before redelivering (running
    handlers extend it every third of it); ``max_deliver`` is the consumer's own delivery
    limit (keep it above ``ConsumerSettings.max_deliveries``, R13); ``max_ack_pending`` caps
    unacknowledged messages across the whole group (server default when ``None``; each
    process also never holds more than it fetched, at most its ``prefetch``).
    ``duplicate_window`` applies to a stream created here. ``timeout`` bounds each
    settlement, declaration and dead-letter publish.
    """

    def __init__(
        self,
        url: str,
        source: str,
        *,
        group: str,
        dead_letter: str | None = None,
        ack_wait: timedelta = DEFAULT_ACK_WAIT,
        stream: str | None = None,
        dead_letter_stream: str | None = None,
        max_deliver: int = DEFAULT_MAX_DELIVER,
        max_ack_pending: int | None = None,
        duplicate_window: timedelta | None = None,
        timeout: timedelta = DEFAULT_TIMEOUT,
        connect_timeout: timedelta = DEFAULT_CONNECT_TIMEOUT,
        reconnect_wait: timedelta = DEFAULT_RECONNECT_WAIT,
    ) -> None:
        self._link = Link(
            url,
            "consumer",
            timeout=timeout,
            connect_timeout=connect_timeout,
            reconnect_wait=reconnect_wait,
        )
        self._topology = topology = Topology(
            source,
            group=group,
            dead_letter=dead_letter,
            ack_wait=ack_wait,
            stream=stream,
            dead_letter_stream=dead_letter_stream,
            max_deliver=max_deliver,
            max_ack_pending=max_ack_pending,
            duplicate_window=duplicate_window,
        )
        self.source = topology.source
        self.group = topology.group
        self.inbox_consumer = topology.group
        """What this transport's own dead letters record in ``x-oncely-consumer``."""
        self.dead_letter = topology.dead_letter
        self.ack_wait = topology.ack_wait
        self.stream: str | None = None
        """The main stream's name, known after :meth:`open`."""
        self.dead_letter_stream: str | None = None
        """The dead-letter stream's name, known after :meth:`open`."""
        self._sub: JetStreamContext.PullSubscription | None = None
        self._sub_js: JetStreamContext | None = None
        self._stopped = False
        self._prefetch = 1
        self._held: deque[Msg] = deque()
        self._kept: set[asyncio.Task[None]] = set()
        """Dead-letter copies tried again of messages on their last delivery."""
        self._next_check = 0.0

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
        """The transport for a ``nats://`` (or ``tls://``) URL; see the module docstring for
        the query options. ``ack_wait`` given here wins over the URL's."""
        options = UrlOptions(url)
        url_ack_wait = options.seconds("ack_wait", DEFAULT_ACK_WAIT)
        stream = options.optional_text("stream")
        dead_letter_stream = options.optional_text("dead_letter_stream")
        max_deliver = options.integer("max_deliver", DEFAULT_MAX_DELIVER)
        pending = options.optional_text("max_ack_pending")
        window = options.optional_text("duplicate_window")
        timeout = options.seconds("timeout", DEFAULT_TIMEOUT)
        connect_timeout = options.seconds("connect_timeout", DEFAULT_CONNECT_TIMEOUT)
        reconnect_wait = options.seconds("reconnect_wait", DEFAULT_RECONNECT_WAIT)
        options.done(TRANSPORT_OPTIONS)
        return cls(
            url,
            source,
            group=group,
            dead_letter=dead_letter,
            ack_wait=ack_wait if ack_wait is not None else url_ack_wait,
            stream=stream,
            dead_letter_stream=dead_letter_stream,
            max_deliver=max_deliver,
            max_ack_pending=int_option(url, "max_ack_pending", pending),
            duplicate_window=seconds_option(url, "duplicate_window", window),
            timeout=timeout,
            connect_timeout=connect_timeout,
            reconnect_wait=reconnect_wait,
        )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({redact(self._link.server)!r}, {self.source!r}, "
            f"group={self.group!r})"
        )

    def set_inbox_consumer(self, consumer: str) -> None:
        """The inbox consumer name that the dead letters this transport writes by itself
        (on the broker's last delivery) record in ``x-oncely-consumer``, as every other
        dead letter does; :class:`~oncely.brokers.BrokerConsumer` gives it. Until then, the
        group's name."""
        self.inbox_consumer = consumer

    @property
    def name(self) -> str:
        return "nats"

    @property
    def extend_every(self) -> timedelta | None:
        return self.ack_wait / 3

    @property
    def connected(self) -> bool:
        """Whether the connection is up now (nats-py reconnects in the background)."""
        return self._link.connected

    @property
    def ack_floor(self) -> int | None:
        """The stream sequence up to which the durable consumer had acknowledged every
        message when last seen (at the declaration, then on idle checks): a consumer deleted
        under the transport is declared again to start after it."""
        resume = self._topology.resume
        return None if resume is None else resume[1]

    @property
    def max_deliver(self) -> int:
        """The consumer's delivery limit as the server holds it (-1: none)."""
        return self._topology.max_deliver

    @property
    def limits(self) -> BrokerLimits:
        """The horizon's inputs as the server holds them once the transport is open: the
        consumer's ``ack_wait`` and ``max_deliver``, the stream's ``max_age`` (a message is
        kept, and a new consumer of the stream can read it, until then; none when 0)."""
        topology = self._topology
        return BrokerLimits(
            ack_wait=self.ack_wait,
            max_deliveries=topology.max_deliver if topology.max_deliver > 0 else None,
            message_ttl=topology.max_age,
            source=f"JetStream consumer {self.group!r} ack_wait and max_deliver, stream "
            f"{self.stream!r} max_age",
        )

    # ------------------------------------------------------------------ connection

    async def open(self, prefetch: int) -> None:
        self._prefetch = max(1, prefetch)
        self._stopped = False
        await self._ready()

    async def _ready(self) -> JetStreamContext.PullSubscription:
        link = self._link
        js = await link.jetstream()
        if self._sub is not None and self._sub_js is not js:
            self._sub = None  # a new connection: subscribe on it
        if not link.declared:
            self.stream, self.dead_letter_stream = await self._topology.declare(js)
            link.declared = True
        if self._sub is None:
            assert self.stream is not None
            try:
                self._sub = await js.pull_subscribe_bind(durable=self.group, stream=self.stream)
            except UNAVAILABLE as exc:
                raise unavailable("declaration", exc) from None
            self._sub_js = js
        return self._sub

    # ------------------------------------------------------------------ reading

    async def fetch(self, limit: int, timeout: timedelta) -> list[Delivery]:
        if self._stopped or limit < 1:
            return []
        if not self._held:
            sub = await self._ready()
            try:
                msgs = await sub.fetch(
                    batch=min(limit, self._prefetch),
                    timeout=max(timeout.total_seconds(), 0.01),
                )
            except TimeoutError as exc:
                if not self._link.connected:
                    raise unavailable("fetch", exc) from None
                await self._check_consumer()
                return []  # no message within the timeout
            except nats.js.errors.APIError as exc:
                self._link.declared = False  # the consumer may be gone: declare it again
                raise unavailable("fetch", exc) from None
            except UNAVAILABLE as exc:
                raise unavailable("fetch", exc) from None
            # nats-py may hand back more than asked (late messages of an earlier pull).
            self._held.extend(msgs)
        taken: list[Delivery] = []
        while self._held and len(taken) < limit:
            msg = self._held.popleft()
            try:
                taken.append(JetStreamDelivery(self, msg))
            except nats.errors.NotJSMessageError:
                LOGGER.warning("oncely broker=nats skipped a message that is not from JetStream")
        return taken

    async def _check_consumer(self) -> None:
        """After an empty fetch (at most every :data:`_CHECK_EVERY`): raise
        :class:`~oncely.BrokerUnavailable` when the durable consumer is gone, deleted on
        its own or with its stream, so the next fetch declares them again. nats-py answers
        a pull on a consumer that no longer exists as it answers an empty one (a timeout):
        without this check the transport would wait on it for good, looking healthy, while a
        stream made again by a producer fills up."""
        loop = asyncio.get_running_loop()
        js, stream = self._link.js, self.stream
        if loop.time() < self._next_check or js is None or stream is None:
            return
        self._next_check = loop.time() + _CHECK_EVERY.total_seconds()
        try:
            info = await js.consumer_info(stream, self.group)
        except nats.js.errors.NotFoundError as exc:
            self._link.declared = False
            sub, self._sub = self._sub, None
            if sub is not None:
                with contextlib.suppress(ValueError, *UNAVAILABLE):
                    await sub.unsubscribe()
            raise BrokerUnavailable(
                f"the JetStream consumer {self.group!r} of stream {stream!r} is gone (deleted, "
                f"or its stream was: {exc.description}); it is declared again"
            ) from None
        except _CHECK_FAILURES:
            return  # the next fetch finds out
        with contextlib.suppress(*_CHECK_FAILURES):
            self._topology.note(info, (await js.stream_info(stream)).created)

    async def _reply(self, msg: Msg, payload: bytes, what: str) -> None:
        """Send an acknowledgement ``payload`` for ``msg`` and wait for the server's answer."""
        client = self._link.client
        if client is None or not client.is_connected:
            raise BrokerUnavailable(
                f"cannot {what} a message: the NATS connection is down; JetStream redelivers "
                "it after ack_wait"
            )
        try:
            await client.request(msg.reply, payload, timeout=self._link.timeout.total_seconds())
        except UNAVAILABLE as exc:
            raise unavailable(what, exc) from None

    async def _publish_dead_letter(self, msg: Msg, why: DeadLetter) -> None:
        """Publish a copy of ``msg`` with ``why`` to the dead-letter subject and wait for the
        dead-letter stream's acknowledgement."""
        js, client = self._link.js, self._link.client
        if js is None or client is None or not self._link.connected:
            raise BrokerUnavailable("cannot dead-letter a message: the NATS connection is down")
        try:
            await publish_dead_letter(
                js,
                self.dead_letter,
                msg,
                why,
                self._link.timeout.total_seconds(),
            )
        except nats.js.errors.NoStreamResponseError as exc:
            self._link.declared = False
            raise BrokerError(
                f"no stream captures the dead-letter subject {self.dead_letter!r}: {exc}"
            ) from None
        except nats.js.errors.APIError as exc:
            raise BrokerError(f"the dead-letter stream refused the copy: {exc}") from None
        except UNAVAILABLE as exc:
            raise unavailable("dead-letter publish", exc) from None

    def _keep(self, work: Coroutine[object, object, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._kept.add(task)
        task.add_done_callback(self._kept.discard)

    async def stop(self) -> None:
        """Stop fetching, and give back at once (``-NAK`` without delay) every message that
        was fetched from the server and never handed out: those the last fetch returned
        beyond its limit, and those nats-py buffered for a pull request still open. Another
        consumer gets them now instead of after ``ack_wait``. Deliveries already handed out
        are left alone, to be settled as their handlers finish."""
        self._stopped = True
        unstarted = list(self._held)
        self._held.clear()
        sub, self._sub = self._sub, None
        if sub is not None:
            unstarted += await _unsubscribe(sub)
        if not self._link.connected:
            return  # they come back after ack_wait
        for msg in unstarted:
            with contextlib.suppress(BrokerError):
                await self._reply(msg, b"-NAK", "give back")

    async def close(self) -> None:
        """Close the connection; unsettled messages come back after ``ack_wait``."""
        if not self._stopped:
            await self.stop()
        for task in list(self._kept):
            task.cancel()
        if self._kept:
            await asyncio.gather(*self._kept, return_exceptions=True)
        self._sub = None
        await self._link.close()


async def publish_dead_letter(
    js: JetStreamContext,
    subject: str,
    msg: Msg,
    why: DeadLetter,
    timeout: float,
) -> None:
    """Publish a copy of ``msg`` (its body and every header) with ``why`` to ``subject`` and
    wait for the stream's acknowledgement. When the stream's duplicate window already holds
    a copy with this ``Nats-Msg-Id``, maybe of another message, this one is published again
    with the id in ``x-oncely-message-id`` instead, so it is never dropped. The reason is cut
    where the whole copy would be larger than the server's ``max_payload`` (read from the
    connection under ``js``): the server would refuse it and close the connection, and the
    message, given back each time, would be dropped by JetStream after ``max_deliver``
    deliveries, never dead-lettered. Raises nats-py's errors, and
    :class:`~oncely.BrokerError` for a copy that cannot fit even so.

    The one dead-letter publish of every NATS consumer oncely has: its transport's and
    FastStream's (:mod:`oncely.integrations.faststream`)."""
    headers = sendable_headers(msg.headers or {})
    for name in [n for n in headers if n.lower().startswith("nats-") and n != MSG_ID_HEADER]:
        # A JetStream publish header (an expected stream or last sequence, a rollup, a TTL)
        # is an instruction to the stream that stores the copy: the dead-letter stream would
        # refuse the copy (and JetStream drop the message after max_deliver) or act on it.
        headers[ORIGINAL_HEADER_PREFIX + name] = headers.pop(name)
    headers.update(why.headers())
    max_payload = _max_payload(js)
    if max_payload is not None:
        _fit(headers, len(msg.data), max_payload)
    ack = await js.publish(subject, msg.data, timeout=timeout, headers=dict(headers))
    if ack.duplicate:
        headers[MESSAGE_ID_COPY_HEADER] = headers.pop(MSG_ID_HEADER, "")
        await js.publish(subject, msg.data, timeout=timeout, headers=dict(headers))


_CUT = " ... [cut to fit the server's max_payload]"


def _max_payload(js: JetStreamContext) -> int | None:
    """The ``max_payload`` the server of ``js``'s connection announced (``None`` before it
    announced one). nats-py keeps the connection as ``_nc``: taking it from there, rather
    than from each caller, leaves no caller that can forget it."""
    limit = getattr(getattr(js, "_nc", None), "max_payload", None)
    return limit if isinstance(limit, int) and limit > 0 else None


def _fit(headers: dict[str, str], body: int, max_payload: int) -> None:
    """Cut ``x-oncely-reason`` in ``headers`` so that the message they head, with a body of
    ``body`` bytes, is at most ``max_payload`` bytes on the wire; raise
    :class:`~oncely.BrokerError` when even no reason at all is too much."""
    over = header_bytes(headers) + body - max_payload
    if over <= 0:
        return
    reason = headers[REASON_HEADER].encode()
    room = len(reason) - over
    if room < 0:
        raise BrokerError(
            f"the dead-letter copy would be {-room} bytes over the server's max_payload of "
            f"{max_payload} even without its reason (a body of {body} bytes); not published"
        )
    cut = _CUT.encode()
    kept = reason[: room - len(cut)] + cut if room > 2 * len(cut) else reason[:room]
    headers[REASON_HEADER] = kept.decode("utf-8", "ignore")


def header_bytes(headers: Mapping[str, str]) -> int:
    """The size of ``headers`` as nats-py writes them (``NATS/1.0``, then ``name: value``
    lines, each stripped, then a blank line)."""
    lines = (
        len(name.strip().encode()) + len(value.strip().encode()) + 4
        for name, value in headers.items()
        if name.strip()
    )
    return len(b"NATS/1.0\r\n\r\n") + sum(lines)


def sendable_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """``headers`` as nats-py can publish them again (it sends UTF-8 only, one line a name),
    every byte kept: the headers whose name or value is not UTF-8, and every line of a name
    the message repeated (:class:`~._connection.Headers`), are taken out and sent together,
    as the exact header lines base64-encoded, in ``x-oncely-raw-headers``."""
    sendable: dict[str, str] = {}
    raw: list[bytes] = []
    repeated: dict[str, list[tuple[bytes, bytes]]] = {}
    for line in getattr(headers, "repeated", ()):
        repeated.setdefault(wire_text(line[0]), []).append(line)
    for name, value in headers.items():
        if name in repeated:
            raw.extend(n + b": " + v + b"\r\n" for n, v in repeated[name])
        elif escaped(name) or escaped(value):
            raw.append(raw_bytes(name) + b": " + raw_bytes(value) + b"\r\n")
        else:
            sendable[name] = value
    if raw:
        sendable[RAW_HEADERS_HEADER] = base64.b64encode(b"".join(raw)).decode("ascii")
    return sendable


async def _unsubscribe(sub: JetStreamContext.PullSubscription) -> list[Msg]:
    """Unsubscribe ``sub`` and return the JetStream messages nats-py buffered for it that no
    fetch returned. Once the subscription is gone the server drops any pull request still
    waiting on it, so nothing more is delivered here; a message already on its way at that
    moment is dropped by nats-py and comes back after ``ack_wait``."""
    # A pull request outlives its fetch when the fetch is cancelled or times out just before
    # the server's expiry; what the server delivers for it afterwards waits in the queue of
    # the subscription behind the pull subscription (nats-py's next fetch returns it first).
    # nats-py has no public call that takes those without pulling more, hence ``_sub``.
    inner = getattr(sub, "_sub", None)
    with contextlib.suppress(ValueError, *UNAVAILABLE):
        await sub.unsubscribe()
    buffered: list[Msg] = []
    if inner is None:
        return buffered
    with contextlib.suppress(*UNAVAILABLE):
        while inner.pending_msgs > 0:
            msg = await inner.next_msg(timeout=1.0)
            if msg.reply and not JetStreamContext.is_status_msg(msg):
                buffered.append(msg)
    return buffered
