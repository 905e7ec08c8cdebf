"""redis-py calls: the part of the Redis store where asyncio and sync differ.

The store speaks to Redis only through these functions, so the store itself needs no driver
renames. One client is a single Redis (``redis.asyncio.Redis``, or ``redis.Redis`` in sync) or a
Redis Cluster (``redis.asyncio.cluster.RedisCluster``, or ``redis.cluster.RedisCluster``); the
functions work on both. The differences (the driver's classes, kernel socket timeouts on sync
connections, a cluster client's explicit initialization in asyncio) are marked ``if ASYNC:`` in
``async_io.py``, from which ``sync_io.py`` is generated like the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from typing import Any, TypeAlias

from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError
from redis.exceptions import TimeoutError as RedisTimeoutError

from oncely._core.forking import forget_parent_in_children
from oncely._twin import ASYNC
from oncely.stores.redis.errors import POOL_ARGS, RedisOptions, pack_evalsha
from oncely.stores.redis.lua import Script

if ASYNC:
    from redis.asyncio import BlockingConnectionPool, Redis, SSLConnection
    from redis.asyncio.cluster import RedisCluster
    from redis.asyncio.retry import Retry
else:
    import socket
    import struct
    import sys
    from typing import Final

    from redis import BlockingConnectionPool, Connection, Redis, SSLConnection
    from redis.cluster import RedisCluster
    from redis.retry import Retry

__all__ = [
    "SCAN_START",
    "Client",
    "Runner",
    "ScanPosition",
    "close",
    "connect",
    "decodes_responses",
    "describe",
    "evalsha",
    "evalsha_many",
    "eviction_policies",
    "hget",
    "hsetnx",
    "is_client",
    "is_cluster",
    "scan_page",
    "server_time_ms",
    "unlink",
]

Client: TypeAlias = Redis | RedisCluster


def _bytes(value: bytes | str) -> bytes:
    # The store refuses clients that decode replies, so a str never arrives; typed for mypy.
    return value.encode() if isinstance(value, str) else value


def connect(options: RedisOptions) -> Client:
    """A client for ``options`` (no I/O yet: connections open on first use).

    A single Redis gets a blocking pool of ``max_connections`` (a caller waits up to
    ``timeout`` for a free connection; the store's scripts run on connections of their own,
    see :class:`Runner`) and one quick resend on a broken connection, so a server restart
    costs no failed call once it is back. A cluster client keeps redis-py's own retry, which
    also follows slot moves."""
    extra: dict[str, Any] = {}
    if options.ssl_ca_certs is not None:
        extra["ssl_ca_certs"] = options.ssl_ca_certs
    timeout = options.timeout.total_seconds()
    connect_timeout = options.connect_timeout.total_seconds()
    if options.cluster:
        return RedisCluster.from_url(
            options.server,
            max_connections=options.max_connections,
            socket_timeout=timeout,
            socket_connect_timeout=connect_timeout,
            **extra,
        )
    if ASYNC:
        # redis-py times asyncio reads out itself (kernel timeouts: sync only, below).
        socket_timeout: float | None = timeout
    else:
        socket_timeout: float | None = timeout
        if _KERNEL_TIMEOUTS and options.server.startswith("redis://"):
            # The kernel enforces the timeout (see _KernelTimeoutConnection), so the socket
            # itself is a blocking one.
            extra["connection_class"] = _kernel_timeout_class(timeout)
            socket_timeout = None
    pool = BlockingConnectionPool.from_url(
        options.server,
        max_connections=options.max_connections,
        timeout=timeout,
        socket_timeout=socket_timeout,
        socket_connect_timeout=connect_timeout,
        retry=Retry(NoBackoff(), 1),
        **extra,
    )
    return Redis.from_pool(pool)


if ASYNC:
    pass  # asyncio's sockets never block: redis-py times their reads out itself
else:
    _KERNEL_TIMEOUTS: Final = sys.platform == "linux"
    """Whether the store's plain TCP connections time out in the kernel (``SO_RCVTIMEO`` and
    ``SO_SNDTIMEO``, whose ``struct timeval`` layout is Linux's) instead of in Python."""

    class _KernelTimeoutConnection(Connection):
        """A redis-py connection on a blocking socket whose sends and receives the kernel times
        out (``_timeval``, the store's ``timeout`` as a ``struct timeval``).

        Python's own socket timeout polls the socket before every ``send`` and ``recv``: one more
        system call each way, a few per cent of a script's client CPU on loopback (``python
        bench/redis_socket_timeouts.py`` compares the two). Here the kernel ends a call that
        waited too long with ``EAGAIN``, which redis-py reports as a
        :class:`redis.ConnectionError` (the connection is then dropped) and
        :func:`oncely.stores.redis.errors.translate` as :class:`~oncely.StoreUnavailable`, as
        it does a Python timeout."""

        _timeval: bytes = struct.pack("ll", 5, 0)

        def _connect(self) -> socket.socket:
            # redis-py's own TCP connect (with the connect timeout), then the kernel timeouts;
            # _connect is where every redis-py version since 5.0 makes the socket.
            sock: socket.socket = super()._connect()  # type: ignore[no-untyped-call]
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, self._timeval)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, self._timeval)
            return sock

    _CLASSES: dict[float, type[_KernelTimeoutConnection]] = {}

    def _kernel_timeout_class(timeout: float) -> type[_KernelTimeoutConnection]:
        """The connection class for one timeout (redis-py builds connections from a class and
        keyword arguments it knows, so the timeout travels as a class attribute)."""
        found = _CLASSES.get(timeout)
        if found is None:
            micros = round(timeout * 1_000_000)  # 0 would mean "never": at least 1 us
            timeval = struct.pack("ll", *divmod(max(micros, 1), 1_000_000))
            found = type(
                "KernelTimeoutConnection",
                (_KernelTimeoutConnection,),
                {"_timeval": timeval},
            )
            _CLASSES[timeout] = found
        return found


