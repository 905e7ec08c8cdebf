"""MariaDB / MySQL stores: :class:`MySQLStore` and :class:`AsyncMySQLStore`, on PyMySQL and
aiomysql (``oncely[mysql]``).

The classes are imported on first use, so importing this package needs no driver; the
entry point ``oncely.stores`` names :data:`backend`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from oncely.stores._backend import Backend

if TYPE_CHECKING:
    from oncely.stores.mysql.async_store import AsyncMySQLStore as AsyncMySQLStore
    from oncely.stores.mysql.sync_store import MySQLStore as MySQLStore

__all__ = ["AsyncMySQLStore", "MySQLStore", "backend"]

backend = Backend(
    name="MariaDB / MySQL",
    sync="oncely.stores.mysql.sync_store:MySQLStore",
    async_="oncely.stores.mysql.async_store:AsyncMySQLStore",
    extra="mysql",
    schemes=("mysql", "mariadb"),
)
"""The store of this backend's URL schemes, for :func:`oncely.open`."""

__getattr__ = backend.module_getattr(__name__)
