"""The PostgreSQL store: any number of processes and hosts, both modes, on psycopg 3.

A pool (psycopg_pool) of autocommit connections: outside a transaction each operation is one
statement that commits on its own. A claim is one ``INSERT ... ON CONFLICT DO NOTHING`` that
returns the winner's row in the same statement (:mod:`oncely.stores.postgres.dialect` explains
the statement and the READ COMMITTED snapshot trap it avoids). Lease times come from the
server's ``clock_timestamp()``, never the worker's, unless the store is given a clock.
Joined to a caller's transaction, the savepoint around a message costs no round trip of its
own: its ``SAVEPOINT`` is pipelined with the claim, and it is not released (see
:meth:`AsyncPostgresStore.savepoint`). In the store's own transaction of the inbox's
transactional mode, ``BEGIN`` is pipelined with the claim and a stored result's ``UPDATE``
with the ``COMMIT`` (see :meth:`AsyncPostgresStore.transaction`): the mode adds no round trip
to the handler's.

This module is the message path: the claim, the fenced writes and the claim inside a
caller's transaction. How the store's modules divide the rest is told in ``sql_base``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg

from oncely._core.records import Claim, ClaimRequest, ClaimStatus, Record, Status
from oncely._core.state import Lost, claimable
from oncely._core.table import lease_lost, unfenced
from oncely.errors import StoreError, StoreUnavailable
from oncely.stores.postgres.async_io import Connection, fetchall, fetchall_after, fetchall_begun
from oncely.stores.postgres.async_tx import JOINED, PostgresTransactions, Savepoint
from oncely.stores.postgres.dialect import parse_record, text_array

__all__ = ["AsyncPostgresStore"]

# How often one claim looks again after a concurrent writer changed the record under it.
_ATTEMPTS = 5
# A B-tree entry holds at most 2704 bytes: (consumer, key) beyond about this many UTF-8 bytes
# cannot be indexed. Refused before the statement, so a caller's transaction is not aborted.
_MAX_IDENTITY_BYTES = 2600


def _check_size(consumer: str, key: str) -> None:
    if len(consumer.encode()) + len(key.encode()) > _MAX_IDENTITY_BYTES:
        raise StoreError(
            f"consumer and key take over {_MAX_IDENTITY_BYTES} bytes, more than a PostgreSQL "
            "index entry holds; lower Limits(max_key_bytes=...) or set hash_long_keys=True"
        )


class AsyncPostgresStore(PostgresTransactions):
    """A dedup store in a PostgreSQL table (transactional and two-phase modes).

    ``conninfo`` is a libpq connection string (``postgresql://user:password@host/db`` or
    ``host=... dbname=...``) for a pool the store opens and closes itself, or a psycopg_pool
    pool of yours (the async store takes an ``AsyncConnectionPool``, the threaded one a
    ``ConnectionPool``), which the store uses but never closes. The inbox table is
    ``schema.table``; both names are checked and used exactly as given (quoted).

    The schema is created on first use unless ``migrate=False``, in which case a missing
    schema raises :class:`~oncely.SchemaMissing`; a schema written by a newer oncely raises
    :class:`~oncely.SchemaTooNew`. Connection loss, a server restart, timeouts, deadlocks and
    serialization failures raise :class:`~oncely.StoreUnavailable` (retry later); the pool
    replaces broken connections by itself. ``connect_timeout`` bounds both a connection
    attempt and the wait for a free connection of the pool. With a pool of its own the store
    keeps the connections it has finished with and reuses them (they count towards
    ``pool_max``), handing them back to the pool every minute, when an operation waits for
    one, on a disconnect and on close.

    The asyncio variant belongs to the event loop that first uses it: open one store per loop.
    The threaded variant may be shared by any number of threads. After ``fork`` a child opens
    a pool of its own (never fork in the middle of a transaction).
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
        async with self._connection("claim") as conn:
            return await self._claim(
                conn, consumer, key, fingerprint, token, lease_ms, keep_ms, takeover,
                Status.IN_PROGRESS, None,
            )  # fmt: skip

    async def claim_many(
        self,
        consumer: str,
        requests: Sequence[ClaimRequest],
        *,
        lease_ms: int,
        keep_ms: int,
        takeover: bool,
    ) -> list[Claim]:
        if not requests:
            return []
        keys = [r.key for r in requests]
        if 4 * (len(consumer) + max(map(len, keys))) > _MAX_IDENTITY_BYTES:
            for key in keys:  # a UTF-8 character is at most 4 bytes: only then count them
                _check_size(consumer, key)
        fingerprints = [r.fingerprint for r in requests]
        tokens = [r.token for r in requests]
        span = max(keep_ms, lease_ms)
        params = {
            "now": self._now(),
            "consumer": consumer,
            "keys": text_array(keys),
            "fingerprints": text_array(fingerprints),
            "tokens": text_array(tokens),
            "lease": lease_ms,
            "span": span,
        }
        claims: list[Claim] = []
        won: dict[str, Record] = {}  # keys a request of this batch won, and their records
        async with self._connection("claim_many") as conn:
            try:
                rows = await fetchall(conn, self._dialect.claim_many, params)
            except psycopg.Error as exc:
                raise self._error(exc, "claim_many") from exc
            # A row: now, whether the request's own row went in (true), another request's
            # (false) or none (NULL), and, for none, the row visible before the statement.
            for r, row in zip(requests, rows, strict=True):
                now: int = row[0]
                held = won.get(r.key)
                if held is not None:  # an earlier request of the batch holds a fresh lease
                    claims.append(Claim(ClaimStatus.EXISTING, held, now))
                    continue
                if row[1]:  # inserted as sent: the record is built here, not read back
                    record = Record(
                        consumer, r.key, Status.IN_PROGRESS, r.fingerprint, r.token, 1,
                        now, now, now + lease_ms, now + span,
                    )  # fmt: skip
                    claim = Claim(ClaimStatus.NEW, record, now)
                elif row[2] is not None and not claimable(
                    current := parse_record(consumer, r.key, row[2:12]), now, r.fingerprint,
                    takeover,
                ):  # fmt: skip
                    claim = Claim(ClaimStatus.EXISTING, current, now)
                else:
                    # Expired, stale, or inserted by a transaction that committed while this
                    # statement waited (invisible to its snapshot): the one-key path decides.
                    claim = await self._claim(
                        conn, consumer, r.key, r.fingerprint, r.token, lease_ms, keep_ms,
                        takeover, Status.IN_PROGRESS, None,
                    )  # fmt: skip
                if claim.won:
                    won[r.key] = claim.record
                claims.append(claim)
        return claims

    async def _claim(
        self,
        conn: Connection,
        consumer: str,
        key: str,
        fingerprint: str | None,
        token: str,
        lease_ms: int,
        keep_ms: int,
        takeover: bool,
        initial: Status,
        error: str | None,
        savepoint: Savepoint | None = None,
        begin: Any = None,
    ) -> Claim:
        """One claim on ``conn``. With ``savepoint`` (set by :meth:`savepoint`, not yet on
        the server), its ``SAVEPOINT`` goes out with the first statement, in one round trip;
        with ``begin`` (a transaction block of :meth:`transaction` that has sent nothing yet),
        its ``BEGIN`` does."""
        _check_size(consumer, key)
        dialect = self._dialect
        params: dict[str, Any] = {
            "consumer": consumer,
            "key": key,
            "status": initial.value,
            "fingerprint": fingerprint,
            "token": token,
            "lease": lease_ms if initial is Status.IN_PROGRESS else 0,
            "span": max(keep_ms, lease_ms),
            "error": error,
        }
        try:
            for _ in range(_ATTEMPTS):
                params["now"] = self._now()
                if savepoint is not None:
                    rows = await fetchall_after(
                        conn, savepoint.sql, dialect.claim_joined, params, savepoint.established
                    )
                    if rows:
                        savepoint.stamp = rows[0][12]
                    savepoint = None
                elif begin is not None:
                    rows = await fetchall_begun(conn, begin, dialect.claim, params)
                    begin = None
                else:
                    rows = await fetchall(conn, dialect.claim, params)
                if not rows:
                    # The key's row was inserted by a transaction that committed while this
                    # statement waited for it (invisible to the statement's snapshot), or it
                    # vanished: a new statement takes a new snapshot.
                    continue
                row = rows[0]
                now: int = row[11]
                current = parse_record(consumer, key, row[1:11])
                if row[0]:
                    return Claim(ClaimStatus.NEW, current, now)
                if not claimable(current, now, fingerprint, takeover):
                    return Claim(ClaimStatus.EXISTING, current, now)
                params["seen"] = current.token
                params["takeover"] = takeover
                rows = await fetchall(conn, dialect.replace, params)
                if rows:
                    record = parse_record(consumer, key, rows[0][:10])
                    won = ClaimStatus.NEW if record.attempt == 1 else ClaimStatus.TAKEN_OVER
                    return Claim(won, record, rows[0][10])
                # Another claim changed the record between the read and the write: look again.
        except psycopg.Error as exc:
            raise self._error(exc, "claim") from exc
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
        params = {
            "now": self._now(),
            "consumer": consumer,
            "key": key,
            "token": expected_token,
            "new_token": token,
            "fingerprint": fingerprint,
            "lease": lease_ms,
            "span": max(keep_ms, lease_ms),
        }
        async with self._connection("takeover") as conn:
            try:
                rows = await fetchall(conn, self._dialect.takeover, params)
            except psycopg.Error as exc:
                raise self._error(exc, "takeover") from exc
            if rows:
                record = parse_record(consumer, key, rows[0][:10])
                return Claim(ClaimStatus.TAKEN_OVER, record, rows[0][10])
            return await self._claim(
                conn, consumer, key, fingerprint, token, lease_ms, keep_ms, False,
                Status.IN_PROGRESS, None,
            )  # fmt: skip

    async def _fenced(
        self,
        op: str,
        sql: bytes,
        done: Status | None,
        consumer: str,
        key: str,
        token: str,
        values: dict[str, Any],
    ) -> Record:
        """Run a write that only applies while ``token`` owns the record; otherwise raise
        :class:`~oncely.LeaseLost` with the current record. A repeat of a write that already
        landed (same token, status ``done``) returns the record unchanged."""
        params = {"now": self._now(), "consumer": consumer, "key": key, "token": token, **values}
        async with self._connection(op) as conn:
            try:
                rows = await fetchall(conn, sql, params)
                if rows:
                    return parse_record(consumer, key, rows[0])
                params["now"] = self._now()
                rows = await fetchall(conn, self._dialect.get, params)
            except psycopg.Error as exc:
                raise self._error(exc, op) from exc
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
        values = {"keep": keep_ms, "result": result, "note": note}
        return await self._fenced(
            "complete", self._dialect.complete, Status.COMPLETED, consumer, key, token, values
        )

    async def fail(
        self, consumer: str, key: str, *, token: str, error: str, keep_ms: int
    ) -> Record:
        values = {"keep": keep_ms, "error": error}
        return await self._fenced(
            "fail", self._dialect.fail, Status.FAILED, consumer, key, token, values
        )

    async def renew(
        self, consumer: str, key: str, *, token: str, lease_ms: int, keep_ms: int
    ) -> Record:
        values = {"lease": lease_ms, "span": max(keep_ms, lease_ms)}
        return await self._fenced("renew", self._dialect.renew, None, consumer, key, token, values)

    async def release(self, consumer: str, key: str, *, token: str) -> bool:
        params = {"now": self._now(), "consumer": consumer, "key": key, "token": token}
        async with self._connection("release") as conn:
            try:
                if await fetchall(conn, self._dialect.release, params):
                    return True
                params["now"] = self._now()
                rows = await fetchall(conn, self._dialect.get, params)
            except psycopg.Error as exc:
                raise self._error(exc, "release") from exc
        if not rows:
            return False
        raise lease_lost("release", consumer, key, Lost(parse_record(consumer, key, rows[0])))

    # ------------------------------------------------------------ transactional mode (R7)

    async def claim_in(
        self,
        tx: Connection,
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
        joined = JOINED.get(tx)
        if joined is None:
            return await self._claim(
                tx, consumer, key, fingerprint, token, 0, keep_ms, takeover, initial, error
            )
        begin = joined.begin
        if begin is not None:  # oncely's own transaction, not begun yet: BEGIN goes with it
            joined.begin = None
            return await self._claim(
                tx, consumer, key, fingerprint, token, 0, keep_ms, takeover, initial, error,
                None, begin,
            )  # fmt: skip
        point = joined.pending
        if point is None:
            return await self._claim(
                tx, consumer, key, fingerprint, token, 0, keep_ms, takeover, initial, error
            )
        joined.pending = None
        try:
            return await self._claim(
                tx, consumer, key, fingerprint, token, 0, keep_ms, takeover, initial, error,
                point,
            )  # fmt: skip
        finally:
            if point.set:
                if point.stamp is not None and point.stamp != joined.stamp:
                    joined.stamp, joined.kept = point.stamp, 0  # a new transaction
                point.base = joined.kept