def is_cluster(client: object) -> bool:
    return isinstance(client, RedisCluster)


def is_client(client: object) -> bool:
    return isinstance(client, Redis | RedisCluster)


def decodes_responses(client: Client) -> bool:
    return bool(client.get_encoder().decode_responses)


def describe(client: Client) -> str:
    """``redis://host:port/db`` (or ``...?cluster=true``) of a client, without credentials."""
    if isinstance(client, RedisCluster):
        nodes = list(client.nodes_manager.startup_nodes.values())
        where = f"{nodes[0].host}:{nodes[0].port}" if nodes else "?"
        return f"redis://{where}/0?cluster=true"
    pool = client.connection_pool
    kwargs = pool.connection_kwargs
    if "path" in kwargs:
        return f"unix://{kwargs['path']}?db={kwargs.get('db', 0)}"
    scheme = "rediss" if issubclass(pool.connection_class, SSLConnection) else "redis"
    host, port = kwargs.get("host", "localhost"), kwargs.get("port", 6379)
    return f"{scheme}://{host}:{port}/{kwargs.get('db', 0)}"


async def close(client: Client) -> None:
    await client.aclose()


async def evalsha(
    client: Client, script: Script, keys: Sequence[bytes], args: Sequence[bytes]
) -> Any:
    """Run ``script`` by its SHA-1; load it once if the server does not know it (a fresh or
    restarted server): one round trip except the very first time."""
    try:
        return await client.evalsha(script.sha, len(keys), *keys, *args)
    except NoScriptError:
        await client.script_load(script.text)
        return await client.evalsha(script.sha, len(keys), *keys, *args)


