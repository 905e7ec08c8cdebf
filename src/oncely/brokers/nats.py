"""NATS JetStream: a durable pull consumer per group, a dead-letter stream, and a producer
whose ``Nats-Msg-Id`` makes producer retries recognisable.

::

    import oncely
    from oncely.brokers import BrokerConsumer, ConsumerSettings, open_producer, open_transport

    producer = open_producer("nats://127.0.0.1:4222", "orders.created")
    message_id = oncely.brokers.new_message_id()  # once per logical message, reused on retries
    await producer.publish(b'{"order": 42}', message_id=message_id)

    inbox = oncely.AsyncInbox(oncely.open_async("postgresql://..."), consumer="billing")
    transport = open_transport("nats://127.0.0.1:4222", "orders.created", group="billing")
    await BrokerConsumer(transport, inbox, charge).run(handle_signals=True)

What is declared
    ``source`` is a subject. The stream that captures it is used; when none does, a file
    stream named after the subject (``orders.created`` -> ``orders_created``, or ``stream=``)
    is created with the subject as its only subject. ``group`` is the durable name of an
    explicit-ack pull consumer on that stream filtered to ``source``; every process of the
    group shares it and JetStream hands each message to one of them. The dead-letter
    destination is a subject (default ``<source>.dead``) captured by a stream of its own
    (created if missing, named after that subject or ``dead_letter_stream=``, with the server's
    smallest duplicate window, 100 ms, so it keeps every copy). The main stream
    must not capture the dead-letter subject, or dead-lettered copies would be delivered again:
    the stream created here lists exactly ``source`` (no wildcard), so ``<source>.dead`` stays
    outside it; a source with a wildcard needs an explicit ``dead_letter`` outside its pattern,
    and an existing stream that captures the dead-letter subject is refused at :meth:`open`.

What each outcome does
    ``processed``, ``duplicate`` and ``stale_reclaimed`` are acknowledged (``+ACK``).
    ``in_flight`` is given back with ``-NAK`` and a delay of ``requeue_delay``; ``failed`` with
    ``-NAK`` and the backoff delay. ``key_conflict``, ``rejected`` and ``escalated`` are
    published to the dead-letter subject (same body, the original headers including
    ``Nats-Msg-Id``, plus ``x-oncely-outcome``, ``x-oncely-reason``, ``x-oncely-consumer``,
    ``x-oncely-deliveries``); once the dead-letter stream acknowledged the copy, the original
    is terminated (``+TERM``, never redelivered). A crash in between dead-letters it twice,
    never zero times. When the dead-letter stream's duplicate window already holds a copy with
    that id (a stream created elsewhere with a long window), the copy is published again
    without ``Nats-Msg-Id``, carrying the id in ``x-oncely-message-id``, so it is never
    dropped. Every settlement is a request the server answers, so a settlement that returns
    has reached the server; on a connection that is down it raises
    :class:`~oncely.BrokerUnavailable` at once and the message comes back after ``ack_wait``.
    A running handler's message is kept with ``+WPI`` (in progress) every ``ack_wait / 3``.

Delivery limit
    ``delivery_count`` is JetStream's ``num_delivered``. The consumer loop dead-letters a
    message that failed on ``ConsumerSettings.max_deliveries`` deliveries. The stream
    consumer's own ``max_deliver`` (default 20) is a safety net above that (R13): keep it
    above ``max_deliveries`` with room for ``in_flight`` requeues, which count as deliveries
    too. JetStream silently stops delivering a message at its ``max_deliver`` and leaves it
    unacknowledged, so a give-back asked for on that last delivery dead-letters the message
    instead (reason: the consumer's ``max_deliver`` was reached) rather than strand it.

Keys
    The producer's id is the ``Nats-Msg-Id`` header (``Envelope.message_id``); CloudEvents
    ``ce-*`` headers are passed as headers for :class:`~oncely.CloudEventsKey`. The stream
    and consumer sequences, the delivery count and the subject go to ``Envelope.transport``
    only, where no key source reads them (R4).

Duplicate window
    :class:`JetStreamProducer` sets ``Nats-Msg-Id``, so the stream drops a producer retry
    that arrives within its duplicate window (``duplicate_window``, server default two
    minutes; R14, R23). That is a complement only: the window is time-bounded, and it never
    sees redeliveries of a stored message. The inbox is what guarantees one effect.

Connections
    nats-py reconnects by itself (forever, every ``reconnect_wait``); while it is away,
    :meth:`JetStream.fetch` raises :class:`~oncely.BrokerUnavailable` (a fetch that merely
    found no message returns ``[]``), and after a reconnect the stream and consumer are
    declared again before the next fetch, in case the server came back without them.

URL options (``nats://user:password@host:4222?ack_wait=30``): ``stream``,
``dead_letter_stream``, ``ack_wait``, ``max_deliver``, ``max_ack_pending``,
``duplicate_window``, ``connect_timeout``, ``timeout`` (each settlement and publish),
``reconnect_wait`` (durations in seconds). The producer reads ``stream``,
``duplicate_window``, ``connect_timeout`` and ``timeout``.

Tested (``tests/brokers/test_nats.py``, against a real nats-server): producer retries dropped
by the window and, outside it, answered ``duplicate`` by the inbox; an ack wait shorter than
the handler; two consumers receiving copies of one message at once; key conflicts, poison,
undecodable and id-less messages read back from the dead-letter stream; retries up to the
delivery limit; a server killed with SIGKILL and restarted mid-run; ``in_flight`` given back
with a delay and not acknowledged; fetch and ack on a dropped connection. Each ends with every
effect applied exactly once and nothing pending or unacknowledged on the consumer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from collections import deque
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Self
from urllib.parse import urlunsplit

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import api
from nats.js.client import JetStreamContext

from oncely._core.keys import Envelope
from oncely._urls import UrlOptions, redact, split
from oncely.brokers._shape import DeadLetter, Delivery
from oncely.errors import BrokerError, BrokerUnavailable, ConfigurationError

__all__ = ["JetStream", "JetStreamProducer"]

LOGGER = logging.getLogger("oncely.broker.nats")

MSG_ID_HEADER = "Nats-Msg-Id"
CONTENT_TYPE_HEADER = "Content-Type"
CORRELATION_HEADER = "Correlation-Id"
MESSAGE_ID_COPY_HEADER = "x-oncely-message-id"

DEFAULT_ACK_WAIT = timedelta(seconds=30)
DEFAULT_MAX_DELIVER = 20
DEFAULT_TIMEOUT = timedelta(seconds=5)
DEFAULT_CONNECT_TIMEOUT = timedelta(seconds=5)
DEFAULT_RECONNECT_WAIT = timedelta(milliseconds=500)
# The server's smallest duplicate window: the dead-letter stream created here keeps every copy.
_DEAD_LETTER_WINDOW = timedelta(milliseconds=100)

_TRANSPORT_OPTIONS = (
    "ack_wait",
    "connect_timeout",
    "dead_letter_stream",
    "duplicate_window",
    "max_ack_pending",
    "max_deliver",
    "reconnect_wait",
    "stream",
    "timeout",
)
_PRODUCER_OPTIONS = ("connect_timeout", "duplicate_window", "stream", "timeout")

# Connection-level failures of the client: the broker is (for now) out of reach.
_UNAVAILABLE: tuple[type[Exception], ...] = (nats.errors.Error, OSError, TimeoutError)


def stream_name_for(subject: str) -> str:
    """The name of the stream created for ``subject`` when none captures it: every character
    a stream name cannot hold (``.``, ``*``, ``>``, white space) becomes ``_``."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", subject)


