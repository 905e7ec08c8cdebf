"""Redis Streams: a stream read by a consumer group, with the key in a field of each entry.

::

    import oncely
    from oncely.brokers import BrokerConsumer, open_producer, open_transport

    producer = open_producer("redis://localhost:6379/0", "payments")
    await producer.publish(b'{"order": 7}', message_id=order_id)  # reuse order_id on retries

    inbox = oncely.AsyncInbox(oncely.open_async("postgresql://..."), consumer="billing")
    transport = open_transport("redis://localhost:6379/0", "payments", group="billing")
    await BrokerConsumer(transport, inbox, charge).run(handle_signals=True)

or with typed options: ``RedisStreams("redis://...", "payments", group="billing",
ack_wait=timedelta(minutes=1), consumer="billing-7")``. Needs Redis 6.2 or later (7 is
tested) and ``pip install 'oncely[redis]'``. A single Redis only: the transport opens a plain
client (a Redis Cluster would need the stream and its dead-letter stream in one hash slot).

Entry layout
------------
:class:`RedisStreamsProducer` writes one entry per publish (``XADD``), with the fields

==================  ===========================================================================
``body``            the message body, raw bytes
``message_id``      the producer-assigned message id (R2): the dedup key by default
``content_type``    e.g. ``application/json`` (read by the default decoder); optional
``correlation_id``  optional
anything else       an application header (``ce-source``/``ce-id`` for CloudEvents, R3; a
                    business key for :class:`~oncely.HeaderKey`)
==================  ===========================================================================

``body_field`` and ``message_id_field`` rename the first two for entries written by other
producers. The entry id (``1718000000000-0``) is the broker's: a producer retry writes a new
entry with a new id, so it is never a key (R4) and goes to ``Envelope.transport`` only.

How it reads
------------
:meth:`RedisStreams.open` creates the group if it is missing (``XGROUP CREATE ... MKSTREAM``;
by default from the start of the stream, so entries written before the first consumer are
read). :meth:`RedisStreams.fetch` reads new entries with ``XREADGROUP COUNT <free slots> BLOCK
<timeout>``. Each transport is one consumer of the group (created when it opens), named
``<host>-<pid>-<random>`` unless ``consumer`` says otherwise.

An entry read but never acknowledged stays in the group's pending list. Every ``claim_every``
(1 s), before reading new entries, the transport runs ``XAUTOCLAIM`` with a minimum idle time
of ``ack_wait``: whatever a crashed or stopped consumer held longer than that is taken over and
delivered again. The delivery count is Redis's own counter of the entry (read with
``XPENDING`` in the same script as the claim), so a new entry is delivery 1 and each takeover
adds one. While a handler runs, the consumer loop calls :meth:`Delivery.extend` every
``ack_wait / 3``, which resets the entry's idle time (``XCLAIM ... JUSTID``, which leaves the
count alone) so no other consumer takes it over meanwhile.

===================  ==========================================================================
outcome              on Redis Streams
===================  ==========================================================================
processed,           ``XACK``
duplicate,
stale_reclaimed
in_flight, failed    retry: Redis has no negative acknowledgement, so the entry stays pending
                     and its idle time is set to ``ack_wait - delay`` (``XCLAIM ... IDLE``): it
                     becomes claimable once ``delay`` has passed, and the next ``XAUTOCLAIM`` (of
                     this or any consumer) delivers it again with the count one higher. A delay
                     longer than ``ack_wait`` waits ``ack_wait``.
key_conflict,        dead-letter: one Lua script (atomic, like ``MULTI``/``EXEC``) copies the
rejected,            entry to ``<stream>.dead`` (or ``dead_letter``) with every original field
escalated            plus ``x-oncely-outcome``, ``x-oncely-reason``, ``x-oncely-consumer`` and
                     ``x-oncely-deliveries``, and acknowledges the original. Both happen or
                     neither does.
===================  ==========================================================================

Retry, extend and dead-letter act only while this consumer still owns the entry (checked in
the same script): once another consumer has taken it over, the settlement is theirs, so a
message is never dead-lettered twice. Acknowledging is unconditional (the work is done).

Delivery limit: ``ConsumerSettings.max_deliveries`` dead-letters a message that keeps failing.
Redis has no limit of its own; ``delivery_limit`` adds one for messages whose consumer never
settles them (a handler that crashes the process each time): an entry claimed with a higher
count is dead-lettered as ``rejected`` instead of delivered. Keep it above ``max_deliveries``
(R13).

:meth:`RedisStreams.close` makes the entries it still holds claimable at once and removes its
consumer from the group when it holds nothing. Acknowledged entries stay in the stream until
it is trimmed (``maxlen`` on the producer, or ``XTRIM``); trimming entries not yet read by
every group loses them, so trim by age well past ``ack_wait`` and the longest retry backoff.

Durability is the server's: a Redis without ``appendonly`` loses the stream, the group and
its pending list when it restarts.

Tested (tests/brokers/test_redis_streams.py, against a real Redis): producer retries, a
handler slower than ``ack_wait``, two consumers receiving copies of one message at once,
key conflicts and poison messages dead-lettered with their reasons, retries up to
``max_deliveries``, the delivery limit, ``in_flight`` left pending while another consumer
works, and a Redis server killed and restarted mid-run; each ends with every effect applied
once and nothing pending.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
from collections.abc import Iterator, Mapping, Sequence
from datetime import timedelta
from typing import Any, Literal
from urllib.parse import urlunsplit

import redis.asyncio
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from oncely._core.keys import TRANSPORT_FIELDS, Envelope
from oncely._urls import UrlOptions, redact, split
from oncely.brokers._shape import (
    CONSUMER_HEADER,
    DELIVERIES_HEADER,
    OUTCOME_HEADER,
    REASON_HEADER,
    DeadLetter,
    Delivery,
)
from oncely.errors import BrokerError, BrokerUnavailable, ConfigurationError

__all__ = ["RedisStreams", "RedisStreamsDelivery", "RedisStreamsProducer"]

LOGGER = logging.getLogger("oncely.broker")

CONTENT_TYPE_FIELD = "content_type"
CORRELATION_ID_FIELD = "correlation_id"
_WHY_FIELDS = frozenset(
    f.encode() for f in (OUTCOME_HEADER, REASON_HEADER, CONSUMER_HEADER, DELIVERIES_HEADER)
)
_TRANSIENT_CODES = ("LOADING", "BUSY", "READONLY", "TRYAGAIN", "CLUSTERDOWN", "MASTERDOWN")
_URL_OPTIONS = (
    "consumer",
    "ack_wait",
    "dead_letter",
    "claim_every",
    "start",
    "delivery_limit",
    "timeout",
    "connect_timeout",
    "body_field",
    "message_id_field",
)
_PRODUCER_URL_OPTIONS = ("maxlen", "timeout", "connect_timeout", "body_field", "message_id_field")

# XAUTOCLAIM, then the delivery count of each claimed entry, in one step: nobody can claim an
# entry between the two. Deleted entries (trimmed while pending) are dropped from the pending
# list by XAUTOCLAIM itself (Redis 7) and come back as the fourth element.
_CLAIM = """
local r = redis.call('XAUTOCLAIM', KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4], 'COUNT', ARGV[5])
local entries, counts = {}, {}
for _, e in ipairs(r[2]) do
  if type(e) == 'table' then
    local p = redis.call('XPENDING', KEYS[1], ARGV[1], e[1], e[1], 1)
    local n = 1
    if p[1] then n = p[1][4] end
    table.insert(entries, e)
    table.insert(counts, n)
  end