class Runner:
    """Runs the store's scripts on one client: its ``run(script, keys, args)`` is :func:`evalsha`.

    On a single Redis the script goes out with the store's own packing
    (:func:`~oncely.stores.redis.errors.pack_evalsha`) and comes back through redis-py's parser, on
    a connection with its retry policy (a broken connection is dropped and the call sent once more).
    That skips the per-command rest of ``execute_command`` (argument encoding, command hooks,
    redis-py's optional metrics), which costs the client more CPU than the round trip.

    Connections: with ``options`` (a client the store built) the runner keeps connections of its
    own, at most ``max_connections``, reused last-in first-out; a caller finding them all busy
    waits up to ``timeout`` for one. Taking one is a list pop: redis-py's pool spends more on a
    checkout (locks, a socket probe, metrics) than the script's round trip. Without
    ``options`` (a caller's client) each call borrows from the client's own pool and returns
    it. A cluster, a single-connection client or one with a client-side cache runs every
    script through redis-py's ``evalsha``, like any command.
    """

    __slots__ = (
        "__weakref__", "_client", "_cond", "_direct", "_idle", "_limit", "_made", "_pool",
        "_timeout", "_waiting",
    )  # fmt: skip

    def __init__(self, client: Client, options: RedisOptions | None = None) -> None:
        self._client = client
        if ASYNC:
            # redis.asyncio opens a single-connection client's connection on first use.
            single = not isinstance(client, RedisCluster) and client.single_connection_client
        else:
            single = not isinstance(client, RedisCluster) and client.connection is not None
        self._direct = not (
            isinstance(client, RedisCluster)
            or single
            or getattr(client.connection_pool, "cache", None) is not None
        )
        self._pool: Any = None if isinstance(client, RedisCluster) else client.connection_pool
        self._limit = 0 if options is None or not self._direct else options.max_connections
        self._timeout = 0.0 if options is None else options.timeout.total_seconds()
        self._idle: list[Any] = []
        self._made: list[Any] = []
        self._waiting = 0
        self._cond = asyncio.Condition()
        forget_parent_in_children(self)

    async def run(self, script: Script, keys: Sequence[bytes], args: Sequence[bytes]) -> Any:
        if not self._direct:
            return await evalsha(self._client, script, keys, args)
        packed = (pack_evalsha(script.sha_bytes, keys, args),)
        try:
            return await self._ask(packed)
        except NoScriptError:
            await self._client.script_load(script.text)
            return await self._ask(packed)

    async def _ask(self, packed: tuple[bytes]) -> Any:
        if not self._limit:
            conn = await self._pool.get_connection(*POOL_ARGS)
            try:
                return await _exchange(conn, packed)
            finally:
                await self._pool.release(conn)
        if ASYNC:
            conn = self._idle.pop() if self._idle else await self._take()
        else:
            try:
                conn = self._idle.pop()  # atomic: no lock on the common path
            except IndexError:
                conn = self._take()
        try:
            return await _exchange(conn, packed, self._timeout)
        finally:
            self._idle.append(conn)
            if self._waiting:
                async with self._cond:
                    self._cond.notify()

    async def _take(self) -> Any:
        """An idle connection, a new one while fewer than the limit exist, or the first one
        given back within the timeout."""
        deadline = time.monotonic() + self._timeout
        async with self._cond:
            # Counted as waiting before looking: a connection given back after the look
            # notifies, one given back before it is found.
            self._waiting += 1
            try:
                while True:
                    if self._idle:
                        return self._idle.pop()
                    if len(self._made) < self._limit:
                        conn = self._pool.make_connection()  # connects on first use
                        if ASYNC:
                            # The exchange is timed as a whole (see _exchange): redis-py's own
                            # socket timeout wraps each send in asyncio.wait_for, a task.
                            conn.socket_timeout = None
                        self._made.append(conn)
                        return conn
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise RedisConnectionError("No connection available.")
                    if ASYNC:
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(self._cond.wait(), remaining)
                    else:
                        self._cond.wait(remaining)
            finally:
                self._waiting -= 1

    async def close(self) -> None:
        """Close the runner's own connections, in flight or not."""
        self._idle.clear()
        made, self._made = self._made, []
        for conn in made:
            await conn.disconnect()

    def _forget_parent(self) -> None:
        # A child process must not share its parent's sockets: forget them, open its own.
        self._idle, self._made, self._waiting = [], [], 0
        self._cond = asyncio.Condition()


async def _exchange(conn: Any, packed: tuple[bytes], timeout: float = 0.0) -> Any:
    """Send one packed command and read its reply, with the connection's retry policy.

    asyncio, with ``timeout``: on the runner's own connections (no socket timeout of their
    own), the send and the read are timed together by one ``asyncio.timeout``, a timer,
    instead of redis-py's ``wait_for`` around the send (a task per command: about a tenth of
    an HTTP request's CPU behind the middleware) and a timer around the read. A call that
    times out drops the connection (a reply may still be on its way) and raises redis-py's
    ``TimeoutError``, which the retry policy and the store treat as before.

    Speed: the first attempt runs here, outside redis-py's ``retry.call_with_retry`` (its
    frame and the two closures it needs cost each call about 1 us of a 50 us replay behind
    the middleware, ``bench/web.py --in-process``); a failed first attempt goes to the policy
    as its first failure (:func:`_retried`), so what is retried, how often and after which
    backoff stay the policy's."""
    try:
        return await _attempt(conn, packed, timeout)
    except Exception as error:  # the policy judges it (see _retried)
        first = error
    # Outside the handler: a later attempt's error is not chained to the first one.
    return await _retried(conn, packed, timeout, first)


async def _attempt(conn: Any, packed: tuple[bytes], timeout: float) -> Any:
    """One send and read, timed as a whole with ``timeout`` in asyncio (see _exchange)."""
    if ASYNC:  # noqa: SIM102 (a marker stands apart)
        if timeout:
            try:
                async with asyncio.timeout(timeout):
                    await conn.send_packed_command(packed)
                    return await conn.read_response()
            except TimeoutError:
                await conn.disconnect(nowait=True)
                where = f"{conn.host}:{conn.port}"
                raise RedisTimeoutError(f"Timeout talking to {where}") from None
    await conn.send_packed_command(packed)
    return await conn.read_response()


async def _retried(conn: Any, packed: tuple[bytes], timeout: float, first: Exception) -> Any:
    """The rest of :func:`_exchange` after its first attempt failed with ``first``: the
    connection's retry policy, whose first call raises ``first`` (so the policy sees it as it
    would have seen it from its own first call: not retried unless it is one of its errors,
    the connection dropped, a backoff) and whose later calls are new attempts."""
    failed: list[Exception] = [first]

    async def again() -> Any:
        if failed:
            raise failed.pop()
        return await _attempt(conn, packed, timeout)

    return await conn.retry.call_with_retry(again, lambda _error: conn.disconnect())