def _check_subject(subject: str, what: str) -> str:
    if not subject or any(ch.isspace() for ch in subject) or "" in subject.split("."):
        raise ConfigurationError(f"{what} {subject!r} is not a NATS subject")
    return subject


def _has_wildcard(subject: str) -> bool:
    return any(token in ("*", ">") for token in subject.split("."))


def subject_matches(pattern: str, subject: str) -> bool:
    """Whether the subject ``pattern`` (with ``*`` and ``>`` wildcards) captures ``subject``."""
    want, have = pattern.split("."), subject.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return len(have) > i
        if i >= len(have) or (token != "*" and token != have[i]):
            return False
    return len(want) == len(have)


def _seconds(value: timedelta | None) -> float | None:
    return None if value is None else value.total_seconds()


def _positive(value: timedelta, name: str) -> timedelta:
    if value <= timedelta(0):
        raise ConfigurationError(f"{name} must be positive")
    return value


def _server_url(url: str, schemes: tuple[str, ...]) -> str:
    parts = split(url)
    if parts.scheme.lower() not in schemes:
        raise ConfigurationError(
            f"{redact(url)}: a NATS URL starts with " + " or ".join(f"{s}://" for s in schemes)
        )
    return urlunsplit(parts._replace(query="", fragment=""))


async def _connect(
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

    client = Client()
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
    except _UNAVAILABLE as exc:
        with contextlib.suppress(Exception):
            await client.close()
        raise BrokerUnavailable(
            f"cannot connect to NATS at {redact(server)}: {type(exc).__name__}: {exc}"
        ) from None
    return client


async def _ensure_stream(
    js: JetStreamContext,
    subject: str,
    name: str | None,
    duplicate_window: timedelta | None,
) -> str:
    """The stream that captures ``subject``: the one named ``name`` or, without a name, any
    existing one; created (file storage, ``subject`` as its only subject) when missing."""
    if name is not None:
        with contextlib.suppress(nats.js.errors.NotFoundError):
            await js.stream_info(name)
            return name
    else:
        with contextlib.suppress(nats.js.errors.NotFoundError):
            return await js.find_stream_name_by_subject(subject)
    created = name if name is not None else stream_name_for(subject)
    config = api.StreamConfig(
        name=created,
        subjects=[subject],
        storage=api.StorageType.FILE,
        duplicate_window=_seconds(duplicate_window),  # type: ignore[arg-type]
    )
    try:
        await js.add_stream(config)
    except nats.js.errors.BadRequestError as exc:
        # Another process may have created it first (same config: accepted), or it clashes.
        with contextlib.suppress(nats.js.errors.NotFoundError):
            if await js.find_stream_name_by_subject(subject) == created:
                return created
        raise ConfigurationError(
            f"cannot create the JetStream stream {created!r} for subject {subject!r}: "
            f"{exc.description}"
        ) from None
    return created


def _unavailable(what: str, exc: BaseException) -> BrokerUnavailable:
    return BrokerUnavailable(f"NATS {what} failed: {type(exc).__name__}: {exc}")


class _Delivery:
    """One JetStream message held unacknowledged by the durable pull consumer."""

    __slots__ = ("_count", "_envelope", "_msg", "_settled", "_transport")

    def __init__(self, transport: JetStream, msg: Msg) -> None:
        self._transport = transport
        self._msg = msg
        self._settled = False
        meta = msg.metadata
        self._count = meta.num_delivered
        headers = {str(k): str(v) for k, v in (msg.headers or {}).items()}
        self._envelope = Envelope(
            body=msg.data,
            message_id=headers.get(MSG_ID_HEADER) or None,
            headers=headers,
            correlation_id=headers.get(CORRELATION_HEADER) or None,
            delivery_count=meta.num_delivered,
            transport={
                "subject": msg.subject,
                "stream": meta.stream,
                "stream_seq": meta.sequence.stream,
                "consumer_seq": meta.sequence.consumer,
                "redelivered": meta.num_delivered > 1,
                "content_type": headers.get(CONTENT_TYPE_HEADER),
            },
        )

    @property
    def envelope(self) -> Envelope:
        return self._envelope

    @property
    def delivery_count(self) -> int | None:
        return self._count

    def describe(self) -> Mapping[str, object]:
        return self._envelope.transport

    async def ack(self) -> None:
        await self._settle(b"+ACK", "ack")

    async def retry(self, delay: timedelta) -> None:
        limit = self._transport.max_deliver
        if limit > 0 and self._count >= limit:
            # JetStream would not deliver it again and would leave it unacknowledged for good.
            LOGGER.warning(
                "oncely broker=nats a message on its last delivery (%s, the consumer's "
                "max_deliver) is dead-lettered instead of given back",
                self._count,
            )
            await self.dead_letter(
                DeadLetter(
                    outcome="rejected",
                    reason=(
                        f"delivered {self._count} times, the JetStream consumer's max_deliver: "
                        "the broker would not deliver it again (raise max_deliver above "
                        "ConsumerSettings.max_deliveries)"
                    ),
                    consumer=self._transport.group,
                    deliveries=self._count,
                )
            )
            return
        nanos = int(delay.total_seconds() * 1_000_000_000)
        payload = b"-NAK" if nanos <= 0 else b"-NAK " + json.dumps({"delay": nanos}).encode()
        await self._settle(payload, "retry")

    async def dead_letter(self, why: DeadLetter) -> None:
        await self._transport._publish_dead_letter(self._msg, why)
        await self._settle(b"+TERM", "dead-letter")

    async def extend(self) -> None:
        if not self._settled:
            await self._transport._reply(self._msg, b"+WPI", "extend")

    async def _settle(self, payload: bytes, what: str) -> None:
        if self._settled:
            raise BrokerError(f"this delivery was already settled; cannot {what} it")
        await self._transport._reply(self._msg, payload, what)
        self._settled = True


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
        self._server = _server_url(url, ("nats", "tls"))
        self.source = _check_subject(source, "source")
        if not group or any(ch in group for ch in ". *>\t\r\n/\\"):
            raise ConfigurationError(
                f"group {group!r} must be a durable consumer name: no spaces, '.', '*', '>'"
            )
        self.group = group
        if dead_letter is None:
            if _has_wildcard(source):
                raise ConfigurationError(
                    f"source {source!r} has a wildcard: name a dead_letter subject outside it"
                )
            dead_letter = f"{source}.dead"
        self.dead_letter = _check_subject(dead_letter, "dead_letter")
        if _has_wildcard(self.dead_letter):
            raise ConfigurationError("the dead_letter subject cannot have wildcards")
        if subject_matches(self.source, self.dead_letter):
            raise ConfigurationError(
                f"the dead-letter subject {self.dead_letter!r} matches the source "
                f"{self.source!r}: dead-lettered copies would be consumed again"
            )
        self.ack_wait = _positive(ack_wait, "ack_wait")
        if max_deliver == 0 or max_deliver < -1:
            raise ConfigurationError("max_deliver must be positive, or -1 for no limit")
        self._max_deliver = max_deliver
        if max_ack_pending is not None and max_ack_pending < 1:
            raise ConfigurationError("max_ack_pending must be at least 1")
        self._max_ack_pending = max_ack_pending
        if duplicate_window is not None:
            _positive(duplicate_window, "duplicate_window")
        self._duplicate_window = duplicate_window
        self._stream_option = stream
        self._dead_stream_option = dead_letter_stream
        self._timeout = _positive(timeout, "timeout")
        self._connect_timeout = _positive(connect_timeout, "connect_timeout")
        self._reconnect_wait = reconnect_wait
        self.stream: str | None = None
        """The main stream's name, known after :meth:`open`."""
        self.dead_letter_stream: str | None = None
        """The dead-letter stream's name, known after :meth:`open`."""
        self._client: Client | None = None
        self._js: JetStreamContext | None = None
        self._sub: JetStreamContext.PullSubscription | None = None
        self._declared = False
        self._stopped = False
        self._prefetch = 1
        self._held: deque[Msg] = deque()

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
        options.done(_TRANSPORT_OPTIONS)
        return cls(
            url,
            source,
            group=group,
            dead_letter=dead_letter,
            ack_wait=ack_wait if ack_wait is not None else url_ack_wait,
            stream=stream,
            dead_letter_stream=dead_letter_stream,
            max_deliver=max_deliver,
            max_ack_pending=_int_option(url, "max_ack_pending", pending),
            duplicate_window=_seconds_option(url, "duplicate_window", window),
            timeout=timeout,
            connect_timeout=connect_timeout,
            reconnect_wait=reconnect_wait,
        )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({redact(self._server)!r}, {self.source!r}, "
            f"group={self.group!r})"
        )

    @property
    def name(self) -> str:
        return "nats"

    @property
    def extend_every(self) -> timedelta | None:
        return self.ack_wait / 3

    @property
    def connected(self) -> bool:
        """Whether the connection is up now (nats-py reconnects in the background)."""
        return self._client is not None and self._client.is_connected

    @property
    def max_deliver(self) -> int:
        """The consumer's delivery limit as the server holds it (-1: none)."""
        return self._max_deliver

    # ------------------------------------------------------------------ connection

    async def open(self, prefetch: int) -> None:
        self._prefetch = max(1, prefetch)
        self._stopped = False
        await self._ready()

    async def _ready(self) -> JetStreamContext.PullSubscription:
        client = self._client
        if client is None or client.is_closed:
            self._client = client = None
            self._sub = None
            self._declared = False
            client = await _connect(
                self._server,
                self._connect_timeout,
                self._reconnect_wait,
                "consumer",
                self._redeclare,
            )
            self._client = client
            self._js = client.jetstream(timeout=self._timeout.total_seconds())
        if not client.is_connected:
            raise BrokerUnavailable(f"NATS at {redact(self._server)} is reconnecting")
        if not self._declared:
            await self._declare()
            self._declared = True
        assert self._sub is not None
        return self._sub

    def _redeclare(self) -> None:
        # The server may have come back without the stream or the consumer.
        self._declared = False

    async def _declare(self) -> None:
        js = self._js
        assert js is not None
        try:
            stream = await _ensure_stream(
                js, self.source, self._stream_option, self._duplicate_window
            )
            try:
                captor: str | None = await js.find_stream_name_by_subject(self.dead_letter)
            except nats.js.errors.NotFoundError:
                captor = None
            if captor == stream:
                raise ConfigurationError(
                    f"the stream {stream!r} captures the dead-letter subject "
                    f"{self.dead_letter!r}: dead-lettered copies would be consumed again; "
                    "choose a dead_letter subject outside the stream's subjects"
                )
            if captor is None:
                captor = await _ensure_stream(
                    js, self.dead_letter, self._dead_stream_option, _DEAD_LETTER_WINDOW
                )
            info = await self._ensure_consumer(js, stream)
            if self._sub is None:
                self._sub = await js.pull_subscribe_bind(durable=self.group, stream=stream)
        except nats.js.errors.NotFoundError as exc:
            raise _unavailable("declaration", exc) from None
        except nats.js.errors.BadRequestError as exc:
            raise ConfigurationError(f"JetStream refused the declaration: {exc}") from None
        except _UNAVAILABLE as exc:
            raise _unavailable("declaration", exc) from None
        self.stream, self.dead_letter_stream = stream, captor
        self._max_deliver = info.config.max_deliver or -1

    async def _ensure_consumer(self, js: JetStreamContext, stream: str) -> api.ConsumerInfo:
        wanted = {
            "ack_wait": self.ack_wait.total_seconds(),
            "max_deliver": self._max_deliver,
        }
        if self._max_ack_pending is not None:
            wanted["max_ack_pending"] = self._max_ack_pending
        try:
            info: api.ConsumerInfo = await js.consumer_info(stream, self.group)
        except nats.js.errors.NotFoundError:
            config = api.ConsumerConfig(
                durable_name=self.group,
                ack_policy=api.AckPolicy.EXPLICIT,
                deliver_policy=api.DeliverPolicy.ALL,
                filter_subject=self.source,
                **wanted,  # type: ignore[arg-type]
            )
            return await js.add_consumer(stream, config)
        config = info.config
        if config.deliver_subject:
            raise ConfigurationError(
                f"the JetStream consumer {self.group!r} is a push consumer; oncely needs a "
                "pull consumer (delete it or choose another group)"
            )
        if config.ack_policy != api.AckPolicy.EXPLICIT:
            raise ConfigurationError(
                f"the JetStream consumer {self.group!r} does not use explicit acks"
            )
        if config.filter_subject not in (None, "", self.source) or config.filter_subjects:
            raise ConfigurationError(
                f"the JetStream consumer {self.group!r} reads {config.filter_subject!r}, "
                f"not {self.source!r}"
            )
        if any(getattr(config, field) != value for field, value in wanted.items()):
            for field, value in wanted.items():
                setattr(config, field, value)
            info = await js.add_consumer(stream, config)  # an update of the same durable
        return info

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
                client = self._client
                if client is None or not client.is_connected:
                    raise _unavailable("fetch", exc) from None
                return []  # no message within the timeout
            except nats.js.errors.APIError as exc:
                self._declared = False  # the consumer may be gone: declare it again
                raise _unavailable("fetch", exc) from None
            except _UNAVAILABLE as exc:
                raise _unavailable("fetch", exc) from None
            # nats-py may hand back more than asked (late messages of an earlier pull).
            self._held.extend(msgs)
        taken: list[Delivery] = []
        while self._held and len(taken) < limit:
            msg = self._held.popleft()
            try:
                taken.append(_Delivery(self, msg))
            except nats.errors.NotJSMessageError:
                LOGGER.warning("oncely broker=nats skipped a message that is not from JetStream")
        return taken

    async def _reply(self, msg: Msg, payload: bytes, what: str) -> None:
        """Send an acknowledgement ``payload`` for ``msg`` and wait for the server's answer."""
        client = self._client
        if client is None or not client.is_connected:
            raise BrokerUnavailable(
                f"cannot {what} a message: the NATS connection is down; JetStream redelivers "
                "it after ack_wait"
            )
        try:
            await client.request(msg.reply, payload, timeout=self._timeout.total_seconds())
        except _UNAVAILABLE as exc:
            raise _unavailable(what, exc) from None

    async def _publish_dead_letter(self, msg: Msg, why: DeadLetter) -> None:
        """Publish a copy of ``msg`` with ``why`` to the dead-letter subject and wait for the
        dead-letter stream's acknowledgement."""
        client, js = self._client, self._js
        if client is None or js is None or not client.is_connected:
            raise BrokerUnavailable("cannot dead-letter a message: the NATS connection is down")
        headers = {str(k): str(v) for k, v in (msg.headers or {}).items()}
        headers.update(why.headers())
        try:
            ack = await self._publish_copy(js, msg.data, headers)
            if ack.duplicate:
                # The dead-letter stream's window holds a copy with this id, maybe of another
                # message: keep this one too rather than drop it.
                headers[MESSAGE_ID_COPY_HEADER] = headers.pop(MSG_ID_HEADER, "")
                await self._publish_copy(js, msg.data, headers)
        except nats.js.errors.NoStreamResponseError as exc:
            self._declared = False
            raise BrokerError(
                f"no stream captures the dead-letter subject {self.dead_letter!r}: {exc}"
            ) from None
        except nats.js.errors.APIError as exc:
            raise BrokerError(f"the dead-letter stream refused the copy: {exc}") from None
        except _UNAVAILABLE as exc:
            raise _unavailable("dead-letter publish", exc) from None

    async def _publish_copy(
        self, js: JetStreamContext, body: bytes, headers: dict[str, str]
    ) -> api.PubAck:
        return await js.publish(
            self.dead_letter,
            body,
            timeout=self._timeout.total_seconds(),
            headers=dict(headers),
        )

    async def stop(self) -> None:
        """Stop fetching; messages fetched but not yet handed out are given back now."""
        self._stopped = True
        held, self._held = self._held, deque()
        client = self._client
        if client is None or not client.is_connected:
            return
        for msg in held:
            with contextlib.suppress(BrokerError):
                await self._reply(msg, b"-NAK", "give back")

    async def close(self) -> None:
        """Close the connection; unsettled messages come back after ``ack_wait``."""
        if not self._stopped:
            await self.stop()
        client, self._client = self._client, None
        self._sub = None
        self._js = None
        self._declared = False
        if client is not None:
            with contextlib.suppress(Exception):
                await client.close()


class JetStreamProducer:
    """Publishes to ``destination`` (a subject) with ``Nats-Msg-Id`` set to the producer's
    message id, and returns once the stream acknowledged the message.

    The stream that captures the subject is used; when none does, one is created as
    :class:`JetStream` creates it (``stream``, ``duplicate_window``). Within the stream's
    duplicate window a retry with the same id is stored once (R14, R23); outside it the
    consumer's inbox answers it as ``duplicate``. :meth:`send` returns JetStream's answer,
    whose ``duplicate`` says whether the window dropped the message.
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
        self._server = _server_url(url, ("nats", "tls"))
        self.destination = _check_subject(destination, "destination")
        if _has_wildcard(destination):
            raise ConfigurationError("a producer publishes to a subject without wildcards")
        if duplicate_window is not None:
            _positive(duplicate_window, "duplicate_window")
        self._stream = stream
        self._duplicate_window = duplicate_window
        self._timeout = _positive(timeout, "timeout")
        self._connect_timeout = _positive(connect_timeout, "connect_timeout")
        self._reconnect_wait = reconnect_wait
        self._client: Client | None = None
        self._js: JetStreamContext | None = None
        self._declared = False
        self._lock = asyncio.Lock()

    @classmethod
    def from_url(cls, url: str, destination: str) -> Self:
        options = UrlOptions(url)
        stream = options.optional_text("stream")
        window = options.optional_text("duplicate_window")
        timeout = options.seconds("timeout", DEFAULT_TIMEOUT)
        connect_timeout = options.seconds("connect_timeout", DEFAULT_CONNECT_TIMEOUT)
        options.done(_PRODUCER_OPTIONS)
        return cls(
            url,
            destination,
            stream=stream,
            duplicate_window=_seconds_option(url, "duplicate_window", window),
            timeout=timeout,
            connect_timeout=connect_timeout,
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({redact(self._server)!r}, {self.destination!r})"

    async def _ready(self) -> JetStreamContext:
        async with self._lock:
            client = self._client
            if client is None or client.is_closed:
                self._declared = False
                client = await _connect(
                    self._server, self._connect_timeout, self._reconnect_wait, "producer"
                )
                self._client = client
                self._js = client.jetstream(timeout=self._timeout.total_seconds())
            if not client.is_connected:
                raise BrokerUnavailable(f"NATS at {redact(self._server)} is reconnecting")
            assert self._js is not None
            if not self._declared:
                try:
                    await _ensure_stream(
                        self._js, self.destination, self._stream, self._duplicate_window
                    )
                except _UNAVAILABLE as exc:
                    raise _unavailable("stream declaration", exc) from None
                except nats.js.errors.APIError as exc:
                    raise _unavailable("stream declaration", exc) from None
                self._declared = True
            return self._js

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
        if not message_id:
            raise ConfigurationError("message_id is required: it is the consumers' dedup key")
        fields = {str(k): str(v) for k, v in (headers or {}).items()}
        fields[MSG_ID_HEADER] = message_id
        fields[CONTENT_TYPE_HEADER] = content_type
        if correlation_id is not None:
            fields[CORRELATION_HEADER] = correlation_id
        js = await self._ready()
        try:
            return await js.publish(
                self.destination, body, timeout=self._timeout.total_seconds(), headers=fields
            )
        except nats.js.errors.NoStreamResponseError as exc:
            self._declared = False  # JetStream is restarting, or the stream was deleted
            raise _unavailable("publish", exc) from None
        except nats.js.errors.APIError as exc:
            raise BrokerError(f"JetStream refused the message: {exc}") from None
        except _UNAVAILABLE as exc:
            raise _unavailable("publish", exc) from None

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
        with the same ``message_id`` is then safe."""
        await self.send(
            body,
            message_id=message_id,
            headers=headers,
            content_type=content_type,
            correlation_id=correlation_id,
        )

    async def close(self) -> None:
        client, self._client = self._client, None
        self._js = None
        if client is not None:
            with contextlib.suppress(Exception):
                await client.close()


def _int_option(url: str, name: str, value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigurationError(f"{redact(url)}: {name} must be a whole number") from None


def _seconds_option(url: str, name: str, value: str | None) -> timedelta | None:
    if value is None:
        return None
    try:
        return timedelta(seconds=float(value))
    except ValueError:
        raise ConfigurationError(f"{redact(url)}: {name} must be a number of seconds") from None