end
return {r[1], entries, counts, r[3] or {}}
"""

# Set the idle time of an entry this consumer still owns: 0 to extend it, ``ack_wait - delay``
# to make it claimable after ``delay``. JUSTID leaves the delivery count alone.
_SET_IDLE = """
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)
if p[1] == nil or p[1][2] ~= ARGV[2] then return 0 end
redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[3], 'IDLE', ARGV[4], 'JUSTID')
return 1
"""

# Copy an entry this consumer still owns to the dead-letter stream and acknowledge it, as one
# atomic step. Returns the copy's entry id, or nil when another consumer owns the entry now.
_DEAD_LETTER = """
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)
if p[1] == nil or p[1][2] ~= ARGV[2] then return false end
local id = redis.call('XADD', KEYS[2], '*', unpack(ARGV, 4))
redis.call('XACK', KEYS[1], ARGV[1], ARGV[3])
return id
"""

# Remove this consumer from the group if it holds no pending entries (deleting a consumer
# that holds some would orphan them).
_LEAVE = """
local p = redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[2])
if #p > 0 then return 0 end
return redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
"""


def _ms(value: timedelta) -> int:
    return max(0, int(value.total_seconds() * 1000))


def _text(value: bytes) -> str:
    return value.decode("utf-8", "replace")


def _default_consumer() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


def _plain_url(url: str) -> str:
    """``url`` without its query (the options are the transport's, not redis-py's)."""
    parts = split(url)
    if parts.scheme.lower() not in ("redis", "rediss"):
        raise ConfigurationError(f"{redact(url)}: a Redis Streams URL starts with redis://")
    return urlunsplit(parts._replace(query="", fragment=""))


def _client(url: str, timeout: timedelta, connect_timeout: timedelta) -> redis.asyncio.Redis:
    # No retries inside redis-py: the consumer loop reconnects with its own backoff, and a
    # producer's caller retries with the same message id.
    return redis.asyncio.Redis.from_url(
        _plain_url(url),
        decode_responses=False,
        socket_timeout=timeout.total_seconds(),
        socket_connect_timeout=connect_timeout.total_seconds(),
        retry=Retry(NoBackoff(), 0),
    )


def _check_name(what: str, value: str) -> str:
    if not isinstance(value, str) or not value or value.strip() != value:
        raise ConfigurationError(f"{what} must be a non-empty name without surrounding spaces")
    return value


def _check_field(what: str, value: str) -> str:
    _check_name(what, value)
    if value.lower() in TRANSPORT_FIELDS:
        raise ConfigurationError(
            f"{what} {value!r} names per-delivery transport data, which changes on redelivery (R4)"
        )
    return value


class _Translated:
    """Turns redis-py's exceptions into oncely's at the boundary."""

    def __init__(self, where: str) -> None:
        self.where = where

    @contextlib.contextmanager
    def errors(self, doing: str, on_missing: Any = None) -> Iterator[None]:
        try:
            yield
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            raise BrokerUnavailable(f"{self.where}: could not {doing}: {exc}") from exc
        except ResponseError as exc:
            text = str(exc)
            if text.startswith("NOGROUP"):
                if on_missing is not None:
                    on_missing()
                raise BrokerUnavailable(
                    f"{self.where}: could not {doing}: the stream or its group is gone "
                    f"(a restart without persistence?); it is created again ({text})"
                ) from exc
            if text.startswith(_TRANSIENT_CODES):
                raise BrokerUnavailable(f"{self.where}: could not {doing}: {text}") from exc
            raise BrokerError(f"{self.where}: could not {doing}: {text}") from exc
        except RedisError as exc:
            raise BrokerError(f"{self.where}: could not {doing}: {exc}") from exc


class RedisStreamsDelivery:
    """One entry delivered to this consumer, pending in the group until settled."""

    __slots__ = ("_count", "_envelope", "_fields", "_id", "_settled", "_transport")

    def __init__(
        self,
        transport: RedisStreams,
        entry_id: bytes,
        fields: Sequence[tuple[bytes, bytes]],
        count: int,
    ) -> None:
        self._transport = transport
        self._id = entry_id
        self._fields = fields
        self._count = count
        self._settled = False
        self._envelope = transport._envelope(entry_id, fields, count)

    @property
    def envelope(self) -> Envelope:
        return self._envelope

    @property
    def delivery_count(self) -> int:
        return self._count

    @property
    def entry_id(self) -> str:
        return _text(self._id)

    @property
    def fields(self) -> Sequence[tuple[bytes, bytes]]:
        """The entry's fields as stored, in order."""
        return self._fields

    def describe(self) -> Mapping[str, object]:
        return self._envelope.transport

    async def ack(self) -> None:
        """``XACK`` the entry."""
        await self._transport._ack(self._id)
        self._done()

    async def retry(self, delay: timedelta) -> None:
        """Leave the entry pending, claimable by any consumer's ``XAUTOCLAIM`` once ``delay``
        has passed (its idle time set to ``ack_wait - delay``)."""
        await self._transport._set_idle(self._id, self._transport._ack_wait_ms - _ms(delay))
        self._done()

    async def extend(self) -> None:
        """Reset the entry's idle time, so ``XAUTOCLAIM`` leaves it alone for ``ack_wait``."""
        await self._transport._set_idle(self._id, 0)

    async def dead_letter(self, why: DeadLetter) -> None:
        """Copy the entry with ``why`` to the dead-letter stream and ``XACK`` it, atomically."""
        await self._transport._dead_letter(self._id, self._fields, why)
        self._done()

    def _done(self) -> None:
        self._settled = True
        self._transport._held.pop(self._id, None)