async def evalsha_many(
    client: Client, script: Script, calls: Sequence[tuple[Sequence[bytes], Sequence[bytes]]]
) -> list[Any]:
    """Run ``script`` once per ``(keys, args)`` in one pipeline: one round trip on a single
    Redis, one per node (sent to all nodes at once) on a cluster. The replies come in call
    order. Calls the server refused for want of the script did nothing: they run again after
    loading it. Any other error is raised (calls before it may have run)."""
    replies: list[Any] = [None] * len(calls)
    todo = list(range(len(calls)))
    cluster: Any = None
    if isinstance(client, RedisCluster):
        cluster = client
        if ASYNC:
            await cluster.initialize()
    for _ in range(2):
        pipe = client.pipeline(transaction=False)
        for i in todo:
            keys, args = calls[i]
            # execute_command, with the node named: redis-py blocks the evalsha method in
            # cluster pipelines (a script may touch several slots; each of these touches one),
            # and left to find the keys itself it asks a node (COMMAND GETKEYS) per command.
            where = {"target_nodes": _node(cluster, keys[0])} if cluster is not None else {}
            pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args, **where)
        answers = await pipe.execute(raise_on_error=False)
        missing: list[int] = []
        for i, answer in zip(todo, answers, strict=True):
            if isinstance(answer, NoScriptError):
                missing.append(i)
            elif isinstance(answer, Exception):
                raise answer
            else:
                replies[i] = answer
        if not missing:
            return replies
        await client.script_load(script.text)
        todo = missing
    raise NoScriptError(f"the {script.name} script vanished from the server twice in a row")


def _node(cluster: Any, key: bytes) -> Any:
    """The primary that holds ``key``'s slot."""
    return cluster.nodes_manager.get_node_from_slot(key_slot(key))


async def server_time_ms(client: Client) -> int:
    """The server's clock (``TIME``) in epoch milliseconds."""
    seconds, micros = await client.time()
    return int(seconds) * 1000 + int(micros) // 1000


async def hget(client: Client, name: bytes, field: bytes) -> bytes | None:
    value = await client.hget(name, field)
    return None if value is None else _bytes(value)


async def eviction_policies(client: Client) -> list[tuple[str, int]]:
    """Each server's ``maxmemory-policy`` and ``maxmemory`` (bytes, 0 for no limit), from
    ``INFO memory`` (which managed services that disable ``CONFIG`` still answer): one pair
    for a single Redis, one per primary of a cluster."""
    if isinstance(client, RedisCluster):
        found = await client.info("memory", target_nodes=RedisCluster.PRIMARIES)
        # One primary answers with its own reply; more, with a reply per node.
        one = "maxmemory_policy" in found
        infos = [found] if one else [i for i in found.values() if isinstance(i, dict)]
    else:
        infos = [await client.info("memory")]
    return [
        (_text(info.get("maxmemory_policy", "")), int(info.get("maxmemory", 0) or 0))
        for info in infos
    ]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


async def hsetnx(client: Client, name: bytes, field: bytes, value: bytes) -> None:
    await client.hsetnx(name, field, value)


async def unlink(client: Client, name: bytes) -> bool:
    return bool(await client.delete(name))


ScanPosition: TypeAlias = tuple[int, int]
"""Where a scan stands: (primary node index, cursor) on a cluster, (0, cursor) otherwise."""

SCAN_START: ScanPosition = (0, 0)


async def scan_page(
    client: Client, where: ScanPosition, match: bytes, count: int
) -> tuple[ScanPosition | None, list[bytes]]:
    """One ``SCAN`` step from ``where``: the keys matching ``match`` it found, and where the
    next step starts (None when every key was visited: on a cluster, on every primary). Like
    ``SCAN``, a key that exists throughout is seen at least once; one that changes meanwhile
    may be missed or seen twice. No state is kept between steps."""
    index, cursor = where
    if not isinstance(client, RedisCluster):
        following, names = await client.scan(cursor, match=match, count=count)
        return ((0, int(following)) if int(following) else None), [_bytes(n) for n in names]
    # redis-py types a cluster SCAN like a single one; it answers ({node: cursor}, keys).
    cluster: Any = client
    if ASYNC:
        await cluster.initialize()
    nodes = sorted(cluster.get_primaries(), key=lambda node: str(node.name))
    if index >= len(nodes):
        return None, []
    node = nodes[index]
    cursors, names = await cluster.scan(cursor, match=match, count=count, target_nodes=node)
    following = int(cursors[node.name])
    found = [_bytes(n) for n in names]
    if following:
        return (index, following), found
    return ((index + 1, 0) if index + 1 < len(nodes) else None), found
