"""The Redis Streams transport: one consumer of a consumer group, reading new entries and
taking over those its peers left pending."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import socket
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Literal

import redis.asyncio
from redis.exceptions import RedisError, ResponseError

from oncely._urls import UrlOptions, redact
from oncely.brokers._shape import (
    BrokerLimits,
    DeadLetter,
    Delivery,
)
from oncely.brokers.redis_streams import _scripts
from oncely.brokers.redis_streams._delivery import RedisStreamsDelivery
from oncely.brokers.redis_streams._layout import (
    CONSUMER_URL_OPTIONS,
    LOGGER,
    PRODUCER_URL_OPTIONS,
    SHARED_URL_OPTIONS,
    EntryLayout,
    Translated,
    as_text,
    check_name,
    ms,
    open_client,
    plain_url,
    shared_options,
)
from oncely.errors import BrokerError, BrokerUnavailable, ConfigurationError
from oncely.stores.redis.async_io import eviction_policies

DEFAULT_PRUNE_IDLE_CONSUMERS = timedelta(hours=1)
"""How long a consumer of the group may sit idle, holding no pending entries, before a
transport deletes it (see :class:`RedisStreams`)."""

_URL_OPTIONS = (*CONSUMER_URL_OPTIONS, *SHARED_URL_OPTIONS)


def _entry_order(entry_id: bytes) -> tuple[int, int]:
    """A stream entry id (``1718000000000-0``) as a pair that sorts as Redis orders ids."""
    ms_part, _, seq = entry_id.partition(b"-")
    return int(ms_part), int(seq or b"0")


def _as_sent(response: Any, **_options: Any) -> Any:
    return response


def _entries(reply: Any) -> list[tuple[bytes, Sequence[bytes]]]:
    """The ``(entry id, flat field list)`` of each entry of an ``XREADGROUP`` reply as Redis
    sent it: a list of ``[stream, entries]`` (RESP2) or a map of stream to entries (RESP3)."""
    streams = reply.items() if isinstance(reply, dict) else (reply or ())
    return [(entry[0], entry[1] or ()) for _stream, entries in streams for entry in entries]


def _pairs(flat: Sequence[bytes]) -> list[tuple[bytes, bytes]]:
    """A stream entry's fields, every one in order (a name may repeat)."""
    return list(zip(flat[::2], flat[1::2], strict=True))


