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
``dynamodb://host:port/table``           DynamoDB (``oncely[dynamodb]``): an endpoint;
                                         ``dynamodb:///table?region=eu-west-1``: AWS
=======================================  ==============================================

Each store reads its own options from the query string (for SQLite: ``table``,
``synchronous``, ``busy_timeout``, ``pool_size``, ``migrate``) and refuses unknown ones. The
backend module is imported only when its scheme is used, so a missing driver is reported with
the extra that installs it. Passwords never appear in errors or logs (:func:`redact`).

Stores are found through the entry-point group ``oncely.stores`` (scheme -> a
:class:`StoreBackend`), so a package of its own adds a scheme (see :mod:`._backend`). This
package also holds what a store author needs: the protocols (:class:`Store`,
:class:`AsyncStore`, the transactional ones), the records and claims a store returns, and
``oncely.testing.contract``, the suite that certifies a store.

One folder per store, each of the same shape: ``dialect`` (statements or scripts as text),
``errors`` (the driver's exceptions as oncely's, and the URL options), ``async_io`` (the
driver's calls and connection pool), ``async_store`` (the store, one class) and, for the SQL
stores, ``async_tx`` (its transaction blocks), each ``async_*`` module the source of a
generated ``sync_*`` twin beside it.
"""

from __future__ import annotations

from oncely._core.clock import Clock
from oncely._core.records import Claim, ClaimRequest, ClaimStatus, Record, Status, StoreStats
from oncely._urls import redact
from oncely.stores._backend import ENTRY_POINT_GROUP, Backend, StoreBackend, backend_for, schemes
from oncely.stores.async_protocols import AsyncStore, AsyncTransactionalStore
from oncely.stores.sync_protocols import Store, TransactionalStore

__all__ = [
    "ENTRY_POINT_GROUP",
    "AsyncStore",
    "AsyncTransactionalStore",
    "Backend",
    "Claim",
    "ClaimRequest",
    "ClaimStatus",
    "Record",
    "Status",
    "Store",
    "StoreBackend",
    "StoreStats",
    "TransactionalStore",
    "backend_for",
    "open_async_store",
    "open_store",
    "redact",
    "schemes",
]


def open_store(url: str, *, clock: Clock | None = None) -> Store:
    """A synchronous store for ``url`` (see the module docstring for the schemes)."""
    return backend_for(url).open(url, clock=clock)


def open_async_store(url: str, *, clock: Clock | None = None) -> AsyncStore:
    """An asyncio store for ``url`` (see the module docstring for the schemes)."""
    return backend_for(url).open_async(url, clock=clock)
