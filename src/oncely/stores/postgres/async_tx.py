"""The PostgreSQL store's transactional mode (R7), but for its claim (``claim_in``).

:class:`PostgresTransactions`: transactions opened for the caller (a psycopg transaction
block), oncely's savepoints in a caller's transaction (pipelined with the claim that
``claim_in`` sends, left open rather than released: see
:meth:`PostgresTransactions.savepoint`), checks and writes on a caller's connection. How the
store's modules divide the work is told in ``sql_base``.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import TracebackType
from typing import Any

import psycopg
from psycopg import pq

from oncely.errors import StoreUnavailable, TransactionRequired
from oncely.stores.postgres.async_base import PostgresStoreBase
from oncely.stores.postgres.async_io import Connection, commit_after, execute, is_connection

__all__ = ["JOINED", "OPEN_SAVEPOINTS", "Joined", "PostgresTransactions", "Savepoint", "joined_on"]

_TX = pq.TransactionStatus
_NOT_STARTED = psycopg.Transaction.Status.NOT_STARTED  # (the one enum of both kinds)
# At most this many of oncely's savepoints are left open in one caller transaction (each is
# a subtransaction the server keeps until the transaction ends: about 10 KiB of its memory,
# and one more level that parts of it walk); past that, each is released at the end of its
# block, one more round trip.
OPEN_SAVEPOINTS = 100


class PostgresTransactions(PostgresStoreBase):
    """The transactional mode of :class:`~oncely.AsyncPostgresStore` (see there)."""

    def transaction(self, *, claim_first: bool = False) -> _Transaction:
        """A transaction on a pooled connection. With ``claim_first`` (the block's first
        statement is :meth:`claim_in`, as in :meth:`Inbox.handle_in_transaction
        <oncely.AsyncInbox.handle_in_transaction>`), its ``BEGIN`` is not sent on entry but
        with that claim, in one pipeline: the transaction costs no round trip of its own."""
        return _Transaction(self, claim_first)

    @asynccontextmanager
    async def savepoint(self, tx: Connection) -> AsyncIterator[None]:
        """A savepoint around the store's work in ``tx``, at no extra round trip when the
        block succeeds.

        Nothing is sent on entry: the ``SAVEPOINT`` goes out in one round trip with the
        first statement the store runs inside the block (the claim of :meth:`claim_in`,
        pipelined), so a block in which the store runs nothing sets none. When the block
        raises, the transaction is rolled back to it (one round trip). Either way it is then
        left open, not released: the enclosing transaction (or savepoint) takes its work over
        when it ends, exactly as a RELEASE would have, and no round trip is spent.

        ``ROLLBACK TO`` names the most recent savepoint of a name, and one left open may
        still be there: a savepoint is named after the number of oncely's blocks open on
        ``tx`` around it, so none created while it is open has its name, and a rollback to it
        (which also drops every savepoint opened inside it) finds it. The names being few,
        psycopg's statement cache does not churn (and it clears its prepared statements only
        the first time it sees a rollback text). At most ``OPEN_SAVEPOINTS`` are left open
        per caller transaction (told apart by their start time); past that each is released
        as its block ends.
        """
        joined = joined_on(tx)
        if joined.pending is not None:  # an enclosing block has sent nothing yet: set it first
            await self._establish(tx, joined)
        depth = joined.depth
        point = Savepoint(depth)
        joined.pending = point
        joined.depth = depth + 1
        try:
            yield
        except BaseException:
            if joined.pending is point:
                joined.pending = None  # never set: the store did nothing to undo
            elif point.set:
                await self._run(tx, b"ROLLBACK TO SAVEPOINT " + point.name, "rollback to savepoint")
                joined.kept = min(joined.kept, point.base)  # those opened inside it are gone
                await self._leave(tx, joined, point)
            raise
        else:
            if joined.pending is point:
                joined.pending = None
            elif point.set:
                await self._leave(tx, joined, point)
        finally:
            joined.depth = depth

    async def _leave(self, tx: Connection, joined: Joined, point: Savepoint) -> None:
        """Leave a savepoint open at the end of its block, or release it past the bound."""
        if joined.kept < OPEN_SAVEPOINTS:
            joined.kept += 1
        else:
            await self._run(tx, b"RELEASE SAVEPOINT " + point.name, "release savepoint")

    async def _establish(self, tx: Connection, joined: Joined) -> None:
        """Send the pending ``SAVEPOINT`` on its own (the store is about to run something
        other than a claim in its block)."""
        point = joined.pending
        assert point is not None
        joined.pending = None
        await self._run(tx, point.sql, "savepoint")
        point.established()
        point.base = joined.kept

    async def _run(self, tx: Connection, sql: bytes, op: str, params: Any = None) -> None:
        try:
            await execute(tx, sql, params)
        except psycopg.Error as exc:
            raise self._error(exc, op) from exc

    def check_transaction(self, tx: Connection) -> None:
        if not is_connection(tx):
            raise TransactionRequired(
                f"{type(self).__name__} joins a psycopg connection of its kind (sync or "
                f"asyncio), not {type(tx).__name__}"
            )
        status = tx.info.transaction_status
        if status == _TX.INTRANS or (status == _TX.IDLE and not tx.autocommit):
            return  # without autocommit, psycopg opens the transaction at the first statement
        if status == _TX.INERROR:
            raise TransactionRequired(
                "the connection's transaction failed earlier (a statement raised): roll it back"
            )
        if status == _TX.UNKNOWN or tx.closed:
            raise StoreUnavailable("the connection is closed or broken")
        if status == _TX.ACTIVE:
            raise TransactionRequired("a statement is still running on the connection")
        raise TransactionRequired(
            "the connection is in autocommit mode with no open transaction: open one with "
            "`conn.transaction()`, or call without tx= to let oncely open and commit one"
        )

    async def set_result_in(
        self, tx: Connection, consumer: str, key: str, *, token: str, result: bytes | None
    ) -> None:
        params = {"consumer": consumer, "key": key, "token": token, "result": result}
        joined = JOINED.get(tx)
        if joined is not None:
            begin = joined.begin
            if begin is not None:  # a transaction whose claim never ran: begin it now
                joined.begin = None
                await begin.__aenter__()
            if joined.own and not joined.depth and joined.result is None:
                # The store's own transaction, outside any savepoint of a nested message:
                # the UPDATE goes out with its COMMIT.
                joined.result = params
                return
            if joined.pending is not None:
                await self._establish(tx, joined)
        await self._run(tx, self._dialect.set_result, "storing the result", params)


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

    def __init__(self, store: PostgresStoreBase, claim_first: bool = False) -> None:
        self._store = store
        self._claim_first = claim_first
        self._conn: Connection | None = None
        self._block: Any = None

    async def __aenter__(self) -> Connection:
        conn = await self._store._acquire("begin")
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
                    raise self._store._error(error, "commit") from error
                return None  # the block's own error wins; the pool drops a broken connection
            return suppressed
        finally:
            await self._store._release(conn)


async def _rollback_quietly(conn: Connection) -> None:
    with contextlib.suppress(psycopg.Error):  # a broken connection: the pool drops it
        await conn.rollback()


class Savepoint:
    """One block of :meth:`PostgresTransactions.savepoint`: its name, whether the server has
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
