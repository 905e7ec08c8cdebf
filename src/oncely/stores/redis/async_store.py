"""The Redis store: one Lua script per operation, on a single Redis or a Redis Cluster.

Every operation of the contract is one atomic script (:mod:`oncely.stores.redis.lua`) sent
with ``EVALSHA``: a new key costs one round trip to claim and one to complete, a duplicate one. A
batch claim is one round trip on a single Redis and one per node, sent to all at once, on a
cluster. Time is the server's (``TIME`` inside each script) unless the store is given a clock;
retention is Redis's own key expiry. The scripts answer with as little as the client needs
(the record it already knows is built here, from the call's own arguments), because parsing a
reply costs the client more than the server's work.

:class:`AsyncRedisStore` is one class, in sections: construction and connections (building or
adopting the client, closing); sending scripts (``EVALSHA`` with driver errors translated, a
batch grouped by hash slot on a cluster, records read in bulk); the schema marker; the message
path (the claim, the fenced writes); reads and maintenance (``SCAN``-based, for operators).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any, Self

from oncely._core.clock import Clock
from oncely._core.forking import forget_parent_in_children
from oncely._core.records import Claim, ClaimRequest, Completion, Record, Status, StoreStats
from oncely._core.state import Lost
from oncely._core.table import lease_lost
from oncely._twin import ASYNC
from oncely._urls import redact
from oncely.errors import ConfigurationError, LeaseLost, SchemaMissing, SchemaTooNew, StoreError
from oncely.stores._sql import read_version
from oncely.stores.redis.async_io import (
    SCAN_START,
    Client,
    Runner,
    close,
    connect,
    decodes_responses,
    describe,
    evalsha_many,
    eviction_policies,
    hget,
    hsetnx,
    is_client,
    is_cluster,
    scan_page,
    server_time_ms,
    unlink,
)
from oncely.stores.redis.dialect import (
    CLAIM,
    CLAIM_MANY,
    COMPLETE,
    FAIL,
    FORGET,
    GET,
    PURGE,
    READ,
    RELEASE,
    RENEW,
    SCHEMA_VERSION,
    RedisKeys,
    Script,
    opt,
    parse_batch,
    parse_claim,
    parse_reply,
    parse_stored,
    parse_written,
    stored_status,
)
from oncely.stores.redis.errors import (
    DRIVER_ERRORS,
    RedisOptions,
    parse_url,
    refused_command,
    slot_of,
    translate,
)

__all__ = ["AsyncRedisStore"]

LOGGER = logging.getLogger("oncely.store")

_VERSION_FIELD = b"schema_version"
# Keys per script in a batch on a single Redis (a longer script blocks the server longer), and
# keys per SCAN step for stats, scan and purge (memory stays bounded by this and ``limit``).
_BATCH = 500
# Redis refuses an argument over proto-max-bulk-len (512 MB unless configured otherwise), and
# a string over 512 MB: a result is kept up to that, less room for the record's other fields.
_RESULT_ROOM = 512 * 1024 * 1024 - 64 * 1024
_ROOM = (
    _RESULT_ROOM,
    "Redis takes at most 512 MB in one argument (proto-max-bulk-len) and one string",
)
# Keys drawn by stats(exact=False) (RANDOMKEY, pipelined on a single Redis).
_SAMPLE = 2000


class AsyncRedisStore:
    """A dedup store in Redis or a Redis Cluster (two-phase mode only).

    ``client`` is a redis-py ``Redis`` or ``RedisCluster`` (from ``redis.asyncio`` for the
    asyncio store) made with ``decode_responses=False`` (results are bytes); the caller keeps
    owning it and closes it. :meth:`from_url` builds and owns one. Every key starts with
    ``prefix`` (a plain identifier), so several stores can share a server.

    Redis cannot join a SQL transaction, so this store has no transactional mode:
    ``Inbox.handle_in_transaction`` raises :class:`~oncely.TransactionsUnsupported`. Use the
    two-phase mode (``Inbox.handle``, R10): a claim, the handler, then a completion, with a
    reconciler (``on_stale``) for a worker that died in between.

    Time is Redis's own clock, read inside every script, and each record expires by itself
    (``PXAT``) at the end of its retention. With ``clock`` (a :class:`~oncely.FakeClock`
    in tests) that clock decides instead, records get no Redis expiry (it would follow the
    wrong clock) and :meth:`purge_expired` deletes them.

    Durability is the server's. A Redis without persistence forgets every record when it
    restarts: a message redelivered after that, or one whose handler ran while it went down,
    is processed again. ``appendonly yes`` with ``appendfsync always`` keeps every record a
    reply confirmed (``everysec`` may lose the last second), and a failover may lose the
    writes the replica had not yet received (replication is asynchronous).

    So is memory. A Redis that evicts keys when it reaches ``maxmemory`` (any
    ``maxmemory-policy`` but ``noeviction``; the ``volatile-*`` ones too, as records expire)
    drops records before their retention ends, and a redelivery of their messages runs them
    again. The store reads the policy (``INFO memory``, of each primary of a cluster) when
    it is first used and refuses such a server with :class:`~oncely.ConfigurationError`,
    unless opened with ``allow_eviction=True``. Under ``noeviction`` a full Redis refuses new
    claims with :class:`~oncely.StoreUnavailable`, which consumers retry.

    A schema marker (``<prefix>:meta``) is written on first use unless ``migrate=False``, in
    which case its absence raises :class:`~oncely.SchemaMissing`. The asyncio variant belongs
    to the event loop that first uses it (as its client does): open one store per loop. The
    threaded variant may be shared by any number of threads.
    """

    supports_transactions = False

    # ------------------------------------------------------------ construction and connections

    def __init__(
        self,
        client: Client,
        *,
        prefix: str = "oncely",
        clock: Clock | None = None,
        migrate: bool = True,
        allow_eviction: bool = False,
    ) -> None:
        self._setup(prefix, clock, migrate, allow_eviction)
        if not is_client(client):
            raise ConfigurationError(
                f"{type(self).__name__} needs a redis-py client of its own kind (sync or "
                f"asyncio, single or cluster), not {type(client).__name__}; for a URL use "
                f"{type(self).__name__}.from_url"
            )
        if decodes_responses(client):
            raise ConfigurationError(
                "the Redis client decodes replies (decode_responses=True), but results are "
                "bytes: give the store a client made with decode_responses=False"
            )
        self._client = client
        self._runner = Runner(client)
        self._eval = self._runner.run
        self._has_client = True
        self._cluster = is_cluster(client)
        base = describe(client)
        self._where = base  # the server, for messages (as PostgreSQL's name theirs)
        self._url = f"{base}{'&' if '?' in base else '?'}prefix={prefix}"

    def _setup(self, prefix: str, clock: Clock | None, migrate: bool, allow_eviction: bool) -> None:
        self._keys = RedisKeys(prefix)
        self._clock = clock
        self._auto_migrate = migrate
        self._allow_eviction = allow_eviction
        self._options: RedisOptions | None = None  # set when the store builds its own client
        self._has_client = False
        self._ready_lock = asyncio.Lock()
        self._ready = False
        self._closed = False
        forget_parent_in_children(self)

    def _forget_parent(self) -> None:
        """In a forked child: a lock a thread of the parent may have held at the fork (a
        heartbeat renewing a lease) starts afresh (the connections have a fork hook of their
        own, in ``_redis_io``)."""
        self._ready_lock = asyncio.Lock()

    @classmethod
    def from_url(cls, url: str, *, clock: Clock | None = None) -> Self:
        """A store for a ``redis://`` or ``rediss://`` URL, with the options ``prefix``,
        ``cluster`` (true: a Redis Cluster, the host is any node), ``migrate``,
        ``allow_eviction``, ``max_connections``, ``timeout``, ``connect_timeout`` and
        ``ssl_ca_certs``. The store
        builds and owns its client, on first use: opening a store never waits for the
        server. ``timeout`` bounds every wait for the server; in the threaded store on Linux,
        for one server over ``redis://``, the kernel enforces it (``SO_RCVTIMEO`` and
        ``SO_SNDTIMEO`` on blocking sockets), which spares Python's poll before each send and
        receive."""
        options = parse_url(url)
        store = cls.__new__(cls)
        store._setup(options.prefix, clock, options.migrate, options.allow_eviction)
        store._options = options
        store._cluster = options.cluster
        store._url = redact(url)
        store._where = redact(options.server) + ("?cluster=true" if options.cluster else "")
        return store

    @property
    def url(self) -> str:
        return self._url

    @property
    def prefix(self) -> str:
        return self._keys.prefix

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._url!r})"

    def _connect(self) -> None:
        """Build the client of a store opened from a URL (a cluster client asks a node for
        the slot map here, in the threaded variant)."""
        if self._options is not None and not self._has_client:
            try:
                self._client = connect(self._options)
                self._runner = Runner(self._client, self._options)
                self._eval = self._runner.run
                self._has_client = True
            except DRIVER_ERRORS as exc:
                raise translate(exc, "opening the store", self._where) from exc

    async def _check(self) -> None:
        if self._closed:
            raise StoreError(f"{self!r} is closed")
        if not self._ready:
            await self._prepare()

    async def aclose(self) -> None:
        """Close the client if the store built it (:meth:`from_url`); a client given to the
        store stays open for its owner."""
        if self._closed:
            return
        self._closed = True
        self._ready = False  # every call checks again, and finds the store closed
        if self._options is not None and self._has_client:
            try:
                await self._runner.close()
                await close(self._client)
            except DRIVER_ERRORS as exc:
                raise translate(exc, "closing", self._where) from exc

    # ------------------------------------------------------------ sending scripts

    def _now(self) -> bytes:
        """The scripts' first argument: the clock's reading, or empty for the server's."""
        return b"" if self._clock is None else str(self._clock.now_ms()).encode()

    async def _time(self) -> int:
        if self._clock is not None:
            return self._clock.now_ms()
        try:
            return await server_time_ms(self._client)
        except DRIVER_ERRORS as exc:
            raise translate(exc, "reading the server's clock", self._where) from exc

    async def _run(self, script: Script, name: bytes, args: Sequence[bytes], op: str) -> Any:
        if not self._ready:  # also after aclose: _check raises then
            await self._check()
        try:
            return await self._eval(script, (name,), args)
        except DRIVER_ERRORS as exc:
            raise translate(exc, op, self._where) from exc

    def _groups(self, names: Sequence[bytes]) -> list[list[int]]:
        """Indexes of ``names`` in groups that one script may touch together, each in request
        order: runs of ``_BATCH`` on a single Redis (the pipeline runs them in order, so a
        repeated key still meets its earlier copy first); one group per hash slot on a
        cluster (a repeated key is in its copy's group; other slots are other keys)."""
        if not self._cluster:
            return [
                list(range(i, min(i + _BATCH, len(names)))) for i in range(0, len(names), _BATCH)
            ]
        by_slot: dict[int, list[int]] = {}
        for i, name in enumerate(names):
            by_slot.setdefault(slot_of(name), []).append(i)
        return list(by_slot.values())

    async def _run_groups(
        self, script: Script, calls: list[tuple[list[bytes], list[bytes]]], op: str
    ) -> list[Any]:
        await self._check()
        try:
            if len(calls) == 1:
                return [await self._eval(script, calls[0][0], calls[0][1])]
            return await evalsha_many(self._client, script, calls)
        except DRIVER_ERRORS as exc:
            raise translate(exc, op, self._where) from exc

    async def _scan_page(
        self, where: tuple[int, int], pattern: bytes
    ) -> tuple[tuple[int, int] | None, list[bytes]]:
        try:
            return await scan_page(self._client, where, pattern, _BATCH)
        except DRIVER_ERRORS as exc:
            raise translate(exc, "scanning keys", self._where) from exc

    async def _read(self, names: list[bytes]) -> list[bytes | None]:
        """The stored string of each of ``names``, in order (None where there is none),
        expired or not: one script per group of :meth:`_groups`, in one pipeline."""
        groups = self._groups(names)
        calls: list[tuple[list[bytes], list[bytes]]] = [
            ([names[i] for i in group], []) for group in groups
        ]
        found: list[bytes | None] = [None] * len(names)
        replies = await self._run_groups(READ, calls, "reading records")
        for group, values in zip(groups, replies, strict=True):
            for i, value in zip(group, values, strict=True):
                found[i] = value
        return found

    # ------------------------------------------------------------ the schema marker

    async def prepare(self) -> None:
        """Connect and check the schema marker now (writing it when opened with
        ``migrate=True``), as the first operation would: a consumer calls it at start."""
        if self._closed:
            raise StoreError(f"{self!r} is closed")
        await self._prepare()

    async def _prepare(self) -> None:
        async with self._ready_lock:
            if self._ready:
                return
            self._connect()
            await self._check_eviction()
            version = await self._version()
            if version is None:
                if not self._auto_migrate:
                    raise SchemaMissing(
                        f"no oncely marker {self._keys.meta.decode()!r} at {self._url}; run "
                        "`oncely migrate --store URL` or open the store with migrate=True "
                        "(a Redis without persistence loses it on restart)"
                    )
                await self._create()
            elif version > SCHEMA_VERSION:
                raise SchemaTooNew(
                    f"{self._url} holds oncely schema version {version}; this oncely "
                    f"understands up to {SCHEMA_VERSION}: upgrade oncely"
                )
            self._ready = True

    async def _check_eviction(self) -> None:
        """Refuse a Redis that evicts keys when its memory is full: an evicted record is a
        message processed again when it is redelivered, with nothing said. Every policy but
        ``noeviction`` evicts the store's records (they expire, so the ``volatile-*``
        policies take them too), once ``maxmemory`` is reached."""
        if self._allow_eviction:
            return
        try:
            found = await eviction_policies(self._client)
        except DRIVER_ERRORS as exc:
            if not refused_command(exc):  # no answer at all: say that, not a policy warning
                raise translate(
                    exc, "opening the store (its server's maxmemory-policy)", self._where
                ) from exc
            # INFO refused (an ACL, a renamed command): the policy is unknown.
            LOGGER.warning(
                "oncely store=%s could not read the server's maxmemory-policy (%s): make "
                "sure it is noeviction, or records evicted under memory pressure are "
                "messages processed again",
                self._where,
                exc,
            )
            return
        evicting = sorted({(p, m) for p, m in found if p != "noeviction" and m > 0})
        if evicting:
            policy, limit = evicting[0]
            raise ConfigurationError(
                f"{self._where} evicts keys when its memory is full (maxmemory-policy "
                f"{policy}, maxmemory {limit} bytes): an evicted oncely record is a message "
                "processed again, silently. Set maxmemory-policy noeviction (`CONFIG SET "
                "maxmemory-policy noeviction`, or the service's parameter group): a full "
                "Redis then refuses new claims with StoreUnavailable, which consumers "
                "retry. Give oncely a Redis of its own if other data there must be evicted; "
                "?allow_eviction=true in the URL (allow_eviction=True to the store) accepts the "
                "risk, for a look with `oncely inbox` too"
            )

    async def _version(self) -> int | None:
        try:
            value = await hget(self._client, self._keys.meta, _VERSION_FIELD)
        except DRIVER_ERRORS as exc:
            raise translate(exc, "reading the schema version", self._where) from exc
        return (
            None
            if value is None
            else read_version(value, "schema version", f"store at {self._url}")
        )

    async def _create(self) -> None:
        # HSETNX: several processes migrating at once write the marker once.
        try:
            await hsetnx(self._client, self._keys.meta, _VERSION_FIELD, b"%d" % SCHEMA_VERSION)
        except DRIVER_ERRORS as exc:
            raise translate(exc, "writing the schema version", self._where) from exc

    async def migrate(self) -> int:
        """Write the schema marker if it is missing (idempotent, safe to run from several
        processes at once) and return the schema version."""
        if self._closed:
            raise StoreError(f"{self!r} is closed")
        async with self._ready_lock:
            self._connect()
        await self._check_eviction()
        await self._create()
        version = await self._version()
        if version is not None and version > SCHEMA_VERSION:
            raise SchemaTooNew(
                f"{self._url} holds oncely schema version {version}; this oncely "
                f"understands up to {SCHEMA_VERSION}: upgrade oncely"
            )
        self._ready = True
        return SCHEMA_VERSION

    async def schema_version(self) -> int | None:
        """The schema version marked in Redis, or None when there is no marker yet."""
        async with self._ready_lock:
            self._connect()
        return await self._version()

    # ------------------------------------------------------------ the message path

    async def claim(
        self,
        consumer: str,
        key: str,
        *,
        fingerprint: str | None,
        token: str,
        lease_ms: int,
        keep_ms: int,
        takeover: bool,
    ) -> Claim:
        args = (
            self._now(),
            b"%d" % lease_ms,
            b"%d" % keep_ms,
            b"1" if takeover else b"0",
            b"",
            opt(fingerprint),
            token.encode(),
        )
        reply = await self._run(CLAIM, self._keys.record(consumer, key), args, "claim")
        return parse_claim(consumer, key, fingerprint, token, lease_ms, keep_ms, reply)

    async def claim_many(
        self,
        consumer: str,
        requests: Sequence[ClaimRequest],
        *,
        lease_ms: int,
        keep_ms: int,
        takeover: bool,
    ) -> list[Claim]:
        if not requests:
            return []
        names, tails = self._keys.claim_batch(consumer, requests)
        head = [self._now(), b"%d" % lease_ms, b"%d" % keep_ms, b"1" if takeover else b"0", b""]
        groups = self._groups(names)
        if len(groups) == 1:
            calls = [(names, head + tails)]
        else:
            calls = [([names[i] for i in g], head + [tails[i] for i in g]) for g in groups]
        replies = await self._run_groups(CLAIM_MANY, calls, "claim_many")
        if len(groups) == 1:
            return parse_batch(consumer, requests, lease_ms, keep_ms, replies[0])
        claims: list[Claim | None] = [None] * len(requests)
        for group, reply in zip(groups, replies, strict=True):
            found = parse_batch(consumer, [requests[i] for i in group], lease_ms, keep_ms, reply)
            for i, claim in zip(group, found, strict=True):
                claims[i] = claim
        return [claim for claim in claims if claim is not None]

    async def takeover(
        self,
        consumer: str,
        key: str,
        *,
        expected_token: str,
        fingerprint: str | None,
        token: str,
        lease_ms: int,
        keep_ms: int,
    ) -> Claim:
        args = (
            self._now(),
            b"%d" % lease_ms,
            b"%d" % keep_ms,
            b"1",
            opt(expected_token),
            opt(fingerprint),
            token.encode(),
        )
        reply = await self._run(CLAIM, self._keys.record(consumer, key), args, "takeover")
        return parse_claim(consumer, key, fingerprint, token, lease_ms, keep_ms, reply)

    async def _fenced(
        self, op: str, script: Script, consumer: str, key: str, args: Sequence[bytes]
    ) -> tuple[int, bytes] | Record:
        """Run a write that applies only while ``args``' token owns the record: ``(now,
        brief)`` when it wrote, the record when it had already been written by this token (a
        repeat); otherwise raise :class:`~oncely.LeaseLost` with the current record."""
        reply = await self._run(script, self._keys.record(consumer, key), args, op)
        return self._written(op, consumer, key, reply)

    def _written(self, op: str, consumer: str, key: str, reply: Any) -> tuple[int, bytes] | Record:
        code = reply[0]
        if code == b"ok":
            return int(reply[1]), reply[2]
        _code, _now, record = parse_reply(consumer, key, reply)
        if code == b"done" and record is not None:
            return record
        raise lease_lost(op, consumer, key, Lost(record))

    async def complete(
        self,
        consumer: str,
        key: str,
        *,
        token: str,
        result: bytes | None,
        keep_ms: int,
        note: str | None = None,
    ) -> Record:
        args = (self._now(), token.encode(), b"%d" % keep_ms, opt(result), opt(note))
        done = await self._fenced("complete", COMPLETE, consumer, key, args)
        return self._completed(consumer, key, token, keep_ms, result, note, done)

    def _completed(
        self,
        consumer: str,
        key: str,
        token: str,
        keep_ms: int,
        result: bytes | None,
        note: str | None,
        done: tuple[int, bytes] | Record,
    ) -> Record:
        if isinstance(done, Record):
            return done
        now, brief = done
        return parse_written(
            consumer,
            key,
            brief,
            status=Status.COMPLETED,
            token=token,
            now=now,
            expires=now + keep_ms,
            result=None if result is None else bytes(result),
            error=note,
        )

    def result_room(self) -> tuple[int, str]:
        """The most bytes an encoded result may have for this store to keep it, and why (a
        larger one is completed without it, as one over ``Limits.max_result_bytes``)."""
        return _ROOM

    async def complete_many(
        self, consumer: str, completions: Sequence[Completion], *, keep_ms: int
    ) -> list[Record | LeaseLost]:
        """One pipeline of the completion script (one round trip on a single Redis)."""
        if not completions:
            return []
        now, keep = self._now(), b"%d" % keep_ms
        calls = [
            (
                [self._keys.record(consumer, c.key)],
                [now, c.token.encode(), keep, opt(c.result), opt(c.note)],
            )
            for c in completions
        ]
        replies = await self._run_groups(COMPLETE, calls, "complete_many")
        done: list[Record | LeaseLost] = []
        for c, reply in zip(completions, replies, strict=True):
            try:
                written = self._written("complete", consumer, c.key, reply)
            except LeaseLost as lost:
                done.append(lost)
                continue
            done.append(
                self._completed(consumer, c.key, c.token, keep_ms, c.result, c.note, written)
            )
        return done

    async def fail(
        self, consumer: str, key: str, *, token: str, error: str, keep_ms: int
    ) -> Record:
        args = (self._now(), token.encode(), b"%d" % keep_ms, error.encode())
        done = await self._fenced("fail", FAIL, consumer, key, args)
        if isinstance(done, Record):
            return done
        now, brief = done
        return parse_written(
            consumer,
            key,
            brief,
            status=Status.FAILED,
            token=token,
            now=now,
            expires=now + keep_ms,
            error=error,
        )

    async def renew(
        self, consumer: str, key: str, *, token: str, lease_ms: int, keep_ms: int
    ) -> Record:
        args = (self._now(), token.encode(), b"%d" % lease_ms, b"%d" % keep_ms)
        done = await self._fenced("renew", RENEW, consumer, key, args)
        if isinstance(done, Record):  # renew has no repeat: a record here is never "done"
            return done
        now, brief = done
        return parse_written(
            consumer,
            key,
            brief,
            status=Status.IN_PROGRESS,
            token=token,
            now=now,
            expires=now + max(keep_ms, lease_ms),
            lease_until=now + lease_ms,
        )

    async def release(self, consumer: str, key: str, *, token: str) -> bool:
        return await self._delete("release", RELEASE, consumer, key, token)

    async def forget_by_token(self, consumer: str, key: str, *, token: str) -> bool:
        return await self._delete("forget", FORGET, consumer, key, token)

    async def _delete(self, what: str, script: Script, consumer: str, key: str, token: str) -> bool:
        """Run a fenced delete (``release`` or ``forget_by_token``): True when it deleted,
        False when there was no record, :class:`~oncely.LeaseLost` with the record that
        stays otherwise."""
        reply = await self._run(
            script, self._keys.record(consumer, key), (self._now(), token.encode()), what
        )
        code, _now, record = parse_reply(consumer, key, reply)
        if code == b"true":
            return True
        if code == b"false":
            return False
        raise lease_lost(what, consumer, key, Lost(record))

    # ------------------------------------------------------------ reads and maintenance

    async def get(self, consumer: str, key: str) -> Record | None:
        reply = await self._run(GET, self._keys.record(consumer, key), (self._now(),), "get")
        return parse_reply(consumer, key, reply)[2]

    async def purge_expired(self, *, batch_size: int = 1000, max_batches: int | None = None) -> int:
        """Delete expired records in batches of ``batch_size`` and return how many went.

        With the server's clock there is nothing to do and this returns 0 at once: Redis
        deletes every record itself at its ``expires`` time (``PXAT``), on the same
        clock the scripts judge expiry by. With a clock given to the store, records carry no
        Redis expiry: this scans the store's keys (every primary of a cluster) and deletes,
        one script per batch, those the clock says are expired."""
        if not 1 <= batch_size <= 10_000:
            raise ValueError("batch_size must be between 1 and 10000")
        await self._check()
        if self._clock is None:
            return 0
        now = self._clock.now_ms()
        deleted = batches = 0
        expired: list[bytes] = []
        where: tuple[int, int] | None = SCAN_START
        while where is not None or expired:
            if where is not None:
                where, names = await self._scan_page(where, self._keys.pattern)
                if names:
                    rows = await self._read(names)
                    expired += [n for n, raw in zip(names, rows, strict=True) if _due(raw, now)]
            while len(expired) >= batch_size or (where is None and expired):
                if max_batches is not None and batches >= max_batches:
                    return deleted
                deleted += await self._purge(expired[:batch_size], now)
                del expired[:batch_size]
                batches += 1
        return deleted

    async def _purge(self, names: list[bytes], now: int) -> int:
        args = [b"%d" % now]
        calls = [([names[i] for i in group], args) for group in self._groups(names)]
        return sum(int(n) for n in await self._run_groups(PURGE, calls, "purge"))

    async def stats(self, *, exact: bool = True) -> StoreStats:
        """Record counts per consumer and status, from a ``SCAN`` of the store's keys (every
        primary of a cluster), for operators. ``SCAN`` matches the store's prefix but visits
        every key of the database: the cost grows with the whole keyspace, not with the
        store's records alone, so give oncely a database of its own on a Redis that holds
        many other keys (``scan`` and a purge with a given clock walk it the same way). A
        record written meanwhile may be counted twice or not at all, as ``SCAN`` allows.

        ``exact=False`` samples instead: :data:`_SAMPLE` keys drawn with ``RANDOMKEY`` (on a
        cluster, as many from each primary), scaled by ``DBSIZE``; see :meth:`_estimate`."""
        await self._check()
        if not exact:
            return await self._estimate()
        now = await self._time()
        counts: dict[str, dict[Status, int]] = {}
        expired = 0
        where: tuple[int, int] | None = SCAN_START
        while where is not None:
            where, names = await self._scan_page(where, self._keys.pattern)
            if not names:
                continue
            for name, raw in zip(names, await self._read(names), strict=True):
                ident = self._keys.ident(name)
                if ident is None or raw is None:
                    continue  # not a record, or gone meanwhile
                state, expires = stored_status(raw)
                if expires <= now:
                    expired += 1
                    continue
                by_status = counts.setdefault(ident[0], {})
                by_status[state] = by_status.get(state, 0) + 1
        return StoreStats(counts=counts, expired=expired)

    async def _estimate(self) -> StoreStats:
        """``stats(exact=False)``: a sample of random keys, scaled by ``DBSIZE``.

        Each key is drawn with ``RANDOMKEY`` (with replacement; Redis picks a random slot of
        its hash table, then a key in it: close to uniform), the store's records among them
        are read, and each stands for ``DBSIZE / drawn`` keys. A count whose share of the
        database is ``p`` is off by ``DBSIZE * sqrt(p * (1 - p) / drawn)`` (one standard
        error: at most ``DBSIZE / (2 * sqrt(drawn))``, 1.1% of the database for 2,000
        draws); a consumer holding far less than ``1 / drawn`` of the database may not be
        drawn at all. Other keys in the database cost precision, not time. A database of at
        most :data:`_SAMPLE` keys is counted exactly instead."""
        now = await self._time()
        try:
            drawn = await self._draw()
        except DRIVER_ERRORS as exc:
            raise translate(exc, "sampling keys", self._where) from exc
        if sum(size for size, _ in drawn) <= _SAMPLE:
            return await self.stats()
        found: dict[str, dict[Status, float]] = {}
        expired = 0.0
        for size, names in drawn:
            mine = [n for n in names if n is not None and self._keys.ident(n) is not None]
            if not mine:
                continue
            weight = size / len(names)
            for name, raw in zip(mine, await self._read(mine), strict=True):
                ident = self._keys.ident(name)
                if ident is None or raw is None:
                    continue  # gone meanwhile
                state, expires = stored_status(raw)
                if expires <= now:
                    expired += weight
                    continue
                by_status = found.setdefault(ident[0], {})
                by_status[state] = by_status.get(state, 0.0) + weight
        counts = {c: {s: round(n) for s, n in by.items()} for c, by in found.items()}
        statuses = dict.fromkeys(Status, 0)
        for rounded in counts.values():
            for state, count in rounded.items():
                statuses[state] += count
        size = sum(size for size, _ in drawn)
        draws = sum(len(names) for _, names in drawn)
        return StoreStats(
            counts=counts,
            expired=round(expired),
            exact=False,
            consumers={c: sum(by.values()) for c, by in counts.items()},
            statuses=statuses,
            note=(
                f"a sample of {draws:,} random keys of the database's {size:,}: each count "
                f"is within about {size / draws**0.5:,.0f} (two standard errors) of the truth"
            ),
        )

    async def _draw(self) -> list[tuple[int, list[bytes | None]]]:
        """``(DBSIZE, keys drawn by RANDOMKEY)`` of the database (of each primary of a
        cluster); None for a draw that found the database empty."""
        client: Any = self._client
        if not self._cluster:
            size = int(await client.dbsize())
            if size <= _SAMPLE:
                return [(size, [])]
            pipe = client.pipeline(transaction=False)
            for _ in range(_SAMPLE):
                pipe.randomkey()
            return [(size, [_name(n) for n in await pipe.execute()])]
        if ASYNC:
            await client.initialize()
        nodes = sorted(client.get_primaries(), key=lambda node: str(node.name))
        sizes = [int(await client.dbsize(target_nodes=node)) for node in nodes]
        if sum(sizes) <= _SAMPLE:
            return [(sum(sizes), [])]
        each = max(1, _SAMPLE // len(nodes))
        drawn = []
        for node, size in zip(nodes, sizes, strict=True):
            names = [_name(await client.randomkey(target_nodes=node)) for _ in range(each)]
            drawn.append((size, names))
        return drawn

    async def scan(
        self,
        *,
        consumer: str | None = None,
        status: Status | None = None,
        after: tuple[str, str] | None = None,
        limit: int = 100,
    ) -> list[Record]:
        """Unexpired records in ``(consumer, key)`` order, starting after ``after``.

        Redis keeps no order, so every page visits every key of the store (of ``consumer``
        when given) and keeps only the ``limit`` smallest: O(records) per page, memory
        O(limit). For operators, not for the message path."""
        await self._check()
        if limit <= 0:
            return []
        now = await self._time()
        pattern = self._keys.pattern if consumer is None else self._keys.consumer_pattern(consumer)
        found: dict[tuple[str, str], Record] = {}
        bound: tuple[str, str] | None = None  # the largest kept, once ``limit`` are kept
        where: tuple[int, int] | None = SCAN_START
        while where is not None:
            where, names = await self._scan_page(where, pattern)
            wanted: list[tuple[tuple[str, str], bytes]] = []
            for name in names:
                ident = self._keys.ident(name)
                if (
                    ident is None
                    or ident in found
                    or (consumer is not None and ident[0] != consumer)
                    or (after is not None and ident <= after)
                    or (bound is not None and ident >= bound)
                ):
                    continue
                wanted.append((ident, name))
            if not wanted:
                continue
            rows = await self._read([name for _, name in wanted])
            for (ident, _name), raw in zip(wanted, rows, strict=True):
                if raw is None:
                    continue  # gone meanwhile
                record = parse_stored(ident[0], ident[1], raw)
                if record.expires_ms <= now:
                    continue
                if status is None or record.status is status:
                    found[ident] = record
            if len(found) >= limit:
                kept = sorted(found)[:limit]
                found = {ident: found[ident] for ident in kept}
                bound = kept[-1]
        return [found[ident] for ident in sorted(found)[:limit]]

    async def forget(self, consumer: str, key: str) -> bool:
        await self._check()
        try:
            return await unlink(self._client, self._keys.record(consumer, key))
        except DRIVER_ERRORS as exc:
            raise translate(exc, "forget", self._where) from exc


def _name(name: bytes | str | None) -> bytes | None:
    return name.encode() if isinstance(name, str) else name


def _due(stored: bytes | None, now: int) -> bool:
    return stored is not None and stored_status(stored)[1] <= now
