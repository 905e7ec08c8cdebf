"""The MariaDB / MySQL store's transaction block, a class of its own.

:class:`_Transaction` is the block of :meth:`AsyncMySQLStore.transaction
<oncely.stores.mysql.async_store.AsyncMySQLStore.transaction>`: autocommit turned off on a
pooled connection for the block, so that a statement the handler runs after the server rolled
the transaction back (a deadlock it caught) opens a new transaction instead of committing on
its own; turned on again when the block ends, which commits (``SET autocommit = 1`` commits
what is open, in the round trip a ``COMMIT`` would take), or after a ``ROLLBACK`` when it
raises. The store, in :mod:`oncely.stores.mysql.async_store`, holds the rest of the
transactional mode.
"""

from __future__ import annotations

from types import TracebackType
from typing import TYPE_CHECKING

from oncely.stores.mysql.async_io import Connection, execute
from oncely.stores.mysql.errors import DRIVER_ERRORS, disconnected, translate

if TYPE_CHECKING:
    from oncely.stores.mysql.async_store import AsyncMySQLStore

__all__: list[str] = []  # _Transaction is the store's own


class _Transaction:
    """``store.transaction()``: autocommit off on a pooled connection; on again (which
    commits) when the block ends, after a ROLLBACK when it raises. A class, not a
    generator: it is on the hot path of every transactional message.

    Each SQL store has its own, alike in shape: one shared class with per-driver hooks would
    add a call to every BEGIN and COMMIT."""

    __slots__ = ("_conn", "_store")

    def __init__(self, store: AsyncMySQLStore) -> None:
        self._store = store
        self._conn: Connection | None = None

    async def __aenter__(self) -> Connection:
        conn = await self._store._acquire()
        self._store._joined_checked[conn] = True  # the store's own: on its database
        try:
            await execute(conn, "SET autocommit = 0")
            conn.doubts = 0  # nothing since can have ended the transaction (held_in)
        except BaseException as exc:
            broken = isinstance(exc, DRIVER_ERRORS) and disconnected(exc)
            await self._store._release(conn, discard=broken)
            if isinstance(exc, DRIVER_ERRORS):
                raise translate(exc, "begin") from exc
            raise
        self._conn = conn
        return conn

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        conn = self._conn
        assert conn is not None
        self._conn = None
        discard = False
        try:
            if exc_type is None:
                try:
                    await execute(conn, "SET autocommit = 1")  # commits
                except DRIVER_ERRORS as error:
                    discard = True  # autocommit may still be off
                    raise translate(error, "commit", joined=True) from error
            else:
                try:
                    await execute(conn, "ROLLBACK")
                    await execute(conn, "SET autocommit = 1")
                except DRIVER_ERRORS:
                    discard = True  # the pool drops it (and its transaction, if any)
        finally:
            await self._store._release(conn, discard=discard)
