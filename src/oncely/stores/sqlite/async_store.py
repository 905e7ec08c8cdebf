"""The SQLite store: one file, any number of threads and processes, both modes.

WAL journal, ``BEGIN IMMEDIATE`` for every transaction oncely opens (so a reader never has to
upgrade to a writer and deadlock), a busy timeout for the single-writer lock, and one
``INSERT ... ON CONFLICT ... RETURNING`` per claim (:mod:`oncely.stores.sqlite.dialect`). Several
processes may share the file on one host; a network file system is not supported (SQLite's
locking does not hold there).

First use is safe under concurrency. ``PRAGMA journal_mode = WAL`` answers "database is
locked" at once, without calling the busy handler, while another connection holds a write lock
on a file still in a rollback journal (a fleet starting together on a file the application
made): each step of the setup is tried again, with a jittered backoff, until the busy timeout
(:meth:`AsyncSQLiteStore._patiently`); a file another process switched meanwhile is simply in
WAL when the pragma runs again, and the schema statements tolerate a concurrent creator
(``IF NOT EXISTS``, ``ON CONFLICT DO NOTHING``). The first use inside a caller's own
transaction checks the schema on the caller's connection instead
(:meth:`AsyncSQLiteStore._prepare_in`): a connection of oncely's own would wait for the lock
that very transaction holds.

:class:`AsyncSQLiteStore` is one class, in four sections: construction and connections
(opening connections with the busy timeout and pragmas, the pool, closing); schema and
maintenance (WAL, the schema and its first use inside a caller's transaction, the purge); the
message path (the claim, the fenced writes); the transactional mode (transactions opened for
the caller, ``BEGIN IMMEDIATE``; savepoints, checks and writes on a caller's connection; and
``claim_in``, which shares the claim's code). The reads, ``forget``, the schema check and the
purge's loop are :class:`~oncely.stores.async_sql.SQLStoreBase`'s; the transaction block is a
class of its own, in :mod:`oncely.stores.sqlite.async_tx`.
"""

from __future__ import annotations

from oncely._core.records import Completion
from oncely._twin import ASYNC
from oncely.errors import LeaseLost
from oncely.stores.async_protocols import complete_each

if ASYNC:
    from asyncio import sleep
else:
    from time import sleep

import functools
import os
import random
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager, suppress
from time import monotonic
from typing import Any, Final, Self, TypeVar

import aiosqlite

from oncely._core.clock import Clock, SystemClock
from oncely._core.records import (
    Claim,
    ClaimRequest,
    ClaimStatus,
    Record,
    Status,
    StoreStats,
    new_claim,
    new_record,
)
from oncely._core.state import Lost, claimable
from oncely._core.table import lease_lost, unfenced
from oncely.errors import SchemaMissing, SchemaOutdated, StoreUnavailable, TransactionRequired
from oncely.stores._compact import pack_fingerprint, pack_token
from oncely.stores._offsets import OffsetSQL, check_position
from oncely.stores._sql import (
    MAX_CONSUMERS,
    SMALL,
    Estimate,
    marker_missing,
    parse_versions,
    purge_bucket,
)
from oncely.stores.async_sql import Position, SQLStoreBase
from oncely.stores.sqlite.async_io import AsyncPool, Params, close, connect, fetchall
from oncely.stores.sqlite.async_tx import _Transaction
from oncely.stores.sqlite.dialect import (
    ENDED_COUNTED,
    OLD_STATUS_CHECK,
    REVISION_NOTE,
    SCHEMA_REVISION,
    SCHEMA_VERSION,
    SQLiteDialect,
    parse_record,
)
from oncely.stores.sqlite.errors import (
    SQLiteSettings,
    is_busy,
    missing_directory,
    parse_url,
    translate,
)

__all__ = ["AsyncSQLiteStore"]

T = TypeVar("T")

_FIRST_BACKOFF_S: Final = 0.001
_MAX_BACKOFF_S: Final = 0.05


try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: one process leads the purge, unchecked
    fcntl = None  # type: ignore[assignment]

_PURGE_WRITE_ROWS = 100

# SQLite refuses a string, a blob or a row over its length limit (SQLITE_MAX_LENGTH, 1e9 bytes
# unless the library was built with another): a result is kept up to it, less room for the
# row's other values.
_ROW_ROOM = 64 * 1024


def _length_limit() -> int:
    """The SQLite library's length limit, as its connections start with it."""
    probe = sqlite3.connect(":memory:")
    try:
        return int(probe.getlimit(sqlite3.SQLITE_LIMIT_LENGTH))
    finally:
        probe.close()


