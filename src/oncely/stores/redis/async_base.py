"""The Redis store's construction, connection, schema marker and script plumbing.

:class:`RedisStoreBase` is the part of :class:`~oncely.stores.redis.async_store.AsyncRedisStore`
that does not depend on the operation: building or adopting the client, sending a script with
``EVALSHA`` and translating driver errors, grouping a batch by hash slot on a cluster, reading
records in bulk, the schema marker and closing. The operations of the store contract are in
:mod:`oncely.stores.redis.async_store`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, Self

from oncely._core.clock import Clock
from oncely._core.forking import forget_parent_in_children
from oncely._urls import redact
from oncely.errors import ConfigurationError, SchemaMissing, SchemaTooNew, StoreError
from oncely.stores.redis.async_io import (
    Client,
    Runner,
    close,
    connect,
    decodes_responses,
    describe,
    evalsha_many,
    hget,
    hsetnx,
    is_client,
    is_cluster,
    scan_page,
    server_time_ms,
)
from oncely.stores.redis.dialect import READ, SCHEMA_VERSION, RedisKeys, Script
from oncely.stores.redis.errors import DRIVER_ERRORS, RedisOptions, parse_url, slot_of, translate

__all__ = ["RedisStoreBase"]

_VERSION_FIELD = b"schema_version"
# Keys per script in a batch on a single Redis (a longer script blocks the server longer), and
# keys per SCAN step for stats, scan and purge (memory stays bounded by this and ``limit``).
_BATCH = 500


class RedisStoreBase:
    """Construction and plumbing of the Redis store (see
    :class:`~oncely.stores.redis.async_store.AsyncRedisStore`)."""

    def __init__(
        self,
        client: Client,
        *,
        prefix: str = "oncely",
        clock: Clock | None = None,
        migrate: bool = True,
    ) -> None:
        self._setup(prefix, clock, migrate)
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
        self._url = f"{base}{'&' if '?' in base else '?'}prefix={prefix}"

    def _setup(self, prefix: str, clock: Clock | None, migrate: bool) -> None:
        self._keys = RedisKeys(prefix)
        self._clock = clock
        self._auto_migrate = migrate
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
        ``max_connections``, ``timeout``, ``connect_timeout`` and ``ssl_ca_certs``. The store
        builds and owns its client, on first use: opening a store never waits for the
        server. ``timeout`` bounds every wait for the server; in the threaded store on Linux,
        for one server over ``redis://``, the kernel enforces it (``SO_RCVTIMEO`` and
        ``SO_SNDTIMEO`` on blocking sockets), which spares Python's poll before each send and
        receive."""
        options = parse_url(url)
        store = cls.__new__(cls)
        store._setup(options.prefix, clock, options.migrate)
        store._options = options
        store._cluster = options.cluster
        store._url = redact(url)
        return store

    @property
    def url(self) -> str:
        return self._url

    @property
    def prefix(self) -> str:
        return self._keys.prefix

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._url!r})"

    # ------------------------------------------------------------------ plumbing

    def _now(self) -> bytes:
        """The scripts' first argument: the clock's reading, or empty for the server's."""
        return b"" if self._clock is None else str(self._clock.now_ms()).encode()

    async def _time(self) -> int:
        if self._clock is not None:
            return self._clock.now_ms()
        try:
            return await server_time_ms(self._client)
        except DRIVER_ERRORS as exc:
            raise translate(exc, "reading the server's clock") from exc

    async def _check(self) -> None:
        if self._closed:
            raise StoreError(f"{self!r} is closed")
        if not self._ready:
            await self._prepare()

    async def _run(self, script: Script, name: bytes, args: Sequence[bytes], op: str) -> Any:
        if not self._ready:  # also after aclose: _check raises then
            await self._check()
        try:
            return await self._eval(script, (name,), args)
        except DRIVER_ERRORS as exc:
            raise translate(exc, op) from exc

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
                raise translate(exc, f"connecting to {self._url}") from exc

    async def _prepare(self) -> None:
        async with self._ready_lock:
            if self._ready:
                return
            self._connect()
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

    async def _version(self) -> int | None:
        try:
            value = await hget(self._client, self._keys.meta, _VERSION_FIELD)
        except DRIVER_ERRORS as exc:
            raise translate(exc, "reading the schema version") from exc
        return None if value is None else int(value)

    async def _create(self) -> None:
        # HSETNX: several processes migrating at once write the marker once.
        try:
            await hsetnx(self._client, self._keys.meta, _VERSION_FIELD, b"%d" % SCHEMA_VERSION)
        except DRIVER_ERRORS as exc:
            raise translate(exc, "writing the schema version") from exc

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
            raise translate(exc, op) from exc

    async def _scan_page(
        self, where: tuple[int, int], pattern: bytes
    ) -> tuple[tuple[int, int] | None, list[bytes]]:
        try:
            return await scan_page(self._client, where, pattern, _BATCH)
        except DRIVER_ERRORS as exc:
            raise translate(exc, "scanning keys") from exc

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

    async def migrate(self) -> int:
        """Write the schema marker if it is missing (idempotent, safe to run from several
        processes at once) and return the schema version."""
        if self._closed:
            raise StoreError(f"{self!r} is closed")
        async with self._ready_lock:
            self._connect()
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
                raise translate(exc, "closing") from exc
