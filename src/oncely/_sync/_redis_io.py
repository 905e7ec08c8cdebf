"""Hand-written: redis-py calls (twin: ``_async/_redis_io.py``).

The store speaks to Redis only through these functions, so the generated sync store needs no
driver renames. One client is a single Redis (``redis.Redis``) or a Redis Cluster
(``redis.cluster.RedisCluster``); the functions work on both.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeAlias

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.crc import key_slot
from redis.exceptions import NoScriptError
from redis.retry import Retry

from oncely._dialects.redis import Script
from oncely._drivers.redis import RedisOptions

__all__ = [
    "SCAN_START",
    "Client",
    "ScanPosition",
    "close",
    "connect",
    "decodes_responses",
    "describe",
    "evalsha",
    "evalsha_many",
    "hget",
    "hmget_many",
    "hsetnx",
    "is_client",
    "is_cluster",
    "scan_page",
    "server_time_ms",
    "unlink",
]

Client: TypeAlias = redis.Redis | RedisCluster


def _bytes(value: bytes | str) -> bytes:
    # The store refuses clients that decode replies, so a str never arrives; typed for mypy.
    return value.encode() if isinstance(value, str) else value


def connect(options: RedisOptions) -> Client:
    """A client for ``options`` (no I/O yet: connections open on first use).

    A single Redis gets a blocking pool of ``max_connections`` (a caller waits up to
    ``timeout`` for a free connection) and one quick resend on a broken connection, so a
    server restart costs no failed call once it is back. A cluster client keeps redis-py's
    own retry, which also follows slot moves."""
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
    pool = redis.BlockingConnectionPool.from_url(
        options.server,
        max_connections=options.max_connections,
        timeout=timeout,
        socket_timeout=timeout,
        socket_connect_timeout=connect_timeout,
        retry=Retry(NoBackoff(), 1),
        **extra,
    )
    return redis.Redis.from_pool(pool)


def is_cluster(client: object) -> bool:
    return isinstance(client, RedisCluster)


def is_client(client: object) -> bool:
    return isinstance(client, redis.Redis | RedisCluster)


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
    scheme = "rediss" if issubclass(pool.connection_class, redis.SSLConnection) else "redis"
    host, port = kwargs.get("host", "localhost"), kwargs.get("port", 6379)
    return f"{scheme}://{host}:{port}/{kwargs.get('db', 0)}"


def close(client: Client) -> None:
    client.close()


def evalsha(client: Client, script: Script, keys: Sequence[bytes], args: Sequence[Any]) -> Any:
    """Run ``script`` by its SHA-1; load it once if the server does not know it (a fresh or
    restarted server): one round trip except the very first time."""
    try:
        return client.evalsha(script.sha, len(keys), *keys, *args)
    except NoScriptError:
        client.script_load(script.text)
        return client.evalsha(script.sha, len(keys), *keys, *args)


def evalsha_many(
    client: Client, script: Script, calls: Sequence[tuple[Sequence[bytes], Sequence[Any]]]
) -> list[Any]:
    """Run ``script`` once per ``(keys, args)`` in one pipeline: one round trip on a single
    Redis, one per node (sent to all nodes at once) on a cluster. The replies come in call
    order. Calls the server refused for want of the script did nothing: they run again after
    loading it. Any other error is raised (calls before it may have run)."""
    replies: list[Any] = [None] * len(calls)
    todo = list(range(len(calls)))
    cluster: Any = client if isinstance(client, RedisCluster) else None
    for _ in range(2):
        pipe = client.pipeline(transaction=False)
        for i in todo:
            keys, args = calls[i]
            # execute_command, with the node named: redis-py blocks the evalsha method in
            # cluster pipelines (a script may touch several slots; each of these touches one),
            # and left to find the keys itself it asks a node (COMMAND GETKEYS) per command.
            where = {"target_nodes": _node(cluster, keys[0])} if cluster is not None else {}
            pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args, **where)
        answers = pipe.execute(raise_on_error=False)
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
        client.script_load(script.text)
        todo = missing
    raise NoScriptError(f"the {script.name} script vanished from the server twice in a row")


def _node(cluster: Any, key: bytes) -> Any:
    """The primary that holds ``key``'s slot."""
    return cluster.nodes_manager.get_node_from_slot(key_slot(key))


def server_time_ms(client: Client) -> int:
    """The server's clock (``TIME``) in epoch milliseconds."""
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def hget(client: Client, name: bytes, field: bytes) -> bytes | None:
    value = client.hget(name, field)
    return None if value is None else _bytes(value)


def hsetnx(client: Client, name: bytes, field: bytes, value: bytes) -> None:
    client.hsetnx(name, field, value)


def unlink(client: Client, name: bytes) -> bool:
    return bool(client.delete(name))


def hmget_many(client: Client, names: Sequence[bytes], fields: Sequence[bytes]) -> list[list[Any]]:
    """``HMGET`` of ``fields`` for each of ``names``, in one pipeline."""
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.hmget(name, fields)
    return list(pipe.execute())


ScanPosition: TypeAlias = tuple[int, int]
"""Where a scan stands: (primary node index, cursor) on a cluster, (0, cursor) otherwise."""

SCAN_START: ScanPosition = (0, 0)


def scan_page(
    client: Client, where: ScanPosition, match: bytes, count: int
) -> tuple[ScanPosition | None, list[bytes]]:
    """One ``SCAN`` step from ``where``: the keys matching ``match`` it found, and where the
    next step starts (None when every key was visited: on a cluster, on every primary). Like
    ``SCAN``, a key that exists throughout is seen at least once; one that changes meanwhile
    may be missed or seen twice. No state is kept between steps."""
    index, cursor = where
    if not isinstance(client, RedisCluster):
        following, names = client.scan(cursor, match=match, count=count)
        return ((0, int(following)) if int(following) else None), [_bytes(n) for n in names]
    # redis-py types a cluster SCAN like a single one; it answers ({node: cursor}, keys).
    cluster: Any = client
    nodes = sorted(cluster.get_primaries(), key=lambda node: str(node.name))
    if index >= len(nodes):
        return None, []
    node = nodes[index]
    cursors, names = cluster.scan(cursor, match=match, count=count, target_nodes=node)
    following = int(cursors[node.name])
    found = [_bytes(n) for n in names]
    if following:
        return (index, following), found
    return ((index + 1, 0) if index + 1 < len(nodes) else None), found