@functools.cache
def _result_room() -> tuple[int, str]:
    limit = _length_limit()
    why = f"SQLite's length limit is {limit} bytes for a blob and for a row"
    return max(0, limit - _ROW_ROOM), why


"""Rows a purge deletes (or moves) per write transaction (see ``_purge_batch``)."""


class AsyncSQLiteStore(SQLStoreBase[str]):
    """A dedup store in a SQLite database file (transactional and two-phase modes).

    ``path`` is a file path, ``":memory:"`` (one connection; for tests) or a ``file:`` URI.
    The schema is created (and the file switched to WAL) on first use unless
    ``migrate=False``, in which case a missing schema raises :class:`~oncely.SchemaMissing`;
    a schema written by a newer oncely raises :class:`~oncely.SchemaTooNew`. Processes
    starting together on one file wait for each other's locks there, up to the busy timeout.
    A first use inside a transaction of yours (``handle_in_transaction(tx=...)``) checks the
    schema through your connection and never waits for your own lock: missing tables are then
    :class:`~oncely.SchemaMissing` at once (run ``oncely migrate`` or :meth:`migrate` first).
    At most ``pool_size`` connections are in use at once.

    The asyncio variant belongs to the event loop that first uses it (its pool waits on an
    asyncio semaphore): open one store per loop. The threaded variant may be shared by any
    number of threads. After ``fork`` a child opens connections of its own; never fork in the
    middle of a transaction.
    """

    _family = "sqlite"

    _SCHEMA_VERSION = SCHEMA_VERSION
    _SCHEMA_REVISION = SCHEMA_REVISION
    _REVISION_NOTE = REVISION_NOTE
    _dialect: SQLiteDialect
    _now: Callable[[], int]  # SQLite has no clock of its own: always the store's

    # ------------------------------------------------------------ construction and connections

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        table: str = "oncely_inbox",
        settings: SQLiteSettings | None = None,
        pool_size: int = 4,
        clock: Clock | None = None,
        migrate: bool = True,
    ) -> None:
        super().__init__(migrate=migrate)
        self._path = os.fspath(path)
        self._uri = self._path.startswith("file:")
        self._memory = self._path == ":memory:"
        self._dialect = SQLiteDialect(table)
        self._offset_sql = OffsetSQL.sqlite(table)
        self._settings = settings if settings is not None else SQLiteSettings()
        self._clock: Clock = clock if clock is not None else SystemClock()
        self._now = self._clock.now_ms
        size = 1 if self._memory else pool_size
        if size < 1:
            raise ValueError("pool_size must be at least 1")
        self._pool = AsyncPool(self._open, size)
        # The tables were seen from inside a caller's transaction on a file not (yet) in WAL:
        # claims there go ahead; the store's own first connection still switches the file.
        self._schema_seen = False

    @classmethod
    def from_url(cls, url: str, *, clock: Clock | None = None) -> Self:
        """A store for a ``sqlite:///`` URL (see :func:`oncely.open`)."""
        options = parse_url(url)
        return cls(
            options.path,
            table=options.table,
            settings=options.settings,
            pool_size=options.pool_size,
            clock=clock,
            migrate=options.migrate,
        )

    @property
    def url(self) -> str:
        return f"sqlite:///{self._path}"

    @property
    def table(self) -> str:
        return self._dialect.table

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._path!r}, table={self._dialect.table!r})"

    @property
    def _place(self) -> str:
        return f"table {self._dialect.table} in {self._path}"

    async def _open(self) -> aiosqlite.Connection:
        try:
            conn = await connect(
                self._path, timeout=self._settings.busy_timeout.total_seconds(), uri=self._uri
            )
            for pragma in self._settings.pragmas():
                await fetchall(conn, pragma)
        except sqlite3.Error as exc:
            missing = missing_directory(self._path)
            if missing is not None:  # not a store to try again later: say what is wrong
                raise missing from None
            raise translate(exc, f"opening {self._path}") from exc
        return conn

    async def _acquire(self) -> aiosqlite.Connection:
        if self._closed:
            raise self._closed_error()
        if not self._ready:
            await self._prepare()
        return await self._pool.acquire()

    async def _release(self, conn: aiosqlite.Connection) -> None:
        """Return a connection, rolling back anything an interrupted operation left open."""
        if not conn.in_transaction:
            await self._pool.release(conn)
            return
        discard = False
        try:
            await self._pool.execute(conn, "ROLLBACK")
        except sqlite3.Error:
            discard = True
        await self._pool.release(conn, discard)

    @asynccontextmanager
    async def _connection(self) -> AsyncIterator[aiosqlite.Connection]:
        conn = await self._acquire()
        try:
            yield conn
        finally:
            await self._release(conn)

    async def _rows(self, op: str, sql: str, params: Mapping[str, object]) -> list[Any]:
        conn = await self._acquire()
        try:
            return await self._pool.fetchall(conn, sql, params)
        except sqlite3.Error as exc:
            raise translate(exc, op) from exc
        finally:
            await self._release(conn)

    async def _create_offsets(self) -> None:
        conn = await self._acquire()
        try:
            await self._pool.execute(conn, self._offset_sql.create)
        except sqlite3.Error as exc:
            raise translate(exc, "creating the offsets table") from exc
        finally:
            await self._release(conn)

    async def aclose(self) -> None:
        self._closed = True
        await self._pool.close()

    # ------------------------------------------------------------ schema and maintenance

    async def _setup(self, *, migrating: bool) -> None:
        # On a connection of its own, kept for the pool afterwards (for ":memory:", the only
        # one: the database lives and dies with it). Each step waits out other connections'
        # locks, all of them together up to the busy timeout.
        conn = await self._open()
        try:
            deadline = monotonic() + self._settings.busy_timeout.total_seconds()
            if not self._memory:
                await self._patiently("switching to WAL", self._wal, conn, deadline)
            version, revision = await self._patiently(
                "reading the schema version", self._versions, conn, deadline
            )
            # migrate runs the CREATE ... IF NOT EXISTS again whatever the version: the
            # version row says nothing of the inbox table itself.
            if (
                self._tables_needed(version, migrating=migrating)
                or migrating
                or self._upgrade_needed(revision, migrating=migrating)
            ):
                await self._patiently("creating the schema", self._create, conn, deadline)
        finally:
            self._pool.adopt(conn)

    async def _patiently(
        self,
        doing: str,
        step: Callable[[aiosqlite.Connection], Awaitable[T]],
        conn: aiosqlite.Connection,
        deadline: float,
    ) -> T:
        """``step(conn)``, tried again while SQLite answers "locked" and ``deadline`` (a
        ``monotonic`` time) is ahead, after a jittered, growing pause (processes started
        together do not retry in step); any other error, or "locked" past the deadline, is
        translated (:class:`~oncely.StoreUnavailable` for the lock)."""
        pause = _FIRST_BACKOFF_S
        while True:
            try:
                return await step(conn)
            except sqlite3.Error as exc:
                left = deadline - monotonic()
                if not is_busy(exc) or left <= 0:
                    raise translate(exc, doing) from exc
            await sleep(min(left, pause * random.uniform(0.5, 1.5)))
            pause = min(pause * 2, _MAX_BACKOFF_S)

    async def _wal(self, conn: aiosqlite.Connection) -> None:
        # Answers the journal mode the file is in afterwards: "wal", also when another process
        # switched it first (the pragma then only reads the file's header). A database that
        # cannot be in WAL (one in memory) answers its own mode instead, without an error.
        await fetchall(conn, "PRAGMA journal_mode = WAL")

    async def _versions(self, conn: aiosqlite.Connection) -> tuple[int | None, int]:
        """The schema version (None: no tables) and revision (1 where none is written); an
        inbox table without its version row is a :class:`~oncely.SchemaError`. The table is
        looked for first: a creator commits it with its version row, so once it is seen, the
        row is there unless it was deleted."""
        d = self._dialect
        if not await fetchall(conn, d.table_sql):
            return None, 1
        try:
            versions = parse_versions(await fetchall(conn, d.read_version), self._place)
        except sqlite3.OperationalError as exc:
            if "no such table" not in str(exc).lower():
                raise
            versions = None, 1
        if versions[0] is None:
            raise marker_missing(self._place, d.meta_table, self._SCHEMA_VERSION)
        return versions

    async def _version(self, conn: aiosqlite.Connection) -> int | None:
        return (await self._versions(conn))[0]

    async def _create(self, conn: aiosqlite.Connection) -> None:
        # Safe beside a concurrent creator (another process's first use): BEGIN IMMEDIATE
        # takes turns with it, and every statement is a no-op once its work is done.
        await fetchall(conn, "BEGIN IMMEDIATE")
        try:
            d = self._dialect
            for statement in d.create:
                await fetchall(conn, statement)
            await self._upgrade_check(conn)
            # Revision 2, on a table an older oncely created: SQLite builds the index in this
            # transaction (it holds the write lock meanwhile: about a second per million rows).
            if ("purge_ms",) not in await fetchall(conn, d.columns):
                await fetchall(conn, d.add_purge_column)
            await fetchall(conn, d.create_purge_index)
            await fetchall(conn, d.set_version)  # revision 3: rows keep their text forms
            await fetchall(conn, d.set_revision)
            await fetchall(conn, "COMMIT")
        except BaseException:
            # (A failed COMMIT leaves the transaction open, some errors do not; a failing
            # ROLLBACK is not the error to report.)
            if conn.in_transaction:
                with suppress(sqlite3.Error):
                    await fetchall(conn, "ROLLBACK")
            raise

    async def _prepare_in(self, tx: aiosqlite.Connection) -> None:
        """The first use of the store inside a caller's open transaction, on the caller's
        connection ``tx`` (``handle_in_transaction(tx=...)``).

        The setup cannot run on a connection of oncely's own there: the caller's transaction
        holds (or may take) the file's write lock, which that connection would wait for until
        the busy timeout, and the journal mode cannot change inside a transaction at all. So
        the schema is read through ``tx``, which waits on nobody's lock but other processes':

        * tables there, file in WAL: the setup has nothing left to do; the store is ready;
        * tables there, file in a rollback journal: the claim joins the transaction all the
          same (SQLite's lock arbitrates claims alike in both journals); the store's first
          connection of its own, outside this transaction, switches the file to WAL;
        * no tables: :class:`~oncely.SchemaMissing` at once. They are not created inside the
          caller's transaction (the caller's rollback would drop them with the marker, behind
          the store's back); ``oncely migrate`` or :meth:`migrate` creates them, and switches
          the file to WAL, before the first message.

        No lock of the store's is taken either: a thread setting the store up meanwhile may be
        the one waiting for this transaction's lock."""
        if self._schema_seen:
            return
        try:
            version, revision = await self._versions(tx)
            ((mode,),) = await fetchall(tx, "PRAGMA journal_mode")
        except sqlite3.Error as exc:
            raise translate(exc, "reading the schema version") from exc
        if self._tables_needed(version, migrating=False):  # (raises for a newer schema)
            raise SchemaMissing(
                f"no oncely {self._place}, and oncely does not create it inside your open "
                "transaction (its own connection would wait for the lock your transaction "
                "holds): run `oncely migrate --store URL`, or the store's migrate(), once "
                "before the first handle_in_transaction(tx=...)"
            )
        if version is not None and revision < self._SCHEMA_REVISION:
            raise SchemaOutdated(
                f"the {self._place} is at schema revision {revision}; this oncely needs "
                f"{self._SCHEMA_REVISION} ({self._REVISION_NOTE}), and does not migrate inside "
                "your open transaction: run `oncely migrate --store URL` first"
            )
        if self._memory or str(mode).lower() == "wal":
            self._ready = True
        else:
            self._schema_seen = True

    async def _upgrade_check(self, conn: aiosqlite.Connection) -> None:
        """Rewrite the status constraint of a table created by an earlier oncely into its
        cheaper, equivalent form (:data:`~oncely.stores.sqlite.dialect.STATUS_CHECK`), in the
        schema transaction. Where SQLite refuses to edit its schema (a build in defensive
        mode), the table keeps the old constraint: it accepts the same rows, only slower."""
        d = self._dialect
        rows = await fetchall(conn, d.table_sql)
        if not rows or OLD_STATUS_CHECK not in rows[0][0]:
            return
        ((version,),) = await fetchall(conn, "PRAGMA schema_version")
        await fetchall(conn, "PRAGMA writable_schema = ON")
        try:
            for sql, params in d.upgrade_check(version):
                await fetchall(conn, sql, params)
        except sqlite3.Error:
            pass  # left as it was: the UPDATE failed as a whole (a statement is atomic)
        finally:
            await fetchall(conn, "PRAGMA writable_schema = OFF")

    async def schema_version(self) -> int | None:
        """The schema version in the database, or None when there are no tables yet."""
        return (await self._schema_versions())[0]

    async def schema_revision(self) -> int:
        """The schema revision in the database (1 where none is written, or no tables yet):
        what ``oncely migrate`` reports it upgraded within one schema version."""
        return (await self._schema_versions())[1]

    async def _schema_versions(self) -> tuple[int | None, int]:
        conn = await self._open()
        try:
            deadline = monotonic() + self._settings.busy_timeout.total_seconds()
            return await self._patiently(
                "reading the schema version", self._versions, conn, deadline
            )
        finally:
            await close(conn)

    @asynccontextmanager
    async def purge_leader(self) -> AsyncIterator[bool]:
        # An exclusive lock (flock) on a file beside the database, held for the lead: the
        # kernel frees it when the process dies. A database in memory is one process's.
        if self._memory or self._uri or fcntl is None:
            yield True
            return
        path = f"{self._path}-oncely-purge.lock"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:  # another user's file, a read-only directory
            raise StoreUnavailable(
                f"the purge's lead on {self.url}: cannot open its lock file {path} "
                f"({exc.strerror or exc})"
            ) from exc
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
                return
            try:
                yield True
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    async def _purge_batch(
        self, after: Position | None, limit: int, pause: float
    ) -> tuple[int, int, Position | None]:
        # Candidates are read first (WAL readers never block writers), then deleted by key,
        # still expired, in short writes; rows behind their expiry are moved forward.
        now = self._now()
        params = {"now": now, "limit": limit}
        d = self._dialect
        conn = await self._acquire()
        try:
            found = await self._pool.fetchall(conn, d.purge_candidates, params)
            expired = [part for c, k, gone in found if gone for part in (c, k)]
            behind = [part for c, k, gone in found if not gone for part in (c, k)]
            deleted = 0
            # Each write holds SQLite's one write lock, which every claim waits for: a few
            # milliseconds at a time. Measured on 10^5 random uuid keys: 100 rows per DELETE
            # hold it 5 ms (20,000 rows/s while writing), 1,000 rows 75 ms (13,000 rows/s).
            # Between writes the purge rests ``pause`` times as long as the write took (the
            # loop rests after the batch), so with the default 1.0 claims find the lock free
            # half the time (a claim that finds it taken sleeps in SQLite's busy handler, in
            # steps of 1, 2, 5, 10 ms and more). Those steps set a floor: while the purge
            # writes more than 1% of the time, a claim's p99 includes one wait of 1 + 2 ms;
            # 50 rows a write instead of 100 halved the purge's rate and left a consumer's p99
            # during it at 1.9-3.3x its quiet p99, as 100 rows did (2.8x), at 10^6 records.
            step = 2 * _PURGE_WRITE_ROWS
            writes = [
                (pairs[start : start + step], write, deleting)
                for pairs, write, deleting in (
                    (expired, d.purge_delete, True),
                    (behind, d.purge_move, False),
                )
                for start in range(0, len(pairs), step)
            ]
            worked = 0.0
            for n, (chunk, write, deleting) in enumerate(writes):
                if n and pause:
                    await sleep(pause * worked)
                began = monotonic()
                rows = await self._pool.fetchall(conn, write(len(chunk) // 2), [*chunk, now])
                if deleting:
                    deleted += len(rows)
                    if not self._memory:
                        await self._pool.fetchall(conn, "PRAGMA wal_checkpoint(PASSIVE)")
                worked = monotonic() - began
        except sqlite3.Error as exc:
            raise translate(exc, "purge") from exc
        finally:
            await self._release(conn)
        return len(found), deleted, None

    async def _estimate(self) -> StoreStats:
        # count(*) (SQLite counts its smallest index's entries without reading them) and the
        # expired counted (see the dialect); the consumers one descent each, each counted up to
        # SMALL + 1; the rest split by a sample of minutes (see the dialect).
        d = self._dialect
        now = self._now()
        cur = purge_bucket(now)
        (total,) = (await self._rows("stats", d.count_rows, {}))[0]
        (ended,) = (await self._rows("stats", d.count_ended, {"cur": cur}))[0]
        (expiring,) = (await self._rows("stats", d.count_expiring, {"now": now, "cur": cur}))[0]
        found = Estimate(
            expired=ended + expiring,
            counted=ENDED_COUNTED + SMALL,
            cut=ended > ENDED_COUNTED or expiring > SMALL,
            rows=total,
        )
        rows = await self._rows("stats", d.first_consumer, {})
        while rows and rows[0][0] is not None and len(found.seen) < MAX_CONSUMERS:
            consumer = rows[0][0]
            params = {"now": now, "consumer": consumer}
            seen, live = (await self._rows("stats", d.count_consumer, params))[0]
            found.seen[consumer] = (seen, live)
            rows = await self._rows("stats", d.next_consumer, {"after": consumer})
        return await self._split_rest(found, total, cur, d)

    # ------------------------------------------------------------ the message path

    async def claim(
        self,
        consumer: str,
        key: str,
        *,
        fingerprint: str | None,
        token: str,
        lease_ms: int,
        keep_ms: int,
        takeover: bool,
    ) -> Claim:
        conn = await self._acquire()
        try:
            return await self._claim(
                conn, consumer, key, fingerprint, token, lease_ms, keep_ms, takeover,
                Status.IN_PROGRESS, None,
            )  # fmt: skip
        finally:
            await self._release(conn)

    async def claim_many(
        self,
        consumer: str,
        requests: Sequence[ClaimRequest],
        *,
        lease_ms: int,
        keep_ms: int,
        takeover: bool,
    ) -> list[Claim]:
        # One write transaction for the whole batch: one commit (one fsync) instead of one per
        # key, and the claims are made in request order as if one after the other.
        claims: list[Claim] = []
        async with self.transaction() as conn:
            for r in requests:
                claim = await self._claim(
                    conn, consumer, r.key, r.fingerprint, r.token, lease_ms, keep_ms, takeover,
                    Status.IN_PROGRESS, None,
                )  # fmt: skip
                claims.append(claim)
        return claims

    async def _claim(
        self,
        conn: aiosqlite.Connection,
        consumer: str,
        key: str,
        fingerprint: str | None,
        token: str,
        lease_ms: int,
        keep_ms: int,
        takeover: bool,
        initial: Status,
        error: str | None,
    ) -> Claim:
        # The first INSERT is the whole claim of a new key (the common case), so it runs
        # before, and apart from, the retry loop of a contested one.
        now = self._now()
        lease_until = now + lease_ms if initial is Status.IN_PROGRESS else now
        expires = now + (keep_ms if keep_ms >= lease_ms else lease_ms)
        status = initial._value_  # plain text: sqlite3 adapts an enum member slowly
        packed_fingerprint = pack_fingerprint(fingerprint)
        packed_token = pack_token(token)
        try:
            before = conn.total_changes
            await self._pool.execute(
                conn,
                self._dialect.insert,
                (consumer, key, status, packed_fingerprint, packed_token, now, now,
                 lease_until, expires, error, expires),
            )  # fmt: skip
        except sqlite3.Error as exc:
            raise translate(exc, "claim") from exc
        if conn.total_changes != before:
            record = new_record(
                consumer, key, initial, fingerprint, token, 1, now, now, lease_until, expires,
                None, error,
            )  # fmt: skip
            return new_claim(ClaimStatus.NEW, record, now)
        params = {
            "consumer": consumer,
            "key": key,
            "status": status,
            "fingerprint": packed_fingerprint,
            "fingerprint_text": fingerprint,
            "token": packed_token,
            "now": now,
            "lease_until": lease_until,
            "expires": expires,
            "error": error,
        }
        return await self._claim_contested(
            conn, params, consumer, key, fingerprint, token, lease_ms, keep_ms, takeover,
            initial, error,
        )  # fmt: skip

    async def _claim_contested(
        self,
        conn: aiosqlite.Connection,
        params: dict[str, Any],
        consumer: str,
        key: str,
        fingerprint: str | None,
        token: str,
        lease_ms: int,
        keep_ms: int,
        takeover: bool,
        initial: Status,
        error: str | None,
    ) -> Claim:
        """The rest of :meth:`_claim` once its INSERT (with ``params``) found the key taken:
        read the winner, and replace it if it is expired or a stale claim this one may take
        over; if the record changes meanwhile, claim again."""
        dialect = self._dialect
        now: int = params["now"]
        for attempt in range(5):
            try:
                if attempt:  # the winner vanished or changed: claim again, on a fresh clock
                    now = self._now()
                    lease_until = now + lease_ms if initial is Status.IN_PROGRESS else now
                    expires = now + max(keep_ms, lease_ms)
                    params.update(now=now, lease_until=lease_until, expires=expires)
                    before = conn.total_changes
                    await self._pool.execute(
                        conn,
                        dialect.insert,
                        (consumer, key, params["status"], params["fingerprint"],
                         params["token"], now, now, lease_until, expires, error, expires),
                    )  # fmt: skip
                    if conn.total_changes != before:
                        record = new_record(
                            consumer, key, initial, fingerprint, token, 1, now, now, lease_until,
                            expires, None, error,
                        )  # fmt: skip
                        return new_claim(ClaimStatus.NEW, record, now)
                rows = await self._pool.fetchall(conn, dialect.current, params)
                if not rows:
                    continue  # the winner's record vanished (released): claim again
                current = parse_record(consumer, key, rows[0])
                if not claimable(current, now, fingerprint, takeover):
                    return new_claim(ClaimStatus.EXISTING, current, now)
                params["seen"] = pack_token(current.token)
                params["seen_text"] = current.token
                params["takeover"] = takeover
                rows = await self._pool.fetchall(conn, dialect.replace, params)
            except sqlite3.Error as exc:
                raise translate(exc, "claim") from exc
            if rows:
                record = parse_record(consumer, key, rows[0])
                won = ClaimStatus.NEW if record.attempt == 1 else ClaimStatus.TAKEN_OVER
                return new_claim(won, record, now)
            # Another claim changed the record between the read and the write: look again.
        raise StoreUnavailable(f"claim of key {key!r} kept racing with other claims; retry later")

    async def takeover(
        self,
        consumer: str,
        key: str,
        *,
        expected_token: str,
        fingerprint: str | None,
        token: str,
        lease_ms: int,
        keep_ms: int,
    ) -> Claim:
        async with self._connection() as conn:
            now = self._now()
            params: dict[str, object] = {
                "consumer": consumer,
                "key": key,
                "token": pack_token(expected_token),
                "token_text": expected_token,
                "new_token": pack_token(token),
                "fingerprint": pack_fingerprint(fingerprint),
                "fingerprint_text": fingerprint,
                "now": now,
                "lease_until": now + lease_ms,
                "expires": now + max(keep_ms, lease_ms),
            }
            try:
                rows = await self._pool.fetchall(conn, self._dialect.takeover, params)
            except sqlite3.Error as exc:
                raise translate(exc, "takeover") from exc
            if rows:
                return Claim(ClaimStatus.TAKEN_OVER, parse_record(consumer, key, rows[0]), now)
            return await self._claim(
                conn, consumer, key, fingerprint, token, lease_ms, keep_ms, False,
                Status.IN_PROGRESS, None,
            )  # fmt: skip

    async def _fenced(
        self,
        op: str,
        sql: str,
        done: Status | None,
        consumer: str,
        key: str,
        token: str,
        now: int,
        values: dict[str, Any],
        bucket: int | None = None,
    ) -> Record:
        """Run a write that only applies while ``token`` owns the record; otherwise raise
        :class:`~oncely.LeaseLost` with the current record. A repeat of a write that already
        landed (same token, status ``done``) returns the record unchanged. With ``bucket``
        (a completion's), the statement returns purge_ms last: one above it is lowered."""
        params = {"consumer": consumer, "key": key, "token": pack_token(token), "now": now}
        params.update(values)
        conn = await self._acquire()
        try:
            rows = await self._pool.fetchall(conn, sql, params)
            if rows:
                if bucket is not None and rows[0][10] > bucket:  # the expiry moved earlier
                    await self._pool.fetchall(conn, self._dialect.fix_purge, params)
                return parse_record(consumer, key, rows[0])
            rows = await self._pool.fetchall(conn, self._dialect.get, params)
        except sqlite3.Error as exc:
            raise translate(exc, op) from exc
        finally:
            await self._release(conn)
        return unfenced(
            op, consumer, key, token, done, parse_record(consumer, key, rows[0]) if rows else None
        )

    async def complete(
        self,
        consumer: str,
        key: str,
        *,
        token: str,
        result: bytes | None,
        keep_ms: int,
        note: str | None = None,
    ) -> Record:
        now = self._now()
        expires = now + keep_ms
        values = {"expires": expires, "result": result, "note": note}
        return await self._fenced(
            "complete", self._dialect.complete, Status.COMPLETED, consumer, key, token, now,
            values, purge_bucket(expires),
        )  # fmt: skip

    def result_room(self) -> tuple[int, str]:
        """The most bytes an encoded result may have for this store to keep it, and why (a
        larger one is completed without it, as one over ``Limits.max_result_bytes``)."""
        return _result_room()

    async def complete_many(
        self, consumer: str, completions: Sequence[Completion], *, keep_ms: int
    ) -> list[Record | LeaseLost]:
        """One completion after the other (each is a local write, no round trip to save)."""
        return await complete_each(self, consumer, completions, keep_ms=keep_ms)

    async def fail(
        self, consumer: str, key: str, *, token: str, error: str, keep_ms: int
    ) -> Record:
        now = self._now()
        values = {"expires": now + keep_ms, "error": error}
        return await self._fenced(
            "fail", self._dialect.fail, Status.FAILED, consumer, key, token, now, values
        )

    async def renew(
        self, consumer: str, key: str, *, token: str, lease_ms: int, keep_ms: int
    ) -> Record:
        now = self._now()
        expires = now + max(keep_ms, lease_ms)
        values = {"lease_until": now + lease_ms, "expires": expires}
        return await self._fenced(
            "renew", self._dialect.renew, None, consumer, key, token, now, values,
            purge_bucket(expires),
        )  # fmt: skip

    async def release(self, consumer: str, key: str, *, token: str) -> bool:
        return await self._delete("release", self._dialect.release, consumer, key, token)

    async def forget_by_token(self, consumer: str, key: str, *, token: str) -> bool:
        return await self._delete("forget", self._dialect.forget_by_token, consumer, key, token)

    async def _delete(self, what: str, statement: str, consumer: str, key: str, token: str) -> bool:
        """Run a fenced delete (``release`` or ``forget_by_token``): True when it deleted,
        False when there was no record, :class:`~oncely.LeaseLost` with the record that
        stays otherwise."""
        now = self._now()
        params = {"consumer": consumer, "key": key, "token": pack_token(token), "now": now}
        async with self._connection() as conn:
            try:
                if await self._pool.fetchall(conn, statement, params):
                    return True
                rows = await self._pool.fetchall(conn, self._dialect.get, params)
            except sqlite3.Error as exc:
                raise translate(exc, what) from exc
        if not rows:
            return False
        raise lease_lost(what, consumer, key, Lost(parse_record(consumer, key, rows[0])))

    # ------------------------------------------------------------ transactional mode (R7)

    def transaction(self, *, claim_first: bool = False) -> _Transaction:
        """``BEGIN IMMEDIATE`` on a pooled connection. With ``claim_first`` (the block's first
        statement is :meth:`claim_in`), the asyncio store lets that claim's INSERT begin the
        transaction, in the claim's own hop to the connection's thread."""
        return _Transaction(self, claim_first)

    @asynccontextmanager
    async def savepoint(self, tx: aiosqlite.Connection) -> AsyncIterator[None]:
        await self._run(tx, "SAVEPOINT oncely", (), "savepoint")
        try:
            yield
        except BaseException:
            await self._run(tx, "ROLLBACK TO oncely", (), "rollback to savepoint")
            await self._run(tx, "RELEASE oncely", (), "release savepoint")
            raise
        await self._run(tx, "RELEASE oncely", (), "release savepoint")

    async def _run(self, conn: aiosqlite.Connection, sql: str, params: Params, op: str) -> None:
        try:
            await self._pool.execute(conn, sql, params)
        except sqlite3.Error as exc:
            raise translate(exc, op) from exc

    def in_transaction(self, tx: aiosqlite.Connection) -> bool:
        """Whether ``tx`` is inside a transaction now."""
        return bool(tx.in_transaction)

    async def _fetch_on(self, conn: aiosqlite.Connection, sql: str) -> list[Any]:
        try:
            return [tuple(row) for row in await fetchall(conn, sql)]
        except sqlite3.Error as exc:
            raise translate(exc, "reading which database the connection is on") from exc

    def check_transaction(self, tx: aiosqlite.Connection) -> None:
        if not tx.in_transaction:
            raise TransactionRequired(
                "the connection has no open transaction: run BEGIN (or BEGIN IMMEDIATE) first, "
                "or call without tx= to let oncely open and commit one"
            )

    async def set_result_in(
        self, tx: aiosqlite.Connection, consumer: str, key: str, *, token: str, result: bytes | None
    ) -> None:
        params = {"consumer": consumer, "key": key, "token": pack_token(token), "result": result}
        await self._run(tx, self._dialect.set_result, params, "storing the result")

    async def save_offset_in(
        self, tx: aiosqlite.Connection, consumer: str, stream: str, part: int, next_offset: int
    ) -> None:
        """Keep ``next_offset`` as the offset to read next of ``stream``'s partition ``part``,
        in ``tx`` (it never moves back). :meth:`offsets` reads it."""
        check_position(stream, part, next_offset, consumer=consumer)
        o = self._offset_sql
        params = o.params(consumer, stream, part=part, next=next_offset)
        await self._run(tx, o.save, params, "storing the offset")

    async def claim_in(
        self,
        tx: aiosqlite.Connection,
        consumer: str,
        key: str,
        *,
        fingerprint: str | None,
        token: str,
        keep_ms: int,
        takeover: bool,
        initial: Status = Status.COMPLETED,
        error: str | None = None,
    ) -> Claim:
        if not self._ready:  # first use inside the caller's transaction: checked through it
            await self._prepare_in(tx)
        return await self._claim(
            tx, consumer, key, fingerprint, token, 0, keep_ms, takeover, initial, error
        )
