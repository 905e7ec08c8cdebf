"""Fixtures of the Redis store tests: the machine's Redis, the session's cluster, a key prefix
of the test's own, a private server per module, and a counter of network writes."""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import redis.asyncio
import redis.asyncio.connection
import redis.connection
from redis.cluster import RedisCluster

from tests import redis_cluster
from tests.backends.redis import drop_prefix
from tests.backends.redis_cluster import require_cluster
from tests.services import REDIS_URL, require


@pytest.fixture(scope="session", autouse=True)
def _stop_the_cluster_at_the_end() -> Iterator[None]:
    # The session finalizer (atexit is the fallback for runs that never reach this module).
    yield
    redis_cluster.shutdown()


@pytest.fixture
def redis_url() -> str:
    require("Redis", REDIS_URL, 6379)
    return REDIS_URL


@pytest.fixture
def cluster() -> redis_cluster.Cluster:
    return require_cluster()


@pytest.fixture
def prefix(request: pytest.FixtureRequest) -> Iterator[str]:
    """A key prefix of the test's own, dropped afterwards wherever it was used."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    yield name
    if REDIS_URL and _answers(REDIS_URL):
        client = redis.Redis.from_url(REDIS_URL)
        try:
            drop_prefix(client, name)
        finally:
            client.close()
    running = redis_cluster.running()
    if running is not None:
        cluster_client = RedisCluster(host="127.0.0.1", port=running.ports[0])
        try:
            drop_prefix(cluster_client, name)
        finally:
            cluster_client.close()


def _answers(url: str) -> bool:
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=1)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except redis.RedisError:
        return False


@pytest.fixture(scope="module")
def private_port() -> Iterator[int]:
    """A single Redis of this module's own: its command counts and its state are ours."""
    try:
        with redis_cluster.private_server() as port:
            yield port
    except redis_cluster.ClusterUnavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture
def sends(monkeypatch: pytest.MonkeyPatch) -> Counter[int]:
    """Network writes per server port: each is one round trip (a pipeline is one write per
    connection, followed by reading every reply)."""
    counted: Counter[int] = Counter()
    sync_send = redis.connection.AbstractConnection.send_packed_command
    async_send = redis.asyncio.connection.AbstractConnection.send_packed_command

    def send(self: Any, command: Any, check_health: bool = True) -> None:
        counted[int(self.port)] += 1
        sync_send(self, command, check_health)

    async def send_async(self: Any, command: Any, check_health: bool = True) -> None:
        counted[int(self.port)] += 1
        await async_send(self, command, check_health)

    monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", send)
    monkeypatch.setattr(
        redis.asyncio.connection.AbstractConnection, "send_packed_command", send_async
    )
    return counted
