"""PostgreSQL stores: :class:`PostgresStore` and :class:`AsyncPostgresStore`, on psycopg 3 and
psycopg_pool (``oncely[postgres]``).

The classes are imported on first use, so importing this package needs no driver; the
entry point ``oncely.stores`` names :data:`backend`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from oncely.stores._backend import Backend

if TYPE_CHECKING:
    from oncely.stores.postgres.async_store import AsyncPostgresStore as AsyncPostgresStore
    from oncely.stores.postgres.sync_store import PostgresStore as PostgresStore

__all__ = ["AsyncPostgresStore", "PostgresStore", "backend"]

backend = Backend(
    name="PostgreSQL",
    sync="oncely.stores.postgres.sync_store:PostgresStore",
    async_="oncely.stores.postgres.async_store:AsyncPostgresStore",
    extra="postgres",
    schemes=("postgresql", "postgres"),
)
"""The store of this backend's URL schemes, for :func:`oncely.open`."""

__getattr__ = backend.module_getattr(__name__)
