"""The PostgreSQL store's transaction block and savepoint bookkeeping, each its own class.

:class:`_Transaction` is the block of :meth:`AsyncPostgresStore.transaction
<oncely.stores.postgres.async_store.AsyncPostgresStore.transaction>` (a psycopg transaction on
a pooled connection, its ``BEGIN`` pipelined with the claim when asked to);
:class:`Savepoint` one block of :meth:`AsyncPostgresStore.savepoint
<oncely.stores.postgres.async_store.AsyncPostgresStore.savepoint>`; :class:`Joined`, found with
:func:`joined_on`, oncely's savepoints on one caller connection, shared by every store of the
process. The store, in :mod:`oncely.stores.postgres.async_store`, decides when each is used.
"""

from __future__ import annotations

import contextlib
import weakref
from types import TracebackType
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import pq

from oncely.errors import CommitRefused
from oncely.stores.postgres.async_io import Connection, commit_after

if TYPE_CHECKING:
    from oncely.stores.postgres.async_store import AsyncPostgresStore

__all__ = ["JOINED", "OPEN_SAVEPOINTS", "Joined", "Savepoint", "joined_on"]

_TX = pq.TransactionStatus
_NOT_STARTED = psycopg.Transaction.Status.NOT_STARTED  # (the one enum of both kinds)
# At most this many of oncely's savepoints are left open in one caller transaction (each is
# a subtransaction the server keeps until the transaction ends: about 10 KiB of its memory,
# and one more level that parts of it walk); past that, each is released at the end of its
# block, one more round trip.
OPEN_SAVEPOINTS = 100


class _Transaction:
    """``async with store.transaction() as tx``: a psycopg transaction block on a pooled
    connection; committed when the block ends, rolled back when it raises. psycopg forbids
    ``tx.commit()`` inside the block, so a handler cannot split the marker from its writes.
    A class, not a generator: it is on the hot path of every transactional message.

    With ``claim_first`` the block is left unentered (nothing sent) and handed to the claim
    through the connection's :class:`Joined` entry: :meth:`AsyncPostgresStore.claim_in` enters
    it in the claim's own round trip. A block that ends before any claim ran has sent
    nothing, and nothing is committed or rolled back.

    Each SQL store has its own, alike in shape: one shared class with per-driver hooks would
    add a call to every BEGIN and COMMIT."""

    __slots__ = ("_block", "_claim_first", "_conn", "_store")

    def __init__(self, store: AsyncPostgresStore, claim_first: bool = False) -> None:
        self._store = store
        self._claim_first = claim_first
        self._conn: Connection | None = None
        self._block: Any = None

    async def __aenter__(self) -> Connection:
        conn = await self._store._acquire("begin")
        self._store._joined_checked[conn] = True  # the store's own: on its database
        if self._claim_first:
            # The Transaction itself, not conn.transaction() (a generator around it that, on
            # a connection in pipeline mode, nests pipelines around its entry): the claim
            # enters it inside its own pipeline.
            pending = psycopg.AsyncTransaction(conn)
            joined = joined_on(conn)
            joined.begin, joined.own = pending, True
            self._conn, self._block = conn, pending
            return conn
        block = conn.transaction()
        try:
            await block.__aenter__()
        except BaseException as exc:
            await self._store._release(conn)
            if isinstance(exc, psycopg.Error):
                raise self._store._error(exc, "begin") from exc
            raise
        self._conn, self._block = conn, block
        return conn

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        conn, block = self._conn, self._block
        assert conn is not None
        self._conn = self._block = None
        try:
            result: dict[str, Any] | None = None
            if self._claim_first:
                joined = joined_on(conn)
                result, joined.result, joined.own = joined.result, None, False
                if joined.begin is block:
                    joined.begin = None
                if block.status is _NOT_STARTED:
                    return None  # no claim ran: no BEGIN went out, nothing to end
            try:
                if result is not None and exc_type is None:
                    # The result's UPDATE (set_result_in) goes out with the COMMIT.
                    await commit_after(conn, block, self._store._dialect.set_result, result)
                    return None
                suppressed: bool | None = await block.__aexit__(exc_type, exc, tb)
            except psycopg.Error as error:
                if conn.info.transaction_status == _TX.INERROR:
                    await _rollback_quietly(conn)  # the UPDATE failed: COMMIT never ran
                if exc is None:
                    store = self._store
                    if _refused_at_commit(error, store._dialect.table):
                        raise CommitRefused(str(store._error(error, "commit"))) from error
                    raise store._error(error, "commit") from error
                return None  # the block's own error wins; the pool drops a broken connection
            return suppressed
        finally:
            await self._store._release(conn)


def _refused_at_commit(error: psycopg.Error, table: str) -> bool:
    """Whether ``error`` is a constraint (SQLSTATE class 23) on another table than the
    store's: a write of the block that a constraint checked at COMMIT refused."""
    return (error.sqlstate or "")[:2] == "23" and error.diag.table_name != table


async def _rollback_quietly(conn: Connection) -> None:
    with contextlib.suppress(psycopg.Error):  # a broken connection: the pool drops it
        await conn.rollback()


class Savepoint:
    """One block of :meth:`AsyncPostgresStore.savepoint`: its name, whether the server has
    set it, when its transaction started (from the claim that set it), and how many of
    oncely's savepoints were left open before it."""

    __slots__ = ("base", "name", "set", "sql", "stamp")

    def __init__(self, depth: int) -> None:
        self.name = b"oncely_%d" % depth
        self.sql = b"SAVEPOINT " + self.name
        self.set = False
        self.stamp: int | None = None
        self.base = 0

    def established(self) -> None:
        self.set = True


class Joined:
    """oncely's savepoints on one caller connection, whichever store set them: the one whose
    ``SAVEPOINT`` waits for its block's first statement, how many blocks are open, and how
    many savepoints are left open in the transaction that started at ``stamp``. On one of
    the store's own connections in ``transaction(claim_first=True)`` (``own``), ``begin`` is
    its transaction block while its ``BEGIN`` waits for the claim, and ``result`` the
    parameters of a result's UPDATE waiting for its ``COMMIT``."""

    __slots__ = ("begin", "depth", "kept", "own", "pending", "result", "stamp")

    def __init__(self) -> None:
        self.begin: Any = None
        self.own = False
        self.result: dict[str, Any] | None = None
        self.pending: Savepoint | None = None
        self.depth = 0
        self.stamp: int | None = None
        self.kept = 0


# Per caller connection, shared by every store of the process: the names depend on it.
JOINED: weakref.WeakKeyDictionary[Connection, Joined] = weakref.WeakKeyDictionary()


def joined_on(tx: Connection) -> Joined:
    """The savepoints of ``tx`` (made on first use)."""
    found = JOINED.get(tx)
    if found is None:
        found = JOINED[tx] = Joined()
    return found
