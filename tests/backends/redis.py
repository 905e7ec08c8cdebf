"""The Redis store on the machine's Redis server (``ONCELY_TEST_REDIS_URL``), each test on a key
prefix of its own: the threaded store on a ``redis.Redis`` client the test owns, the asyncio
store through its URL (it owns that client)."""

from __future__ import annotations

import redis

import oncely
from oncely import FakeClock
from oncely.stores.redis.sync_store import RedisStore
from tests.services import REDIS_URL, require

from . import Backend, Scope


def with_options(url: str, **options: str) -> str:
    """``url`` with ``options`` added to its query string."""
    extra = "&".join(f"{name}={value}" for name, value in options.items())
    return f"{url}{'&' if '?' in url else '?'}{extra}"


def drop_prefix(client: redis.Redis | redis.RedisCluster, prefix: str) -> int:
    """Delete every key of a store's ``prefix`` (on a cluster: on every primary)."""
    names = list(client.scan_iter(match=f"{prefix}:*", count=1000))
    for name in names:
        client.delete(name)
    return len(names)


def _prefix(scope: Scope) -> str:
    return f"t_{scope.unique}"


def _client(scope: Scope) -> redis.Redis:
    client = redis.Redis.from_url(REDIS_URL)

    def finish() -> None:
        try:
            drop_prefix(client, _prefix(scope))
        finally:
            client.close()

    scope.finalizers.append(finish)
    return client


def _sync(scope: Scope, clock: FakeClock | None) -> oncely.Store:
    return RedisStore(_client(scope), prefix=_prefix(scope), clock=clock)


def _async(scope: Scope, clock: FakeClock | None) -> oncely.AsyncStore:
    _client(scope)  # only to drop the keys afterwards
    return oncely.open_async(with_options(REDIS_URL, prefix=_prefix(scope)), clock=clock)


BACKEND = Backend(
    name="redis",
    make_sync=_sync,
    make_async=_async,
    require=lambda: require("Redis", REDIS_URL, 6379),
)
