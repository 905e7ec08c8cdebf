"""The Redis store against the reference model's state machine
(``tests/contract/test_model_stateful.py``): single server, asyncio, and cluster."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test
from redis.cluster import RedisCluster

import oncely
from oncely import FakeClock
from tests.backends.redis import drop_prefix, with_options
from tests.contract.test_model_stateful import Blocking, _machine
from tests.services import REDIS_URL
from tests.stores.redis.helpers import _url_for

# ---------------------------------------------------------------- the reference model


def _model_factory(where: str, cluster_url: str | None) -> Callable[[Path, FakeClock], Any]:
    """Stores for the model's state machine, each on a fresh prefix it drops when closed."""

    def make(_directory: Path, clock: FakeClock) -> Any:
        prefix = f"m_{uuid.uuid4().hex[:12]}"
        if where == "redis-cluster":
            assert cluster_url is not None
            store: Any = oncely.open(with_options(cluster_url, prefix=prefix), clock=clock)
            admin: Any = RedisCluster.from_url(cluster_url.split("?")[0])
        elif where == "async-redis":
            store = Blocking(oncely.open_async(with_options(REDIS_URL, prefix=prefix), clock=clock))
            admin = redis.Redis.from_url(REDIS_URL)
        else:
            store = oncely.open(with_options(REDIS_URL, prefix=prefix), clock=clock)
            admin = redis.Redis.from_url(REDIS_URL)
        return _Dropping(store, admin, prefix)

    return make


class _Dropping:
    """A store that deletes its keys when the state machine closes it."""

    def __init__(self, store: Any, admin: Any, prefix: str) -> None:
        self._store, self._admin, self._prefix = store, admin, prefix

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def close(self) -> None:
        try:
            self._store.close()
        finally:
            drop_prefix(self._admin, self._prefix)
            self._admin.close()


@pytest.mark.services
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("where", "examples"), [("redis", 80), ("async-redis", 25), ("redis-cluster", 25)]
)
def test_r8_r10_r13_the_redis_store_matches_the_model(
    where: str, examples: int, request: pytest.FixtureRequest
) -> None:
    """The shared state machine (tests/contract/test_model_stateful.py) drives the Lua scripts
    and the reference table with the same operations and compares every answer."""
    url = _url_for("redis-cluster" if where == "redis-cluster" else "redis", request)
    machine = _machine(_model_factory(where, url if where == "redis-cluster" else None), False)
    run_state_machine_as_test(
        machine, settings=settings(max_examples=examples, stateful_step_count=40, deadline=None)
    )
