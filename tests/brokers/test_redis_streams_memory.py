"""Redis Streams on a Redis that evicts keys when its memory is full: an ``allkeys-*`` policy
evicts streams (keys without an expiry), and every message in an evicted stream is lost with
nothing said (R13: a message must never silently vanish). Shown here on a server of the
test's own, then refused: the transport reads the policy when it opens."""

from __future__ import annotations

import uuid

import pytest
import redis

from oncely import ConfigurationError
from oncely.brokers.redis_streams import RedisStreams


def test_r13_an_allkeys_policy_evicts_a_stream_and_its_messages(
    private_redis: tuple[redis.Redis, str],
) -> None:
    """Why the transport refuses it: under memory pressure the stream itself goes."""
    server, _ = private_redis
    server.config_set("maxmemory", "2mb")
    server.config_set("maxmemory-policy", "allkeys-lru")
    server.xadd("orders", {"message_id": "order-1", "body": "{}"})
    for i in range(5_000):  # other data fills the memory
        server.set(f"cache-{i}", "x" * 1_000)
    assert int(server.info("stats")["evicted_keys"]) > 0
    assert server.xlen("orders") == 0  # order-1 is gone, never read


def _with(url: str, *options: str) -> str:
    return f"{url}?{'&'.join(options)}" if options else url


@pytest.mark.parametrize("policy", ["allkeys-lru", "allkeys-lfu", "allkeys-random"])
async def test_r13_a_redis_that_evicts_streams_is_refused_at_open(
    private_redis: tuple[redis.Redis, str], policy: str
) -> None:
    server, url = private_redis
    server.config_set("maxmemory", "2mb")
    server.config_set("maxmemory-policy", policy)
    stream = f"orders-{uuid.uuid4().hex[:6]}"
    transport = RedisStreams.from_url(url, stream, group="billing")
    try:
        with pytest.raises(ConfigurationError) as refused:
            await transport.open(1)
    finally:
        await transport.close()
    said = str(refused.value)
    assert f"maxmemory-policy {policy}" in said and "noeviction" in said
    assert "allow_eviction" in said
    assert not server.exists(stream)  # neither the stream nor its group was made


@pytest.mark.parametrize(
    ("settings", "options"),
    [
        ({"maxmemory": "2mb", "maxmemory-policy": "volatile-lru"}, ()),  # streams never expire
        ({"maxmemory-policy": "allkeys-lru"}, ()),  # no maxmemory: nothing evicted
        ({"maxmemory": "2mb", "maxmemory-policy": "allkeys-lru"}, ("allow_eviction=true",)),
    ],
    ids=["volatile", "no-limit", "allowed"],
)
async def test_r13_a_redis_that_keeps_streams_or_a_risk_accepted_opens(
    private_redis: tuple[redis.Redis, str], settings: dict[str, str], options: tuple[str, ...]
) -> None:
    server, url = private_redis
    for name, value in settings.items():
        server.config_set(name, value)
    stream = f"orders-{uuid.uuid4().hex[:6]}"
    transport = RedisStreams.from_url(_with(url, *options), stream, group="billing")
    try:
        await transport.open(1)
    finally:
        await transport.close()
    assert server.exists(stream)
