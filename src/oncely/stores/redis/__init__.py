"""Redis stores: :class:`RedisStore` and :class:`AsyncRedisStore`, one server or a Redis Cluster,
on redis-py (``oncely[redis]``).

The classes are imported on first use, so importing this package needs no driver; the
entry point ``oncely.stores`` names :data:`backend`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from oncely.stores._backend import Backend

if TYPE_CHECKING:
    from oncely.stores.redis.async_store import AsyncRedisStore as AsyncRedisStore
    from oncely.stores.redis.sync_store import RedisStore as RedisStore

__all__ = ["AsyncRedisStore", "RedisStore", "backend"]

backend = Backend(
    name="Redis",
    sync="oncely.stores.redis.sync_store:RedisStore",
    async_="oncely.stores.redis.async_store:AsyncRedisStore",
    extra="redis",
    schemes=("redis", "rediss"),
)
"""The store of this backend's URL schemes, for :func:`oncely.open`."""

__getattr__ = backend.module_getattr(__name__)