def _default_consumer() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


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

    Housekeeping: a consumer that never closed (its process was killed) stays registered in
    the group. When the transport opens, and then every ``prune_idle_consumers``, it deletes
    the group's consumers that hold no pending entries and have been idle (``XINFO
    CONSUMERS``) for longer than ``prune_idle_consumers`` (``XGROUP DELCONSUMER``, checked
    and done in one script). A consumer that still holds entries is never deleted: once
    ``XAUTOCLAIM`` has taken them over it holds none and goes at the next round. A running
    consumer reads every few seconds and is never idle that long; should one be deleted all
    the same (say after a long outage), its next read registers it again. ``None`` keeps
    every consumer.

    Memory: a Redis whose ``maxmemory-policy`` is ``allkeys-*`` evicts streams (keys without
    an expiry) once ``maxmemory`` is reached, and their messages with them. The transport
    reads the policy (``INFO memory``) when it opens and refuses such a server with
    :class:`~oncely.ConfigurationError`, unless ``allow_eviction`` is true. The
    ``volatile-*`` policies evict only keys with an expiry, which streams have not.
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
        prune_idle_consumers: timedelta | None = DEFAULT_PRUNE_IDLE_CONSUMERS,
        allow_eviction: bool = False,
    ) -> None:
        self._url = url
        self._allow_eviction = allow_eviction
        plain_url(url)
        self.stream = check_name("stream", stream)
        self.group = check_name("group", group)
        self.inbox_consumer = self.group
        """What this transport's own dead letters record in ``x-oncely-consumer``."""
        self.consumer = check_name(
            "consumer", consumer if consumer is not None else _default_consumer()
        )
        self.dead_letter_stream = check_name(
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
        if prune_idle_consumers is not None and prune_idle_consumers <= timedelta(0):
            raise ConfigurationError("prune_idle_consumers must be positive (or None)")
        self.ack_wait = ack_wait
        self.claim_every = claim_every
        self.delivery_limit = delivery_limit
        self.prune_idle_consumers = prune_idle_consumers
        self._start = "0" if start == "all" else "$"
        self._last_read: tuple[int, int] | None = None
        """The newest entry id this transport read (XREADGROUP), to tell a stream deleted
        and written again from the one it read (see :meth:`_restart_from`)."""
        self._timeout = timeout
        self._connect_timeout = connect_timeout
        self._layout = EntryLayout(body_field, message_id_field)
        self._ack_wait_ms = ms(ack_wait)
        self._where = f"redis-streams {redact(url)} stream {stream!r} group {group!r}"
        self._errors = Translated(self._where).errors
        self._client: redis.asyncio.Redis | None = None
        self._scripts: dict[str, Any] = {}
        self._declared = False
        self._stopped = False
        self._prefetch = 1
        self._cursor = b"0-0"
        self._next_claim = 0.0
        self._next_prune = 0.0
        self._held: dict[bytes, RedisStreamsDelivery] = {}

    def set_inbox_consumer(self, consumer: str) -> None:
        """The inbox consumer name that the dead letters this transport writes by itself
        (an entry taken over more often than ``delivery_limit``) record in
        ``x-oncely-consumer``, as every other dead letter does;
        :class:`~oncely.brokers.BrokerConsumer` gives it. Until then, the group's name (never
        this process's Redis consumer name)."""
        self.inbox_consumer = consumer

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
        ``start`` (all or new), ``delivery_limit``, ``prune_idle_consumers`` (seconds, 0 for
        never), ``allow_eviction`` (true or false), ``timeout`` and ``connect_timeout``
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
        prune = options.seconds("prune_idle_consumers", DEFAULT_PRUNE_IDLE_CONSUMERS)
        allow_eviction = options.boolean("allow_eviction", False)
        shared = shared_options(options)
        options.done(_URL_OPTIONS, theirs=PRODUCER_URL_OPTIONS, side=("producer", "consumer"))
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
            prune_idle_consumers=prune if prune > timedelta(0) else None,
            allow_eviction=allow_eviction,
            **shared,
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

    @property
    def limits(self) -> BrokerLimits:
        """The horizon's inputs: an entry idle for ``ack_wait`` is taken over by the next
        claim round (up to ``claim_every`` later); the delivery limit; no time-to-live (a
        stream is trimmed by length, if at all, never by age)."""
        return BrokerLimits(
            ack_wait=self.ack_wait + self.claim_every,
            max_deliveries=self.delivery_limit,
            source="Redis Streams ack_wait + claim_every, delivery_limit",
        )

    async def open(self, prefetch: int) -> None:
        """Connect, create the group (and stream) if missing, delete the group's long idle
        consumers (see the class docstring), and read at most ``prefetch`` entries per fetch.
        Raises :class:`~oncely.BrokerUnavailable`."""
        self._prefetch = max(1, prefetch)
        self._stopped = False
        await self._prune(await self._ready())

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
        if loop.time() >= self._next_prune:
            await self._prune(client)
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
            for entry_id, flat in _entries(reply):
                out.append(self._deliver(entry_id, _pairs(flat), 1))
                self._read_up_to(entry_id)
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
            await self._check_eviction(client)
            with self._errors("create the consumer group"):
                try:
                    await client.xgroup_create(
                        self.stream, self.group, await self._restart_from(client), mkstream=True
                    )
                except ResponseError as exc:
                    if not str(exc).startswith("BUSYGROUP"):
                        raise
                # Visible in XINFO CONSUMERS from the start, not only after a first entry.
                await client.xgroup_createconsumer(self.stream, self.group, self.consumer)
            self._declared = True
        return client

    async def _check_eviction(self, client: redis.asyncio.Redis) -> None:
        """Refuse a Redis that evicts keys without an expiry when its memory is full (an
        ``allkeys-*`` policy): the stream, its group and its pending entries are such keys,
        and an evicted stream is every message in it lost, with nothing said."""
        if self._allow_eviction:
            return
        with self._errors("read the server's maxmemory-policy"):
            try:
                found = await eviction_policies(client)
            except ResponseError as exc:  # INFO refused (an ACL, a renamed command)
                LOGGER.warning(
                    "oncely broker=redis-streams %s: could not read the server's "
                    "maxmemory-policy (%s): make sure it is not allkeys-*, which evicts streams",
                    self._where,
                    exc,
                )
                return
        for policy, limit in found:
            if policy.startswith("allkeys-") and limit > 0:
                raise ConfigurationError(
                    f"{self._where}: the server evicts keys when its memory is full "
                    f"(maxmemory-policy {policy}, maxmemory {limit} bytes), streams "
                    "included: an evicted stream is its messages lost, silently. Set "
                    "maxmemory-policy noeviction (a full Redis then refuses new entries, "
                    "and the producer's caller retries), or give the streams a Redis of "
                    "their own; allow_eviction=true accepts the risk"
                )

    def _connection(self) -> redis.asyncio.Redis:
        if self._client is None:
            client = open_client(self._url, self._timeout, self._connect_timeout)
            self._scripts = {
                "claim": client.register_script(_scripts.CLAIM),
                "set_idle": client.register_script(_scripts.SET_IDLE),
                "dead_letter": client.register_script(_scripts.DEAD_LETTER),
                "leave": client.register_script(_scripts.LEAVE),
                "prune": client.register_script(_scripts.PRUNE),
            }
            # The reply as Redis sent it: redis-py makes each entry's fields a dict, which
            # keeps one of the fields an entry repeats (XADD s * a 1 a 2) and drops the rest.
            client.set_response_callback("XREADGROUP", _as_sent)
            self._client = client
        return self._client

    async def _prune(self, client: redis.asyncio.Redis) -> None:
        """Delete the group's consumers idle past ``prune_idle_consumers`` that hold nothing."""
        after = self.prune_idle_consumers
        if after is None:
            return
        self._next_prune = asyncio.get_running_loop().time() + after.total_seconds()
        try:
            with self._errors("delete idle consumers", self._forget_group):
                gone = await self._scripts["prune"](
                    keys=[self.stream], args=[self.group, ms(after), self.consumer], client=client
                )
        except BrokerUnavailable:
            raise
        except BrokerError as exc:  # housekeeping only: reading goes on without it
            LOGGER.warning("oncely broker=redis-streams %s", exc)
            return
        if gone:
            LOGGER.info(
                "oncely broker=redis-streams deleted %d consumers of group %r idle for over "
                "%s with nothing pending: %s",
                len(gone),
                self.group,
                after,
                ", ".join(as_text(name) for name in gone),
            )

    def _forget_group(self) -> None:
        self._declared = False

    def _read_up_to(self, entry_id: bytes) -> None:
        read = _entry_order(entry_id)
        if self._last_read is None or read > self._last_read:
            self._last_read = read

    async def _restart_from(self, client: redis.asyncio.Redis) -> str:
        """Where to create the group: ``start``; but with ``start="new"``, once this
        transport has read the stream, ``0`` when every entry now in it is newer than the
        last one it read (the stream was deleted and a producer wrote it again). ``$`` then
        would skip what the producer wrote before the group was made again: lost without
        a word."""
        if self._start == "0" or self._last_read is None:
            return self._start
        first: Any = await client.xrange(self.stream, count=1)
        if first and _entry_order(first[0][0]) <= self._last_read:
            return self._start  # the stream it read: its group alone was lost
        return "0"

    def _deliver(
        self, entry_id: bytes, fields: Sequence[tuple[bytes, bytes]], count: int
    ) -> RedisStreamsDelivery:
        delivery = RedisStreamsDelivery(self, entry_id, fields, count)
        self._held[entry_id] = delivery
        return delivery

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
                ", ".join(as_text(d) for d in deleted),
            )
        out: list[Delivery] = []
        for (entry_id, flat), count in zip(entries, counts, strict=True):
            delivery = self._deliver(entry_id, _pairs(flat), int(count))
            if self.delivery_limit is not None and delivery.delivery_count > self.delivery_limit:
                why = DeadLetter(
                    outcome="rejected",
                    reason=(
                        f"delivered {delivery.delivery_count} times, over the delivery limit "
                        f"of {self.delivery_limit}, without being settled (its consumers "
                        "stopped or crashed while handling it)"
                    ),
                    consumer=self.inbox_consumer,
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

    def _settling(self) -> redis.asyncio.Redis:
        if self._client is None:
            raise BrokerUnavailable(f"{self._where}: the transport is closed")
        return self._client
