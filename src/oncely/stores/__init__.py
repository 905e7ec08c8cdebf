"""Open a store from a URL: ``oncely.open("sqlite:///var/lib/app/oncely.db")``.

=======================================  ==============================================
URL                                      store (extra to install)
=======================================  ==============================================
``memory://``                            :class:`~oncely.MemoryStore` (this process only)
``sqlite:///relative/path.db``           :class:`~oncely.SQLiteStore` (``oncely[sqlite]``
                                         for the async one); ``sqlite:////abs/path.db``,
                                         ``sqlite:///:memory:``
``postgresql://user@host:5432/db``       PostgreSQL (``oncely[postgres]``)
``mysql://`` / ``mariadb://``            MariaDB / MySQL (``oncely[mysql]``)
``redis://host:6379/0``                  Redis (``oncely[redis]``)
=======================================  ==============================================

Each store reads its own options from the query string (for SQLite: ``table``,
``synchronous``, ``busy_timeout``, ``pool_size``, ``migrate``) and refuses unknown ones. The
backend module is imported only when its scheme is used, so a missing driver is reported with
the extra that installs it. Passwords never appear in errors or logs (:func:`redact`).
"""

from __future__ import annotations

from typing import Protocol, cast

from oncely._async.protocols import AsyncStore
from oncely._core.clock import Clock
from oncely._sync.protocols import Store
from oncely._urls import load_by_scheme, redact

__all__ = ["SCHEMES", "open_async_store", "open_store", "redact"]


class _FromUrl(Protocol):
    def from_url(self, url: str, *, clock: Clock | None = None) -> object: ...


# scheme -> (sync "module:Class", async "module:Class", extra that installs its driver)
_BACKENDS: dict[str, tuple[str, str, str]] = {
    "memory": ("oncely._sync.memory:MemoryStore", "oncely._async.memory:AsyncMemoryStore", ""),
    "sqlite": (
        "oncely._sync.sqlite:SQLiteStore",
        "oncely._async.sqlite:AsyncSQLiteStore",
        "sqlite",
    ),
    "postgresql": (
        "oncely._sync.postgres:PostgresStore",
        "oncely._async.postgres:AsyncPostgresStore",
        "postgres",
    ),
    "mysql": ("oncely._sync.mysql:MySQLStore", "oncely._async.mysql:AsyncMySQLStore", "mysql"),
    "redis": ("oncely._sync.redis:RedisStore", "oncely._async.redis:AsyncRedisStore", "redis"),
}
_ALIASES = {"postgres": "postgresql", "mariadb": "mysql", "rediss": "redis"}

SCHEMES = tuple(sorted({*_BACKENDS, *_ALIASES}))


def _load(url: str, which: int) -> _FromUrl:
    return cast(_FromUrl, load_by_scheme(url, _BACKENDS, _ALIASES, which, "store"))


def open_store(url: str, *, clock: Clock | None = None) -> Store:
    """A synchronous store for ``url`` (see the module docstring for the schemes)."""
    return cast(Store, _load(url, 0).from_url(url, clock=clock))


def open_async_store(url: str, *, clock: Clock | None = None) -> AsyncStore:
    """An asyncio store for ``url`` (see the module docstring for the schemes)."""
    return cast(AsyncStore, _load(url, 1).from_url(url, clock=clock))
