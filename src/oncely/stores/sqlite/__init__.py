"""SQLite stores: :class:`SQLiteStore` and :class:`AsyncSQLiteStore`, one file on one host, shared
by threads and processes; stdlib sqlite3 (aiosqlite for the async store: ``oncely[sqlite]``).

The classes are imported on first use, so importing this package needs no driver; the
entry point ``oncely.stores`` names :data:`backend`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from oncely.stores._backend import Backend

if TYPE_CHECKING:
    from oncely.stores.sqlite.async_store import AsyncSQLiteStore as AsyncSQLiteStore
    from oncely.stores.sqlite.sync_store import SQLiteStore as SQLiteStore

__all__ = ["AsyncSQLiteStore", "SQLiteStore", "backend"]

backend = Backend(
    name="SQLite",
    sync="oncely.stores.sqlite.sync_store:SQLiteStore",
    async_="oncely.stores.sqlite.async_store:AsyncSQLiteStore",
    extra="sqlite",
    schemes=("sqlite",),
)
"""The store of this backend's URL schemes, for :func:`oncely.open`."""

__getattr__ = backend.module_getattr(__name__)
