"""The MariaDB / MySQL store: InnoDB tables shared by any number of processes and hosts, both
modes.

A new key is claimed with one statement, one round trip: ``INSERT ... ON DUPLICATE KEY
UPDATE`` on the ``(consumer, key)`` primary key, so InnoDB's unique check and row locks are
the arbiter (R8, R9). A duplicate costs a second round trip (the winner's row and the
server's time); only an expired record or a stale claim to take over costs a third, a
compare-and-set write. Every decision is made by :mod:`oncely._core.state` in Python on a row
version the write then insists on. The SQL is :mod:`oncely.stores.mysql.dialect`; the driver
differences (PyMySQL, aiomysql) are in ``_mysql_io``.

This module is the message path: the claim, the fenced writes and the claim inside a
caller's transaction. How the store's modules divide the rest is told in ``sql_base``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from oncely._core.records import Claim, ClaimRequest, ClaimStatus, Record, Status
from oncely._core.state import (
    DELETE,
    UNCHANGED,
    ClaimEvent,
    CompleteEvent,
    FailEvent,
    Lost,
    NewState,
    ReleaseEvent,
    RenewEvent,
    TakeoverEvent,
    apply_claim,
    apply_complete,
    apply_fail,
    apply_release,
    apply_renew,
    apply_takeover,
    claim_event,
)
from oncely._core.table import lease_lost
from oncely.errors import StoreUnavailable, TransactionRequired
from oncely.stores.mysql.async_io import Connection, execute, fetchall
from oncely.stores.mysql.async_tx import MySQLTransactions
from oncely.stores.mysql.dialect import (
    MAX_CONSUMER_BYTES,
    WIDTH,
    batch_rows,
    claim_params,
    parse_record,
    utf8,
    who,
    write_params,
)
from oncely.stores.mysql.errors import DRIVER_ERRORS, in_transaction, translate

__all__ = ["AsyncMySQLStore"]

E = TypeVar("E")
R = TypeVar("R")

_ROUNDS = 8  # reads and compare-and-set writes before a key that keeps changing gives up
_BATCH = 500  # keys per multi-row statement of claim_many


class AsyncMySQLStore(MySQLTransactions):
    """A dedup store in a MariaDB (10.5+) or MySQL (8.0+) database, InnoDB tables (transactional
    and two-phase modes).

    Times come from the server's clock (``UTC_TIMESTAMP(3)``, read inside each statement), or
    from ``clock`` when one is given. The tables are created on first use unless
    ``migrate=False``, in which case missing tables raise :class:`~oncely.SchemaMissing`; a
    schema written by a newer oncely raises :class:`~oncely.SchemaTooNew`. At most
    ``pool_size`` connections are open at once; a connection the server closed (a restart) is
    dropped, and the next call connects again. Deadlocks and lock wait timeouts of oncely's
    own autocommit statements are retried a few times before
    :class:`~oncely.StoreUnavailable`; inside a transaction they are reported at once (InnoDB
    rolled the transaction, or the statement, back).

    Transactional mode: :meth:`transaction` yields one of the store's connections (PyMySQL /
    aiomysql) after ``BEGIN``; the session stays in autocommit mode, so the same pooled
    connection needs no extra round trips in two-phase mode. :meth:`claim_in` joins any
    connection of yours to the same database that is inside a transaction (after ``BEGIN``,
    or with autocommit off), as the driver's last server status says. Joining sets the
    session's ``LAST_INSERT_ID()`` (the claim reads the server's clock through it): read an
    id you inserted before joining from ``cursor.lastrowid``, or before the claim.

    The asyncio variant belongs to the event loop that first uses it: open one store per
    loop. The threaded variant may be shared by any number of threads. After ``fork`` a child
    opens connections of its own; never fork in the middle of a transaction.
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
        event = claim_event(consumer, key, fingerprint, token, lease_ms, keep_ms, takeover)
        return await self._run("claim", lambda conn: self._claim(conn, event, False))

    async def _claim(self, conn: Connection, ev: ClaimEvent, joined: bool) -> Claim:
        dialect = self._dialect
        params = claim_params(ev)
        read = dialect.read_locked if joined else dialect.read
        for _ in range(_ROUNDS):
            params["now"] = self._now()
            inserted = (await execute(conn, dialect.insert, params))[1]
            if joined and not in_transaction(conn):
                await self._outside_transaction(conn, params, inserted)
            if inserted:  # the OK packet carries now + 1 from the insert branch, else 0
                return apply_claim(None, ev, inserted - 1)[1]
            rows = await fetchall(conn, read, params)
            if not rows:
                continue  # the winner's record vanished (released): claim again
            current = parse_record(ev.consumer, ev.key, rows[0])
            if current.token == ev.token:  # ours after all (a proxy that drops the insert id)
                return Claim(ClaimStatus.NEW, current, current.created_ms)
            new, claim = apply_claim(current, ev, int(rows[0][WIDTH]))
            if new is UNCHANGED or await self._write(conn, params, current, new):
                return claim
            # Another claim changed the record between the read and the write: look again.
        raise StoreUnavailable(f"claim of key {ev.key!r} kept racing with other claims; retry")

    async def _outside_transaction(
        self, conn: Connection, params: dict[str, Any], inserted: int
    ) -> None:
        # The driver said a transaction was open, the server's answer to the INSERT says the
        # statement autocommitted: the caller's transaction had ended (a deadlock rolls it
        # back with an error the caller may have swallowed). A marker committed without the
        # business writes would turn their redelivery into a duplicate: take it back.
        if inserted:
            await execute(conn, self._dialect.forget_token, params)
        raise TransactionRequired(
            "the connection's transaction had ended before the claim (rolled back by the "
            "server, or committed): begin a new transaction and handle the message again"
        )

    async def _write(
        self, conn: Connection, names: dict[str, Any], seen: Record, new: NewState
    ) -> bool:
        """Replace (or delete) the row only while it is still the version ``seen``."""
        if new is DELETE:
            values = write_params(names, seen, None)
            return (await execute(conn, self._dialect.delete, values))[0] > 0
        assert isinstance(new, Record)
        values = write_params(names, seen, new)
        return (await execute(conn, self._dialect.write, values))[0] > 0

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
        events = [
            claim_event(consumer, r.key, r.fingerprint, r.token, lease_ms, keep_ms, takeover)
            for r in requests
        ]
        return await self._run("claim_many", lambda conn: self._claim_many(conn, events))

    async def _claim_many(self, conn: Connection, events: list[ClaimEvent]) -> list[Claim]:
        claims: list[Claim] = []
        for start in range(0, len(events), _BATCH):
            claims.extend(await self._claim_batch(conn, events[start : start + _BATCH]))
        return claims

    async def _claim_batch(self, conn: Connection, events: list[ClaimEvent]) -> list[Claim]:
        # One multi-row insert-if-absent; when its OK packet says every key went in, the
        # records are built here from what was sent (one round trip). Otherwise one read of
        # every row follows: a row carrying the request's token is the one it inserted
        # (tokens are unique), so the answers do not depend on affected-row counts.
        first, rows = batch_rows(events)
        ev0 = events[0]
        consumer = utf8(ev0.consumer, "consumer", MAX_CONSUMER_BYTES)
        lease, span = ev0.lease_ms, max(ev0.keep_ms, ev0.lease_ms)
        now = self._now()
        sql = self._dialect.claim_many_insert(consumer, rows, lease, span, now)
        inserted = (await execute(conn, sql))[1]
        if inserted:  # now + 1: every key was absent and holds the row sent for it
            return self._all_new(events, first, inserted - 1, lease, span)
        found = await fetchall(conn, self._dialect.claim_many_read(consumer, rows, now))
        held: dict[str, Record | None] = dict.fromkeys(first)
        read_at = 0
        for row in found:
            key = bytes(row[0]).decode("utf-8")
            held[key] = parse_record(ev0.consumer, key, row[1:])
            read_at = int(row[1 + WIDTH])
        claims: list[Claim] = []
        for i, ev in enumerate(events):
            current = held[ev.key]
            if current is not None and first[ev.key] == i and current.token == ev.token:
                claim = Claim(ClaimStatus.NEW, current, current.created_ms)
            elif current is None:  # released or forgotten between the two statements
                claim = await self._claim(conn, ev, False)
            else:
                new, claim = apply_claim(current, ev, read_at)
                names = {"consumer": consumer, "key": ev.key.encode("utf-8")}
                if new is not UNCHANGED and not await self._write(conn, names, current, new):
                    claim = await self._claim(conn, ev, False)
            held[ev.key] = claim.record
            claims.append(claim)
        return claims

    @staticmethod
    def _all_new(
        events: list[ClaimEvent], first: dict[str, int], now: int, lease: int, span: int
    ) -> list[Claim]:
        """The answers when every key of the batch was inserted by its first request: NEW
        with the row as sent, and EXISTING (that row) for a key the batch repeats."""
        claims: list[Claim] = []
        won: dict[str, Record] = {}
        for i, ev in enumerate(events):
            if first[ev.key] != i:
                claims.append(Claim(ClaimStatus.EXISTING, won[ev.key], now))
                continue
            record = Record(
                ev.consumer, ev.key, Status.IN_PROGRESS, ev.fingerprint, ev.token, 1,
                now, now, now + lease, now + span,
            )  # fmt: skip
            won[ev.key] = record
            claims.append(Claim(ClaimStatus.NEW, record, now))
        return claims

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
        ev = claim_event(consumer, key, fingerprint, token, lease_ms, keep_ms, False)
        event = TakeoverEvent(ev, expected_token)
        return await self._run("takeover", lambda conn: self._takeover(conn, event))

    async def _takeover(self, conn: Connection, event: TakeoverEvent) -> Claim:
        ev = event.claim
        params = claim_params(ev)
        for _ in range(_ROUNDS):
            params["now"] = self._now()
            rows = await fetchall(conn, self._dialect.read, params)
            if not rows:
                break
            current = parse_record(ev.consumer, ev.key, rows[0])
            now = int(rows[0][WIDTH])
            if current.is_expired(now):
                break
            new, claim = apply_takeover(current, event, now)
            if new is UNCHANGED or await self._write(conn, params, current, new):
                return claim
        else:
            raise StoreUnavailable(f"takeover of key {ev.key!r} kept racing; retry later")
        # Absent (or expired): the reconciler's decision is moot, claim afresh.
        return await self._claim(conn, ev, False)

    async def _fenced(
        self,
        conn: Connection,
        op: str,
        consumer: str,
        key: str,
        apply: Callable[[Record | None, E, int], tuple[NewState, R | Lost]],
        event: E,
    ) -> R:
        """Read the row, let the state table decide, write with a compare-and-set; raise
        :class:`~oncely.LeaseLost` (changing nothing) when the table says Lost."""
        names = who(consumer, key)
        for _ in range(_ROUNDS):
            names["now"] = self._now()
            rows = await fetchall(conn, self._dialect.read, names)
            current = parse_record(consumer, key, rows[0]) if rows else None
            # An absent record's answer does not depend on the time.
            now = int(rows[0][WIDTH]) if rows else 0
            new, answer = apply(current, event, now)
            if isinstance(answer, Lost):
                raise lease_lost(op, consumer, key, answer)
            if new is UNCHANGED or (
                current is not None and await self._write(conn, names, current, new)
            ):
                return answer
        raise StoreUnavailable(f"{op} of key {key!r} kept racing with other writers; retry")

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
        event = CompleteEvent(token, result, keep_ms, note)
        return await self._run(
            "complete",
            lambda conn: self._fenced(conn, "complete", consumer, key, apply_complete, event),
        )

    async def fail(
        self, consumer: str, key: str, *, token: str, error: str, keep_ms: int
    ) -> Record:
        event = FailEvent(token, error, keep_ms)
        return await self._run(
            "fail", lambda conn: self._fenced(conn, "fail", consumer, key, apply_fail, event)
        )

    async def renew(
        self, consumer: str, key: str, *, token: str, lease_ms: int, keep_ms: int
    ) -> Record:
        event = RenewEvent(token, lease_ms, keep_ms)
        return await self._run(
            "renew", lambda conn: self._fenced(conn, "renew", consumer, key, apply_renew, event)
        )

    async def release(self, consumer: str, key: str, *, token: str) -> bool:
        event = ReleaseEvent(token)
        return await self._run(
            "release",
            lambda conn: self._fenced(conn, "release", consumer, key, apply_release, event),
        )

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
        event = claim_event(consumer, key, fingerprint, token, 0, keep_ms, takeover, initial, error)
        try:
            return await self._claim(tx, event, True)
        except DRIVER_ERRORS as exc:
            raise translate(exc, "claim", joined=True) from exc
