"""The SQLite store: one file, any number of threads and processes, both modes.

WAL journal, ``BEGIN IMMEDIATE`` for every transaction oncely opens (so a reader never has to
upgrade to a writer and deadlock), a busy timeout for the single-writer lock, and one
``INSERT ... ON CONFLICT ... RETURNING`` per claim (:mod:`oncely._dialects.sqlite`). Several
processes may share the file on one host; a network file system is not supported (SQLite's
locking does not hold there).
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from types import TracebackType
from typing import Any, Self

import aiosqlite

from oncely._async._sqlite_io import AsyncPool, Params, close, connect, fetchall
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
from oncely._core.state import Lost, fingerprints_agree
from oncely._core.table import lease_lost
from oncely._dialects.params import scan_params
from oncely._dialects.sqlite import SCHEMA_VERSION, SQLiteDialect, parse_record
from oncely._drivers.sqlite import SQLiteSettings, parse_url, translate
from oncely.errors import (
    SchemaMissing,
    SchemaTooNew,
    StoreError,
    StoreUnavailable,
    TransactionRequired,
)

__all__ = ["AsyncSQLiteStore"]

_STATUS = {s.value: s for s in Status}


class AsyncSQLiteStore:
    """A dedup store in a SQLite database file (transactional and two-phase modes).

    ``path`` is a file path, ``":memory:"`` (one connection; for tests) or a ``file:`` URI.
    The schema is created on first use unless ``migrate=False``, in which case a missing
    schema raises :class:`~oncely.SchemaMissing`; a schema written by a newer oncely raises
    :class:`~oncely.SchemaTooNew`. At most ``pool_size`` connections are in use at once.

    The asyncio variant belongs to the event loop that first uses it (its pool waits on an
    asyncio semaphore): open one store per loop. The threaded variant may be shared by any
    number of threads. After ``fork`` a child opens connections of its own; never fork in the
    middle of a transaction.
    """

    supports_transactions = True

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
        self._path = os.fspath(path)
        self._uri = self._path.startswith("file:")
        self._memory = self._path == ":memory:"
        self._dialect = SQLiteDialect(table)
        self._settings = settings if settings is not None else SQLiteSettings()
        self._clock: Clock = clock if clock is not None else SystemClock()
        self._now = self._clock.now_ms
        self._auto_migrate = migrate
        size = 1 if self._memory else pool_size
        if size < 1:
            raise ValueError("pool_size must be at least 1")
        self._pool = AsyncPool(self._open, size)
        self._ready_lock = asyncio.Lock()
        self._ready = False
        self._closed = False

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

    # ------------------------------------------------------------------ connections

    async def _open(self) -> aiosqlite.Connection:
        try:
            conn = await connect(
                self._path, timeout=self._settings.busy_timeout.total_seconds(), uri=self._uri
            )
            for pragma in self._settings.pragmas():
                await fetchall(conn, pragma)
        except sqlite3.Error as exc:
            raise translate(exc, f"opening {self._path}") from exc
        return conn

    async def _prepare(self) -> None:
        async with self._ready_lock:
            if self._ready:
                return
            conn = await self._open()
            try:
                if not self._memory:
                    await self._wal(conn)
                version = await self._version(conn)
                if version is None:
                    if not self._auto_migrate:
                        raise SchemaMissing(
                            f"no oncely tables in {self._path} (table {self._dialect.table}); "
                            "run `oncely migrate --store URL` or open the store with migrate=True"
                        )
                    await self._create(conn)
                elif version > SCHEMA_VERSION:
                    raise SchemaTooNew(
                        f"{self._path} holds oncely schema version {version}; this oncely "
                        f"understands up to {SCHEMA_VERSION}: upgrade oncely"
                    )
                self._ready = True
            finally:
                self._pool.adopt(conn)

    async def _wal(self, conn: aiosqlite.Connection) -> None:
        try:
            await fetchall(conn, "PRAGMA journal_mode = WAL")
        except sqlite3.Error as exc:
            raise translate(exc, "switching to WAL") from exc

    async def _version(self, conn: aiosqlite.Connection) -> int | None:
        try:
            rows = await fetchall(conn, self._dialect.read_version)
        except sqlite3.OperationalError as exc:
            if "no such table" in str(exc).lower():
                return None
            raise translate(exc, "reading the schema version") from exc
        except sqlite3.Error as exc:
            raise translate(exc, "reading the schema version") from exc
        return int(rows[0][0]) if rows else None

    async def _create(self, conn: aiosqlite.Connection) -> None:
        try:
            await fetchall(conn, "BEGIN IMMEDIATE")
            try:
                for statement in self._dialect.create:
                    await fetchall(conn, statement)
                await fetchall(conn, "COMMIT")
            except BaseException:
                await fetchall(conn, "ROLLBACK")
                raise
        except sqlite3.Error as exc:
            raise translate(exc, "creating the schema") from exc

    async def _acquire(self) -> aiosqlite.Connection:
        if self._closed:
            raise StoreError(f"{self!r} is closed")
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

    # ------------------------------------------------------------------ the contract

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
        try:
            before = conn.total_changes
            await self._pool.execute(
                conn,
                self._dialect.insert,
                (consumer, key, status, fingerprint, token, now, lease_until, expires, error),
            )
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
            "fingerprint": fingerprint,
            "token": token,
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
                        (consumer, key, params["status"], fingerprint, token, now, lease_until,
                         expires, error),
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
                if current.expires_ms > now and not (
                    takeover
                    and current.is_stale(now)
                    and fingerprints_agree(current.fingerprint, fingerprint)
                ):
                    return new_claim(ClaimStatus.EXISTING, current, now)
                params["seen"] = current.token
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
                "token": expected_token,
                "new_token": token,
                "fingerprint": fingerprint,
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
    ) -> Record:
        """Run a write that only applies while ``token`` owns the record; otherwise raise
        :class:`~oncely.LeaseLost` with the current record. A repeat of a write that already
        landed (same token, status ``done``) returns the record unchanged."""
        params = {"consumer": consumer, "key": key, "token": token, "now": now, **values}
        conn = await self._acquire()
        try:
            rows = await self._pool.fetchall(conn, sql, params)
            if rows:
                return parse_record(consumer, key, rows[0])
            rows = await self._pool.fetchall(conn, self._dialect.get, params)
        except sqlite3.Error as exc:
            raise translate(exc, op) from exc
        finally:
            await self._release(conn)
        current = parse_record(consumer, key, rows[0]) if rows else None
        if current is not None and current.token == token and current.status is done:
            return current  # the same write landed before (a retry): idempotent
        raise lease_lost(op, consumer, key, Lost(current))

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
        values = {"expires": now + keep_ms, "result": result, "note": note}
        return await self._fenced(
            "complete", self._dialect.complete, Status.COMPLETED, consumer, key, token, now, values
        )

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
        values = {"lease_until": now + lease_ms, "expires": now + max(keep_ms, lease_ms)}
        return await self._fenced(
            "renew", self._dialect.renew, None, consumer, key, token, now, values
        )

    async def release(self, consumer: str, key: str, *, token: str) -> bool:
        now = self._now()
        params = {"consumer": consumer, "key": key, "token": token, "now": now}
        async with self._connection() as conn:
            try:
                if await self._pool.fetchall(conn, self._dialect.release, params):
                    return True
                rows = await self._pool.fetchall(conn, self._dialect.get, params)
            except sqlite3.Error as exc:
                raise translate(exc, "release") from exc
        if not rows:
            return False
        raise lease_lost("release", consumer, key, Lost(parse_record(consumer, key, rows[0])))

    async def get(self, consumer: str, key: str) -> Record | None:
        params = {"consumer": consumer, "key": key, "now": self._now()}
        async with self._connection() as conn:
            try:
                rows = await self._pool.fetchall(conn, self._dialect.get, params)
            except sqlite3.Error as exc:
                raise translate(exc, "get") from exc
        return parse_record(consumer, key, rows[0]) if rows else None

    async def purge_expired(self, *, batch_size: int = 1000, max_batches: int | None = None) -> int:
        if not 1 <= batch_size <= 10_000:
            raise ValueError("batch_size must be between 1 and 10000")
        deleted = 0
        batches = 0
        after = ("", "")
        while max_batches is None or batches < max_batches:
            now = self._now()
            params = {
                "now": now,
                "limit": batch_size,
                "after_consumer": after[0],
                "after_key": after[1],
            }
            async with self._connection() as conn:
                try:
                    found = await self._pool.fetchall(conn, self._dialect.purge_candidates, params)
                    if not found:
                        break
                    flat: list[object] = [part for pair in found for part in pair]
                    flat.append(now)
                    rows = await self._pool.fetchall(
                        conn, self._dialect.purge_delete(len(found)), flat
                    )
                except sqlite3.Error as exc:
                    raise translate(exc, "purge") from exc
            deleted += len(rows)
            batches += 1
            after = (found[-1][0], found[-1][1])
            if len(found) < batch_size:
                break
        return deleted

    async def stats(self) -> StoreStats:
        now = self._now()
        async with self._connection() as conn:
            try:
                rows = await self._pool.fetchall(conn, self._dialect.stats, {"now": now})
                expired = await self._pool.fetchall(conn, self._dialect.expired_count, {"now": now})
            except sqlite3.Error as exc:
                raise translate(exc, "stats") from exc
        counts: dict[str, dict[Status, int]] = {}
        for consumer, status, count in rows:
            counts.setdefault(consumer, {})[_STATUS[status]] = count
        return StoreStats(counts=counts, expired=expired[0][0])

    async def scan(
        self,
        *,
        consumer: str | None = None,
        status: Status | None = None,
        after: tuple[str, str] | None = None,
        limit: int = 100,
    ) -> list[Record]:
        params = scan_params(self._now(), consumer, status, after, limit)
        async with self._connection() as conn:
            try:
                rows = await self._pool.fetchall(conn, self._dialect.scan, params)
            except sqlite3.Error as exc:
                raise translate(exc, "scan") from exc
        return [parse_record(row[0], row[1], row[2:]) for row in rows]

    async def forget(self, consumer: str, key: str) -> bool:
        async with self._connection() as conn:
            try:
                rows = await self._pool.fetchall(
                    conn, self._dialect.forget, {"consumer": consumer, "key": key}
                )
            except sqlite3.Error as exc:
                raise translate(exc, "forget") from exc
        return bool(rows)

    async def migrate(self) -> int:
        conn = await self._open()
        try:
            if not self._memory:
                await self._wal(conn)
            version = await self._version(conn)
            if version is not None and version > SCHEMA_VERSION:
                raise SchemaTooNew(
                    f"{self._path} holds oncely schema version {version}; this oncely "
                    f"understands up to {SCHEMA_VERSION}: upgrade oncely"
                )
            await self._create(conn)
            self._ready = True
        finally:
            self._pool.adopt(conn)
        return SCHEMA_VERSION

    async def schema_version(self) -> int | None:
        """The schema version in the database, or None when there are no tables yet."""
        conn = await self._open()
        try:
            return await self._version(conn)
        finally:
            await close(conn)

    async def aclose(self) -> None:
        self._closed = True
        await self._pool.close()

    # ------------------------------------------------------------ transactional mode (R7)

    def transaction(self) -> _Transaction:
        return _Transaction(self)

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

    def check_transaction(self, tx: aiosqlite.Connection) -> None:
        if not tx.in_transaction:
            raise TransactionRequired(
                "the connection has no open transaction: run BEGIN (or BEGIN IMMEDIATE) first, "
                "or call without tx= to let oncely open and commit one"
            )

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
        if not self._ready:
            await self._prepare()
        return await self._claim(
            tx, consumer, key, fingerprint, token, 0, keep_ms, takeover, initial, error
        )

    async def set_result_in(
        self, tx: aiosqlite.Connection, consumer: str, key: str, *, token: str, result: bytes | None
    ) -> None:
        params = {"consumer": consumer, "key": key, "token": token, "result": result}
        await self._run(tx, self._dialect.set_result, params, "storing the result")


class _Transaction:
    """``async with store.transaction() as tx``: BEGIN IMMEDIATE on a pooled connection;
    COMMIT when the block ends, ROLLBACK when it raises. A class, not a generator: it is on
    the hot path of every transactional message."""

    __slots__ = ("_conn", "_store")

    def __init__(self, store: AsyncSQLiteStore) -> None:
        self._store = store
        self._conn: aiosqlite.Connection | None = None

    async def __aenter__(self) -> aiosqlite.Connection:
        store = self._store
        # _acquire's checks written inline for the common case (a ready, open store).
        ready = store._ready and not store._closed
        conn = await (store._pool.acquire() if ready else store._acquire())
        try:
            await store._pool.execute(conn, "BEGIN IMMEDIATE")
        except BaseException as exc:
            await store._release(conn)
            if isinstance(exc, sqlite3.Error):
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
        store = self._store
        if exc_type is None:
            try:
                await store._pool.execute(conn, "COMMIT")
            except BaseException as error:
                await store._release(conn)  # rolls back whatever is still open
                if isinstance(error, sqlite3.Error):
                    raise translate(error, "commit") from error
                raise
            if not conn.in_transaction:  # committed: nothing to roll back (the common case)
                await store._pool.release(conn)
                return
        await store._release(conn)  # rolls back whatever is still open
