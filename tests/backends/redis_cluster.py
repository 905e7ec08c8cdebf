"""The Redis store on a real three-node Redis Cluster that the test session starts itself
(:mod:`tests.redis_cluster`), each test on a key prefix of its own: the threaded store on a
``RedisCluster`` client the test owns, the asyncio store through a ``?cluster=true`` URL."""

from __future__ import annotations

import pytest
from redis.cluster import RedisCluster

import oncely
from oncely import FakeClock
from oncely.stores.redis.sync_store import RedisStore
from tests import redis_cluster
from tests.services import REQUIRED

from . import Backend, Scope
from .redis import drop_prefix, with_options


def require_cluster() -> redis_cluster.Cluster:
    """The session's cluster; skip (or, under ONCELY_REQUIRE_SERVICES=1, fail) without it."""
    try:
        return redis_cluster.cluster()
    except redis_cluster.ClusterUnavailable as exc:
        if REQUIRED:
            pytest.fail(f"ONCELY_REQUIRE_SERVICES=1 and {exc}")
        pytest.skip(str(exc))


def _prefix(scope: Scope) -> str:
    return f"t_{scope.unique}"


def _client(scope: Scope) -> RedisCluster:
    port = require_cluster().ports[0]
    client = RedisCluster(host="127.0.0.1", port=port)

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
    url = with_options(require_cluster().url, prefix=_prefix(scope))
    return oncely.open_async(url, clock=clock)


def _require() -> None:
    require_cluster()


BACKEND = Backend(name="redis-cluster", make_sync=_sync, make_async=_async, require=_require)
