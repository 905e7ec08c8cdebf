"""The SQLite store: one file, any number of threads and processes, both modes.

WAL journal, ``BEGIN IMMEDIATE`` for every transaction oncely opens (so a reader never has to
upgrade to a writer and deadlock), a busy timeout for the single-writer lock, and one
``INSERT ... ON CONFLICT ... RETURNING`` per claim (:mod:`oncely.stores.sqlite.dialect`). Several
processes may share the file on one host; a network file system is not supported (SQLite's
locking does not hold there).

This module is the message path: the claim, the fenced writes and the claim inside a
caller's transaction. How the store's modules divide the rest is told in ``sql_base``.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from typing import Any

import aiosqlite

from oncely._core.records import (
    Claim,
    ClaimRequest,
    ClaimStatus,
    Record,
    Status,
    new_claim,
    new_record,
)
from oncely._core.state import Lost, claimable
from oncely._core.table import lease_lost, unfenced
from oncely.errors import StoreUnavailable
from oncely.stores.sqlite.async_tx import SQLiteTransactions
from oncely.stores.sqlite.dialect import parse_record
from oncely.stores.sqlite.errors import translate

__all__ = ["AsyncSQLiteStore"]


class AsyncSQLiteStore(SQLiteTransactions):
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
                if not claimable(current, now, fingerprint, takeover):
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

    # ------------------------------------------------------------ transactional mode (R7)

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