class RedisStreams:
    """Reads the stream ``stream`` as consumer ``consumer`` of the group ``group``.

    ``ack_wait`` is how long an entry may sit unacknowledged and unextended before another
    consumer takes it over (``XAUTOCLAIM`` minimum idle time; running handlers extend it
    every ``ack_wait / 3``). ``claim_every`` is how often that takeover runs, which also
    bounds how late a retried entry comes back. ``start="all"`` creates a missing group at the
    start of the stream, ``"new"`` at its end. ``delivery_limit`` dead-letters an entry
    claimed more often than that (``None``: no limit besides ``max_deliveries``).
    ``timeout`` and ``connect_timeout`` bound each Redis call. See the module docstring for
    the entry layout and the broker actions.
    """

    def __init__(
        self,
        url: str,
        stream: str,
        *,
        group: str,
        consumer: str | None = None,
        dead_letter: str | None = None,
        ack_wait: timedelta = timedelta(seconds=30),
        claim_every: timedelta = timedelta(seconds=1),
        start: Literal["all", "new"] = "all",
        delivery_limit: int | None = None,
        timeout: timedelta = timedelta(seconds=10),
        connect_timeout: timedelta = timedelta(seconds=5),
        body_field: str = "body",
        message_id_field: str = "message_id",
    ) -> None:
        self._url = url
        _plain_url(url)
        self.stream = _check_name("stream", stream)
        self.group = _check_name("group", group)
        self.consumer = _check_name(
            "consumer", consumer if consumer is not None else _default_consumer()
        )
        self.dead_letter_stream = _check_name(
            "dead_letter", dead_letter if dead_letter is not None else f"{stream}.dead"
        )
        if self.dead_letter_stream == self.stream:
            raise ConfigurationError("the dead-letter stream must differ from the stream")
        if ack_wait < timedelta(milliseconds=100):
            raise ConfigurationError("ack_wait must be at least 100 milliseconds")
        if claim_every <= timedelta(0):
            raise ConfigurationError("claim_every must be positive")
        if timeout < timedelta(milliseconds=200) or connect_timeout <= timedelta(0):
            raise ConfigurationError("timeout must be at least 200 ms, connect_timeout positive")
        if start not in ("all", "new"):
            raise ConfigurationError("start must be 'all' or 'new'")
        if delivery_limit is not None and delivery_limit < 1:
            raise ConfigurationError("delivery_limit must be at least 1 (or None)")
        self.ack_wait = ack_wait
        self.claim_every = claim_every
        self.delivery_limit = delivery_limit
        self._start = "0" if start == "all" else "$"
        self._timeout = timeout
        self._connect_timeout = connect_timeout
        self._body_field = _check_field("body_field", body_field).encode()
        self._id_field = _check_field("message_id_field", message_id_field).encode()
        if self._body_field == self._id_field:
            raise ConfigurationError("body_field and message_id_field must differ")
        self._reserved = frozenset(
            {
                self._body_field,
                self._id_field,
                CONTENT_TYPE_FIELD.encode(),
                CORRELATION_ID_FIELD.encode(),
            }
        )
        self._ack_wait_ms = _ms(ack_wait)
        self._where = f"redis-streams {redact(url)} stream {stream!r} group {group!r}"
        self._errors = _Translated(self._where).errors
        self._client: redis.asyncio.Redis | None = None
        self._scripts: dict[str, Any] = {}
        self._declared = False
        self._stopped = False
        self._prefetch = 1
        self._cursor = b"0-0"
        self._next_claim = 0.0
        self._held: dict[bytes, RedisStreamsDelivery] = {}

    @classmethod
    def from_url(
        cls,
        url: str,
        source: str,
        *,
        group: str,
        dead_letter: str | None = None,
        ack_wait: timedelta | None = None,
    ) -> RedisStreams:
        """The transport for ``redis://host:port/db?options`` reading the stream ``source``.
        Options: ``consumer``, ``ack_wait`` and ``claim_every`` (seconds), ``dead_letter``,
        ``start`` (all or new), ``delivery_limit``, ``timeout`` and ``connect_timeout``
        (seconds), ``body_field``, ``message_id_field``. Keyword arguments win over options."""
        options = UrlOptions(url)
        consumer = options.optional_text("consumer")
        wait = options.seconds("ack_wait", timedelta(seconds=30))
        dead = options.optional_text("dead_letter")
        claim_every = options.seconds("claim_every", timedelta(seconds=1))
        start: Literal["all", "new"] = (
            "all" if options.choice("start", "all", ("all", "new")) == "all" else "new"
        )
        limit = options.integer("delivery_limit", 0)
        timeout = options.seconds("timeout", timedelta(seconds=10))
        connect_timeout = options.seconds("connect_timeout", timedelta(seconds=5))
        body_field = options.text("body_field", "body")
        message_id_field = options.text("message_id_field", "message_id")
        options.done(_URL_OPTIONS)
        return cls(
            url,
            source,
            group=group,
            consumer=consumer,
            dead_letter=dead_letter if dead_letter is not None else dead,
            ack_wait=ack_wait if ack_wait is not None else wait,
            claim_every=claim_every,
            start=start,
            delivery_limit=limit or None,
            timeout=timeout,
            connect_timeout=connect_timeout,
            body_field=body_field,
            message_id_field=message_id_field,
        )

    def __repr__(self) -> str:
        return f"RedisStreams({self._where}, consumer {self.consumer!r})"

    # ------------------------------------------------------------------ Transport

    @property
    def name(self) -> str:
        return "redis-streams"

    @property
    def extend_every(self) -> timedelta:
        return self.ack_wait / 3

    async def open(self, prefetch: int) -> None:
        """Connect, create the group (and stream) if missing, and read at most ``prefetch``
        entries per fetch. Raises :class:`~oncely.BrokerUnavailable`."""
        self._prefetch = max(1, prefetch)
        self._stopped = False
        await self._ready()

    async def fetch(self, limit: int, timeout: timedelta) -> list[Delivery]:
        """Entries taken over from stopped consumers (``XAUTOCLAIM``, every ``claim_every``)
        first, then new ones (``XREADGROUP``), up to ``limit``; waits for new ones at most
        ``timeout`` (and no longer than the next takeover is due)."""
        if self._stopped:
            return []
        client = await self._ready()
        limit = max(1, min(limit, self._prefetch))
        loop = asyncio.get_running_loop()
        out: list[Delivery] = []
        if loop.time() >= self._next_claim:
            out.extend(await self._claim(limit))
            self._next_claim = loop.time() + (
                self.claim_every.total_seconds() if self._cursor == b"0-0" else 0.0
            )
        if len(out) < limit:
            block: int | None = None
            if not out:
                wait = min(
                    timeout.total_seconds(),
                    max(0.0, self._next_claim - loop.time()),
                    self._timeout.total_seconds() / 2,
                )
                block = max(1, int(wait * 1000))  # BLOCK 0 would wait forever
            with self._errors("read the stream", self._forget_group):
                reply: Any = await client.xreadgroup(
                    self.group,
                    self.consumer,
                    {self.stream: ">"},
                    count=limit - len(out),
                    block=block,
                )
            for _stream, entries in reply or ():
                for entry_id, fields in entries:
                    out.append(self._deliver(entry_id, list(fields.items()), 1))
        return out

    async def stop(self) -> None:
        """Read no more entries; deliveries handed out can still be settled."""
        self._stopped = True

    async def close(self) -> None:
        """Make the entries still held claimable by other consumers at once, leave the group
        if nothing is pending for this consumer, and close the connection."""
        self._stopped = True
        client, self._client = self._client, None
        if client is None:
            return
        try:
            with contextlib.suppress(BrokerError):
                for entry_id in list(self._held):
                    with self._errors("give back an entry"):
                        await self._scripts["set_idle"](
                            keys=[self.stream],
                            args=[self.group, self.consumer, entry_id, self._ack_wait_ms],
                            client=client,
                        )
                self._held.clear()
                with self._errors("leave the group"):
                    await self._scripts["leave"](
                        keys=[self.stream], args=[self.group, self.consumer], client=client
                    )
        finally:
            with contextlib.suppress(RedisError, OSError):
                await client.aclose()

    # ------------------------------------------------------------------ plumbing

    async def _ready(self) -> redis.asyncio.Redis:
        client = self._connection()
        if not self._declared:
            with self._errors("create the consumer group"):
                try:
                    await client.xgroup_create(self.stream, self.group, self._start, mkstream=True)
                except ResponseError as exc:
                    if not str(exc).startswith("BUSYGROUP"):
                        raise
                # Visible in XINFO CONSUMERS from the start, not only after a first entry.
                await client.xgroup_createconsumer(self.stream, self.group, self.consumer)
            self._declared = True
        return client

    def _connection(self) -> redis.asyncio.Redis:
        if self._client is None:
            client = _client(self._url, self._timeout, self._connect_timeout)
            self._scripts = {
                "claim": client.register_script(_CLAIM),
                "set_idle": client.register_script(_SET_IDLE),
                "dead_letter": client.register_script(_DEAD_LETTER),
                "leave": client.register_script(_LEAVE),
            }
            self._client = client
        return self._client

    def _forget_group(self) -> None:
        self._declared = False

    def _deliver(
        self, entry_id: bytes, fields: Sequence[tuple[bytes, bytes]], count: int
    ) -> RedisStreamsDelivery:
        delivery = RedisStreamsDelivery(self, entry_id, fields, count)
        self._held[entry_id] = delivery
        return delivery

    def _envelope(
        self, entry_id: bytes, fields: Sequence[tuple[bytes, bytes]], count: int
    ) -> Envelope:
        values = dict(fields)
        headers = {_text(k): _text(v) for k, v in fields if k not in self._reserved}
        message_id = values.get(self._id_field)
        correlation_id = values.get(CORRELATION_ID_FIELD.encode())
        content_type = values.get(CONTENT_TYPE_FIELD.encode())
        transport: dict[str, object] = {
            "stream": self.stream,
            "entry_id": _text(entry_id),
            "consumer": self.consumer,
            "delivery_count": count,
            "redelivered": count > 1,
        }
        if content_type is not None:
            transport["content_type"] = _text(content_type)
        return Envelope(
            body=values.get(self._body_field, b""),
            message_id=_text(message_id) if message_id else None,
            headers=headers,
            correlation_id=_text(correlation_id) if correlation_id else None,
            delivery_count=count,
            transport=transport,
        )

    async def _claim(self, limit: int) -> list[Delivery]:
        client = self._connection()
        with self._errors("take over pending entries", self._forget_group):
            reply = await self._scripts["claim"](
                keys=[self.stream],
                args=[self.group, self.consumer, self._ack_wait_ms, self._cursor, limit],
                client=client,
            )
        cursor, entries, counts, deleted = reply
        self._cursor = cursor
        if deleted:
            LOGGER.warning(
                "oncely broker=redis-streams %d pending entries of stream %r were deleted "
                "(trimmed) before anyone acknowledged them: %s",
                len(deleted),
                self.stream,
                ", ".join(_text(d) for d in deleted),
            )
        out: list[Delivery] = []
        for (entry_id, flat), count in zip(entries, counts, strict=True):
            fields = list(zip(flat[::2], flat[1::2], strict=True))
            delivery = self._deliver(entry_id, fields, int(count))
            if self.delivery_limit is not None and delivery.delivery_count > self.delivery_limit:
                why = DeadLetter(
                    outcome="rejected",
                    reason=(
                        f"delivered {delivery.delivery_count} times, over the delivery limit "
                        f"of {self.delivery_limit}, without being settled (its consumers "
                        "stopped or crashed while handling it)"
                    ),
                    consumer=self.consumer,
                    deliveries=delivery.delivery_count,
                )
                LOGGER.error(
                    "oncely broker=redis-streams action=dead_letter entry_id=%s: %s",
                    delivery.entry_id,
                    why.reason,
                )
                await delivery.dead_letter(why)
                continue
            out.append(delivery)
        return out

    async def _ack(self, entry_id: bytes) -> None:
        client = self._settling()
        with self._errors("acknowledge an entry"):
            await client.xack(self.stream, self.group, entry_id)

    async def _set_idle(self, entry_id: bytes, idle_ms: int) -> None:
        client = self._settling()
        with self._errors("set an entry's idle time"):
            owned = await self._scripts["set_idle"](
                keys=[self.stream],
                args=[self.group, self.consumer, entry_id, max(0, idle_ms)],
                client=client,
            )
        if not owned:
            LOGGER.info(
                "oncely broker=redis-streams entry %s of %r is no longer held by %r (taken "
                "over or settled); left to its owner",
                _text(entry_id),
                self.stream,
                self.consumer,
            )

    async def _dead_letter(
        self, entry_id: bytes, fields: Sequence[tuple[bytes, bytes]], why: DeadLetter
    ) -> None:
        client = self._settling()
        args: list[bytes | str | int] = [self.group, self.consumer, entry_id]
        for name, value in fields:
            if name not in _WHY_FIELDS:
                args += [name, value]
        for header, text in why.headers().items():
            args += [header, text]
        with self._errors("dead-letter an entry"):
            copied = await self._scripts["dead_letter"](
                keys=[self.stream, self.dead_letter_stream], args=args, client=client
            )
        if copied is None:
            LOGGER.info(
                "oncely broker=redis-streams entry %s of %r is no longer held by %r; not "
                "dead-lettered here (its owner settles it)",
                _text(entry_id),
                self.stream,
                self.consumer,
            )

    def _settling(self) -> redis.asyncio.Redis:
        if self._client is None:
            raise BrokerUnavailable(f"{self._where}: the transport is closed")
        return self._client


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
        _plain_url(url)
        self.stream = _check_name("stream", stream)
        if maxlen is not None and maxlen < 1:
            raise ConfigurationError("maxlen must be at least 1 (or None)")
        self.maxlen = maxlen
        self._body_field = _check_field("body_field", body_field)
        self._id_field = _check_field("message_id_field", message_id_field)
        self._reserved = frozenset(
            {self._body_field, self._id_field, CONTENT_TYPE_FIELD, CORRELATION_ID_FIELD}
        )
        self._errors = _Translated(f"redis-streams {redact(url)} stream {stream!r}").errors
        self._client = _client(url, timeout, connect_timeout)

    @classmethod
    def from_url(cls, url: str, destination: str) -> RedisStreamsProducer:
        """The producer for ``redis://host:port/db?options`` writing to the stream
        ``destination``. Options: ``maxlen``, ``timeout`` and ``connect_timeout`` (seconds),
        ``body_field``, ``message_id_field``."""
        options = UrlOptions(url)
        maxlen = options.integer("maxlen", 0)
        timeout = options.seconds("timeout", timedelta(seconds=10))
        connect_timeout = options.seconds("connect_timeout", timedelta(seconds=5))
        body_field = options.text("body_field", "body")
        message_id_field = options.text("message_id_field", "message_id")
        options.done(_PRODUCER_URL_OPTIONS)
        return cls(
            url,
            destination,
            maxlen=maxlen or None,
            timeout=timeout,
            connect_timeout=connect_timeout,
            body_field=body_field,
            message_id_field=message_id_field,
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
        """``XADD`` one entry; returns once Redis has replied with its entry id. Retrying after
        :class:`~oncely.BrokerUnavailable` with the same ``message_id`` may write a second
        entry, which consumers answer as a duplicate (R2, R14)."""
        if not message_id:
            raise ConfigurationError("publish needs a non-empty message_id")
        fields: dict[str | bytes, bytes | str] = {self._body_field: bytes(body)}
        fields[self._id_field] = message_id
        if content_type:
            fields[CONTENT_TYPE_FIELD] = content_type
        if correlation_id is not None:
            fields[CORRELATION_ID_FIELD] = correlation_id
        for name, value in (headers or {}).items():
            if name in self._reserved:
                raise ConfigurationError(
                    f"header {name!r} collides with a field of the entry layout; pass it as "
                    "an argument or rename it"
                )
            fields[name] = value
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
