"""The MariaDB / MySQL store's transactional mode (R7), but for its claim (``claim_in``).

:class:`MySQLTransactions`: transactions opened for the caller (``BEGIN`` on a pooled
connection, which stays in autocommit mode for two-phase work), savepoints in a caller's
transaction (left in place, not released), checks and writes on a caller's connection. How
the store's modules divide the work is told in ``sql_base``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import TracebackType
from typing import Any

from oncely.errors import TransactionRequired
from oncely.stores.mysql.async_base import MySQLStoreBase
from oncely.stores.mysql.async_io import Connection, execute
from oncely.stores.mysql.dialect import who
from oncely.stores.mysql.errors import DRIVER_ERRORS, disconnected, joinable, translate

__all__ = ["MySQLTransactions"]


class MySQLTransactions(MySQLStoreBase):
    """The transactional mode of :class:`~oncely.AsyncMySQLStore` (see there)."""

    def transaction(self, *, claim_first: bool = False) -> _Transaction:
        # PyMySQL cannot send BEGIN with the claim in one round trip: claim_first changes
        # nothing here.
        return _Transaction(self)

    @asynccontextmanager
    async def savepoint(self, tx: Connection) -> AsyncIterator[None]:
        """A savepoint around the block: rolled back to when it raises; left in place when it
        succeeds (no RELEASE round trip).

        MariaDB and MySQL replace a savepoint by a new one of the same name, and a left one
        costs nothing but its entry in the transaction's list, so the name is the store's
        and the number of its blocks open on ``tx`` around this one: the next message's
        savepoint replaces it (the list stays as long as the deepest nesting), while a block
        open around this one keeps its own name, which a rollback to it still finds (and the
        rollback drops every savepoint set after it). The transaction's end drops them all.
        """
        depth = self._depth.get(tx, 0)
        name = f"{self._savepoint_prefix}{depth}"
        await self._joined(tx, f"SAVEPOINT {name}", "savepoint")
        self._depth[tx] = depth + 1
        try:
            yield
        except BaseException:
            await self._joined(tx, f"ROLLBACK TO SAVEPOINT {name}", "rolling back to a savepoint")
            raise
        finally:
            self._depth[tx] = depth

    async def _joined(
        self, tx: Connection, sql: str, op: str, params: dict[str, Any] | None = None
    ) -> None:
        try:
            await execute(tx, sql, params)
        except DRIVER_ERRORS as exc:
            raise translate(exc, op, joined=True) from exc

    def check_transaction(self, tx: Connection) -> None:
        if not joinable(tx):
            raise TransactionRequired(
                "the connection has no open transaction: run BEGIN (conn.begin()) first or "
                "turn autocommit off, or call without tx= to let oncely open and commit one"
            )

    async def set_result_in(
        self, tx: Connection, consumer: str, key: str, *, token: str, result: bytes | None
    ) -> None:
        params = who(consumer, key)
        params.update(token=token.encode("utf-8"), result=result)
        await self._joined(tx, self._dialect.set_result, "storing the result", params)


class _Transaction:
    """``store.transaction()``: BEGIN on a pooled connection; COMMIT when the
    block ends, ROLLBACK when it raises. A class, not a generator: it is on the hot path of
    every transactional message.

    Each SQL store has its own, alike in shape: one shared class with per-driver hooks would
    add a call to every BEGIN and COMMIT."""

    __slots__ = ("_conn", "_store")

    def __init__(self, store: MySQLStoreBase) -> None:
        self._store = store
        self._conn: Connection | None = None

    async def __aenter__(self) -> Connection:
        conn = await self._store._acquire()
        try:
            await execute(conn, "BEGIN")
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
                    await execute(conn, "COMMIT")
                except DRIVER_ERRORS as error:
                    discard = disconnected(error)
                    raise translate(error, "commit", joined=True) from error
        finally:
            await self._store._release(conn, discard=discard)  # rolls back whatever is open
