"""A Redis that evicts keys when its memory is full drops oncely's records before their
retention ends, and a redelivered message is then processed again, with nothing said (R8,
R13). Measured on a server of the test's own with ``maxmemory 2mb`` and ``volatile-lru``
(the default policy of several managed Redis services): most of 10,000 completed keys
were claimed again. The store reads the policy when it is first used and refuses such a
server, naming the setting to change; ``allow_eviction=true`` accepts the risk knowingly.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Iterator

import pytest
import redis

import oncely
from oncely import ConfigurationError, StoreUnavailable
from oncely.stores.redis.async_store import AsyncRedisStore
from tests.backends.redis_cluster import require_cluster

LONG = 3_600_000


def _with(url: str, *options: str) -> str:
    return f"{url}?{'&'.join(options)}"


def _claim(store: oncely.Store, key: str, token: str = "first") -> bool:
    return store.claim("c", key, fingerprint=None, token=token, lease_ms=LONG, keep_ms=LONG,
                       takeover=False).won  # fmt: skip


@pytest.mark.parametrize("policy", ["volatile-lru", "allkeys-lru", "volatile-ttl"])
def test_r8_a_redis_that_evicts_keys_is_refused_naming_the_setting(
    private_redis: tuple[redis.Redis, str], policy: str
) -> None:
    server, url = private_redis
    server.config_set("maxmemory", "2mb")
    server.config_set("maxmemory-policy", policy)
    store = oncely.open(url)
    try:
        with pytest.raises(ConfigurationError) as refused:
            _claim(store, "order-1")
        said = str(refused.value)
        assert f"maxmemory-policy {policy}" in said and "noeviction" in said
        assert "allow_eviction" in said
        with pytest.raises(ConfigurationError):  # `oncely migrate` says so too
            store.migrate()  # type: ignore[attr-defined]
        assert server.dbsize() == 0  # nothing was written
    finally:
        store.close()


async def test_r8_the_asyncio_store_refuses_it_too(private_redis: tuple[redis.Redis, str]) -> None:
    server, url = private_redis
    server.config_set("maxmemory", "2mb")
    server.config_set("maxmemory-policy", "volatile-lru")
    store = AsyncRedisStore.from_url(url)
    try:
        with pytest.raises(ConfigurationError, match="maxmemory-policy volatile-lru"):
            await store.prepare()
    finally:
        await store.aclose()


def test_r8_allow_eviction_accepts_the_risk_the_refusal_names(
    private_redis: tuple[redis.Redis, str],
) -> None:
    """With ``allow_eviction=true`` the store runs, and shows the risk it accepted: records
    evicted under memory pressure, their keys claimed again as new."""
    server, url = private_redis
    server.config_set("maxmemory", "2mb")
    server.config_set("maxmemory-policy", "volatile-lru")
    store = oncely.open(_with(url, "allow_eviction=true"))
    try:
        keys = [f"order-{i}" for i in range(10_000)]
        for key in keys:
            assert _claim(store, key)
            store.complete("c", key, token="first", result=None, keep_ms=LONG)
        again = sum(_claim(store, key, "second") for key in keys)
        assert int(server.info("stats")["evicted_keys"]) > 0
        assert again > 0  # processed twice, had they been messages
    finally:
        store.close()


def test_r8_no_memory_limit_or_noeviction_is_accepted(
    private_redis: tuple[redis.Redis, str],
) -> None:
    """An evicting policy without ``maxmemory`` evicts nothing (the store runs); under
    ``noeviction`` a full Redis refuses new claims with :class:`StoreUnavailable`, which
    consumers retry, and what it holds stays."""
    server, url = private_redis
    server.config_set("maxmemory-policy", "allkeys-lru")  # maxmemory 0: no limit
    store = oncely.open(url)
    try:
        assert _claim(store, "order-1")
    finally:
        store.close()
    server.config_set("maxmemory", "2mb")
    server.config_set("maxmemory-policy", "noeviction")
    store = oncely.open(url)
    try:
        kept = 0
        with pytest.raises(StoreUnavailable, match="maxmemory"):
            for kept in range(1, 100_000):
                assert _claim(store, f"fill-{kept}")
        assert kept > 1
        held = store.get("c", "order-1")  # nothing was evicted to make room
        assert held is not None and held.token == "first"
    finally:
        store.close()


@contextlib.contextmanager
def _evicting(port: int, policy: str) -> Iterator[None]:
    """The cluster node on ``port`` evicting keys with ``policy`` (1 GB: nothing is evicted
    in the test), then as it was."""
    node = redis.Redis(port=port)
    before = node.config_get("maxmemory*")
    try:
        node.config_set("maxmemory", "1gb")
        node.config_set("maxmemory-policy", policy)
        yield
    finally:
        node.config_set("maxmemory-policy", before["maxmemory-policy"])
        node.config_set("maxmemory", before["maxmemory"])
        node.close()


def test_r8_a_cluster_primary_that_evicts_is_refused() -> None:
    """On a Redis Cluster every primary is read: one of the three evicting is enough."""
    cluster = require_cluster()
    with _evicting(cluster.ports[-1], "volatile-lfu"):
        store = oncely.open(f"{cluster.url}&prefix=evict_{uuid.uuid4().hex[:8]}")
        try:
            with pytest.raises(ConfigurationError, match="maxmemory-policy volatile-lfu"):
                _claim(store, "order-1")
        finally:
            store.close()


def test_r8_a_user_not_allowed_info_is_warned_and_served(
    private_redis: tuple[redis.Redis, str], caplog: pytest.LogCaptureFixture
) -> None:
    """A user whose ACL refuses ``INFO`` (as some managed services set theirs): the policy
    cannot be read, so the store says what to check, at WARNING, and serves."""
    server, url = private_redis
    server.acl_setuser("app", enabled=True, passwords=["+pw"], keys=["*"],
                       commands=["+@all", "-info"])  # fmt: skip
    store = oncely.open(url.replace("redis://", "redis://app:pw@"))
    try:
        with caplog.at_level(logging.WARNING, logger="oncely.store"):
            assert _claim(store, "order-1")
    finally:
        store.close()
    said = [r.getMessage() for r in caplog.records if r.name == "oncely.store"]
    assert len(said) == 1 and "could not read the server's maxmemory-policy" in said[0]


async def test_r8_the_asyncio_store_reads_every_cluster_primary_too() -> None:
    cluster = require_cluster()
    with _evicting(cluster.ports[1], "allkeys-lfu"):
        store = AsyncRedisStore.from_url(f"{cluster.url}&prefix=evict_{uuid.uuid4().hex[:8]}")
        try:
            with pytest.raises(ConfigurationError, match="maxmemory-policy allkeys-lfu"):
                await store.prepare()
        finally:
            await store.aclose()
