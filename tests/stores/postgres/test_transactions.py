"""The transactional mode (R7) on PostgreSQL: the caller's transaction survives
conflicts and failed claims, and savepoints left open in a joined
transaction never hide the one a failing message must roll back to.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from psycopg import pq

import oncely
from oncely import Outcome
from oncely.stores import ClaimStatus
from oncely.stores.postgres.async_store import AsyncPostgresStore
from oncely.stores.postgres.sync_store import PostgresStore
from tests.services import POSTGRES_DSN
from tests.stores.postgres.helpers import KEEP_MS, _claim, _ledger, _ledger_counts, _traced

# ------------------------------------------------------------------ transactional mode (R7)


def test_r7_a_conflict_never_aborts_the_callers_transaction(store: PostgresStore) -> None:
    inbox = oncely.Inbox(store, consumer="c")
    assert inbox.handle_in_transaction("k", 1, lambda tx, p: None).outcome is Outcome.PROCESSED
    with psycopg.connect(POSTGRES_DSN) as conn:  # the caller's own, autocommit off, idle
        duplicate = inbox.handle_in_transaction("k", 1, lambda tx, p: None, tx=conn)
        conflict = inbox.handle_in_transaction("k", 2, lambda tx, p: None, tx=conn)
        claim = store.claim_in(
            conn, "c", "k", fingerprint=None, token="x", keep_ms=1, takeover=True
        )
        assert conn.info.transaction_status == pq.TransactionStatus.INTRANS  # still usable
        assert conn.execute("SELECT 1").fetchone() == (1,)
        fresh = inbox.handle_in_transaction("k2", 1, lambda tx, p: "r", tx=conn)
        conn.commit()
    assert duplicate.outcome is Outcome.DUPLICATE and conflict.outcome is Outcome.KEY_CONFLICT
    assert claim.status is ClaimStatus.EXISTING
    assert fresh.outcome is Outcome.PROCESSED
    assert inbox.handle("k2", 1, lambda p: "again").value == "r"


def test_r7_transaction_states_are_checked(store: PostgresStore) -> None:
    inbox = oncely.Inbox(store, consumer="c")
    with psycopg.connect(POSTGRES_DSN, autocommit=True) as conn:
        with pytest.raises(oncely.TransactionRequired, match="autocommit"):
            inbox.handle_in_transaction("k", 1, lambda tx, p: None, tx=conn)
        with conn.transaction():
            assert inbox.handle_in_transaction("k", 1, lambda tx, p: None, tx=conn).ok
        conn.execute("BEGIN")
        with pytest.raises(psycopg.errors.DivisionByZero):
            conn.execute("SELECT 1 / 0")
        with pytest.raises(oncely.TransactionRequired, match="failed earlier"):
            inbox.handle_in_transaction("k3", 1, lambda tx, p: None, tx=conn)
        conn.execute("ROLLBACK")
    with pytest.raises(oncely.TransactionRequired):
        inbox.handle_in_transaction("k4", 1, lambda tx, p: None, tx=object())


def test_r7_the_handler_gets_a_psycopg_connection_in_a_transaction(store: PostgresStore) -> None:
    inbox = oncely.Inbox(store, consumer="c")
    seen: list[object] = []

    def book(tx: psycopg.Connection[Any], payload: object) -> None:
        seen.append(tx.info.transaction_status)
        with pytest.raises(psycopg.ProgrammingError):
            tx.commit()  # psycopg forbids splitting the marker from the writes

    inbox.handle_in_transaction("k", 1, book)
    assert seen == [pq.TransactionStatus.INTRANS]


def test_r7_repeatable_read_callers_get_store_unavailable_not_a_wrong_answer(
    store: PostgresStore,
) -> None:
    """Under REPEATABLE READ a claim racing a concurrent commit cannot see the winner: the
    server raises a serialization failure, translated to StoreUnavailable (retry later)."""
    store.migrate()
    with psycopg.connect(POSTGRES_DSN) as conn:
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        conn.execute("SELECT 1")  # the snapshot is taken now
        _claim(store, token="elsewhere")  # commits after that snapshot
        with pytest.raises(oncely.StoreUnavailable) as raised:
            store.claim_in(conn, "c", "k", fingerprint="f", token="mine", keep_ms=1, takeover=True)
        assert not isinstance(raised.value, psycopg.Error)
        conn.rollback()


# ------------------------------------------------------------------ savepoints left open


def _handler(ledger: str, key: str, *, fails: bool = False) -> Callable[[Any, object], None]:
    def book(tx: psycopg.Connection[Any], payload: object) -> None:
        tx.execute(f"INSERT INTO {ledger} (key) VALUES (%s)".encode(), (key,))
        if fails:
            raise ValueError(f"{key} fails")

    return book


def test_r7_many_messages_in_one_caller_transaction_roll_back_only_their_own(
    store: PostgresStore, table: str
) -> None:
    """Savepoints left open after successful messages never hide the one a failing message
    must roll back to: in one caller transaction, messages that fail between, inside and
    around successful ones (nested handlers, and the caller's own savepoints in between)
    undo exactly their own writes and markers."""
    ledger = _ledger(table)
    inbox = oncely.Inbox(store, consumer="c")

    def outer_with_inner(inner_fails: bool, outer_fails: bool) -> Callable[[Any, object], None]:
        def outer(tx: psycopg.Connection[Any], payload: object) -> None:
            name = str(payload)
            _handler(ledger, f"{name}-outer")(tx, payload)
            inner = inbox.handle_in_transaction(
                f"{name}-inner", 1, _handler(ledger, f"{name}-inner", fails=inner_fails), tx=tx
            )
            assert inner.outcome is (Outcome.FAILED if inner_fails else Outcome.PROCESSED)
            _handler(ledger, f"{name}-after", fails=outer_fails)(tx, payload)

        return outer

    with psycopg.connect(POSTGRES_DSN, autocommit=True) as mine, mine.transaction():
        mine.execute(f"INSERT INTO {ledger} (key) VALUES ('mine')".encode())
        outcomes = [
            inbox.handle_in_transaction("a", 1, _handler(ledger, "a"), tx=mine).outcome,
            inbox.handle_in_transaction("b", 1, _handler(ledger, "b"), tx=mine).outcome,
            inbox.handle_in_transaction("x", 1, _handler(ledger, "x", fails=True), tx=mine).outcome,
            inbox.handle_in_transaction("c", 1, _handler(ledger, "c"), tx=mine).outcome,
            # the inner message succeeds (its savepoint stays open), then the outer fails:
            # the rollback must reach the outer's savepoint, undoing the inner too
            inbox.handle_in_transaction("n1", "n1", outer_with_inner(False, True), tx=mine).outcome,
            # the inner fails, the outer goes on and succeeds
            inbox.handle_in_transaction("n2", "n2", outer_with_inner(True, False), tx=mine).outcome,
        ]
        with mine.transaction():  # the caller's own savepoint, after oncely's open ones
            inbox.handle_in_transaction("d", 1, _handler(ledger, "d"), tx=mine)
        with pytest.raises(ZeroDivisionError), mine.transaction():
            inbox.handle_in_transaction("gone", 1, _handler(ledger, "gone"), tx=mine)
            raise ZeroDivisionError  # the caller rolls its savepoint back, oncely's inside
        y = inbox.handle_in_transaction("y", 1, _handler(ledger, "y", fails=True), tx=mine)
        assert y.outcome is Outcome.FAILED
        assert inbox.handle_in_transaction("e", 1, _handler(ledger, "e"), tx=mine).ok
    assert outcomes == [
        Outcome.PROCESSED,
        Outcome.PROCESSED,
        Outcome.FAILED,
        Outcome.PROCESSED,
        Outcome.FAILED,
        Outcome.PROCESSED,
    ]
    written = {"mine", "a", "b", "c", "n2-outer", "n2-after", "d", "e"}
    assert _ledger_counts(ledger) == Counter(dict.fromkeys(written, 1))
    markers = {r.key for r in store.scan(consumer="c")}
    assert markers == {"a", "b", "c", "n2", "d", "e"}


def test_r7_a_claim_failing_after_its_savepoint_leaves_the_caller_transaction_usable(
    store: PostgresStore, table: str
) -> None:
    """The SAVEPOINT went out with a claim that then failed (a lock timeout: another
    transaction holds the key): oncely rolls back to it, so the caller's transaction and its
    earlier writes survive, and StoreUnavailable says to retry the message later."""
    ledger = _ledger(table)
    inbox = oncely.Inbox(store, consumer="c")
    with psycopg.connect(POSTGRES_DSN) as holder:
        store.claim_in(holder, "c", "k", fingerprint=None, token="held", keep_ms=KEEP_MS,
                       takeover=True)  # fmt: skip
        with psycopg.connect(POSTGRES_DSN, autocommit=True) as mine, mine.transaction():
            mine.execute(f"INSERT INTO {ledger} (key) VALUES ('mine')".encode())
            mine.execute("SET LOCAL lock_timeout = '50ms'")
            with pytest.raises(oncely.StoreUnavailable):
                inbox.handle_in_transaction("k", 1, _handler(ledger, "k"), tx=mine)
            assert mine.info.transaction_status == pq.TransactionStatus.INTRANS
            assert inbox.handle_in_transaction("k2", 1, _handler(ledger, "k2"), tx=mine).ok
        holder.rollback()
    assert _ledger_counts(ledger) == Counter({"mine": 1, "k2": 1})
    assert store.get("c", "k") is None and store.get("c", "k2") is not None


def test_r7_savepoints_left_open_are_bounded_per_caller_transaction(table: str) -> None:
    """At most OPEN_SAVEPOINTS of them stay open in one transaction; past that each message
    releases its own. A new transaction on the same connection starts the count again."""
    from oncely.stores.postgres.sync_tx import OPEN_SAVEPOINTS

    store = PostgresStore(POSTGRES_DSN, table=table, pool_max=1)
    ledger = _ledger(table)
    inbox = oncely.Inbox(store, consumer="c")
    extra = 7
    try:
        with psycopg.connect(POSTGRES_DSN, autocommit=True) as mine:
            # No prepared statements: psycopg's own round trip to prepare one on its 5th run
            # (RELEASE's, here) would blur the count.
            mine.prepare_threshold = None
            tags: list[str] = []
            with _traced(mine, tags) as first, mine.transaction():
                for i in range(OPEN_SAVEPOINTS + extra):
                    inbox.handle_in_transaction(f"a{i}", 1, _handler(ledger, "a"), tx=mine)
                failed = inbox.handle_in_transaction(
                    "bad", 1, _handler(ledger, "bad", fails=True), tx=mine
                )
                assert failed.outcome is Outcome.FAILED
            # the failing message is rolled back to its savepoint, which is then released too
            assert tags.count("RELEASE") == extra + 1
            assert tags.count("ROLLBACK") == 1
            assert tags.count("SAVEPOINT") == OPEN_SAVEPOINTS + extra + 1
            tags.clear()
            with _traced(mine, tags) as second, mine.transaction():
                for i in range(3):
                    inbox.handle_in_transaction(f"b{i}", 1, _handler(ledger, "b"), tx=mine)
            assert tags.count("SAVEPOINT") == 3 and "RELEASE" not in tags
            # BEGIN, COMMIT, and per message: the SAVEPOINT with the claim, the handler's write
            assert second["round_trips"] == 2 + 3 * 2
            messages = OPEN_SAVEPOINTS + extra
            # + the failing one, + the read of which database the connection is on (once)
            assert first["round_trips"] == 2 + messages * 2 + extra + 4 + 1
    finally:
        store.close()
    assert _ledger_counts(ledger) == Counter({"a": OPEN_SAVEPOINTS + extra, "b": 3})


async def test_r7_async_joined_claim_adds_one_round_trip(table: str) -> None:
    """The asyncio store pipelines its SAVEPOINT with the claim the same way."""
    store = AsyncPostgresStore(POSTGRES_DSN, table=table, pool_max=1)
    ledger = _ledger(table)
    inbox = oncely.AsyncInbox(store, consumer="c")

    async def book(tx: psycopg.AsyncConnection[Any], payload: object) -> None:
        await tx.execute(f"INSERT INTO {ledger} (key) VALUES (%s)".encode(), (str(payload),))

    async def fails(tx: psycopg.AsyncConnection[Any], payload: object) -> None:
        await book(tx, payload)
        raise ValueError("no")

    try:
        async with await psycopg.AsyncConnection.connect(POSTGRES_DSN, autocommit=True) as mine:
            async with mine.transaction():
                assert (await inbox.handle_in_transaction("w-x", "w", fails, tx=mine)).ok is False
            for i in range(6):
                async with mine.transaction():
                    await inbox.handle_in_transaction(f"w{i}", "w", book, tx=mine)
            with _traced(mine) as bare:
                async with mine.transaction():
                    await book(mine, "bare")
            with _traced(mine) as joined:
                async with mine.transaction():
                    assert (await inbox.handle_in_transaction("k", "k", book, tx=mine)).ok
                    failed = await inbox.handle_in_transaction("x", "x", fails, tx=mine)
                    assert failed.outcome is Outcome.FAILED
            # BEGIN; k: SAVEPOINT + claim, its write; x: the same and the rollback; COMMIT
            assert bare["round_trips"] == 3 and joined["round_trips"] == 1 + 2 + 3 + 1
            assert joined["waits"] == joined["round_trips"]
    finally:
        await store.aclose()
    assert _ledger_counts(ledger) == Counter({"w": 6, "bare": 1, "k": 1})


# ------------------------------------------------------- oncely's own transaction, lazily begun


def test_r7_own_transaction_begins_with_the_claim_and_keeps_psycopgs_guards(table: str) -> None:
    """In its own transaction the inbox sends BEGIN with the claim (one pipeline): the
    handler still runs inside the transaction, ``commit()`` is still refused inside it, a
    failing handler still rolls back marker and writes, and the pooled connection comes
    back idle and out of pipeline mode each time."""
    store = PostgresStore(POSTGRES_DSN, table=table, pool_max=1)
    ledger = _ledger(table)
    insert = f"INSERT INTO {ledger} (key) VALUES (%s)".encode()
    inbox = oncely.Inbox(store, consumer="c")
    seen: list[tuple[Any, bool]] = []

    def book(tx: psycopg.Connection[Any], payload: object) -> None:
        seen.append((tx.info.transaction_status, tx._pipeline is not None))
        tx.execute(insert, (str(payload),))

    def commits(tx: psycopg.Connection[Any], payload: object) -> None:
        book(tx, payload)
        tx.commit()

    def fails(tx: psycopg.Connection[Any], payload: object) -> None:
        book(tx, payload)
        raise ValueError("no")

    try:
        assert inbox.handle_in_transaction("a", "a", book).outcome is Outcome.PROCESSED
        refused = inbox.handle_in_transaction("b", "b", commits)
        assert refused.outcome is Outcome.FAILED
        assert isinstance(refused.error, psycopg.ProgrammingError)
        assert inbox.handle_in_transaction("c", "c", fails).outcome is Outcome.FAILED
        assert inbox.handle_in_transaction("a", "a", book).outcome is Outcome.DUPLICATE
        assert seen == [(pq.TransactionStatus.INTRANS, False)] * 3
        (conn,) = store._idle  # the pool's only connection, kept by the store when sound
        assert conn.info.transaction_status == pq.TransactionStatus.IDLE
        assert conn._pipeline is None
        # b and c left no marker: their redeliveries run again.
        assert inbox.handle_in_transaction("b", "b", book).outcome is Outcome.PROCESSED
        assert inbox.handle_in_transaction("c", "c", book).outcome is Outcome.PROCESSED
    finally:
        store.close()
    assert _ledger_counts(ledger) == Counter({"a": 1, "b": 1, "c": 1})


def test_r7_a_claim_first_block_that_never_claims_sends_nothing(store: PostgresStore) -> None:
    """``transaction(claim_first=True)`` ended before any claim (an error first, or nothing
    done) has begun nothing; a result stored before the claim begins it on the spot."""
    store.migrate()
    with pytest.raises(ValueError, match="first"), store.transaction(claim_first=True) as tx:
        raise ValueError("first")
    assert tx.info.transaction_status == pq.TransactionStatus.IDLE
    with store.transaction(claim_first=True) as tx, _traced(tx) as nothing:
        pass
    assert nothing["round_trips"] == 0
    with store.transaction(claim_first=True) as tx:
        store.set_result_in(tx, "c", "absent", token="t", result=b"r")
        assert tx.info.transaction_status == pq.TransactionStatus.INTRANS


def test_r7_a_failing_pipelined_claim_rolls_its_transaction_back(table: str) -> None:
    """A claim that fails in the pipeline with its BEGIN (here its table is gone) is a
    typed error, and the transaction it began is rolled back: the connection goes back to
    the pool idle and works for the next message."""
    store = PostgresStore(POSTGRES_DSN, table=table, pool_max=1)
    inbox = oncely.Inbox(store, consumer="c")
    try:
        assert inbox.handle_in_transaction("a", 1, lambda tx, p: None).ok
        drop = f"ALTER TABLE {table} RENAME TO {table}_away"
        with psycopg.connect(POSTGRES_DSN, autocommit=True) as admin:
            admin.execute(drop.encode())
            with pytest.raises(oncely.SchemaMissing):
                inbox.handle_in_transaction("b", 1, lambda tx, p: None)
            (conn,) = store._idle  # kept: back idle and sound
            assert conn.info.transaction_status == pq.TransactionStatus.IDLE
            admin.execute(f"ALTER TABLE {table}_away RENAME TO {table}".encode())
        assert inbox.handle_in_transaction("b", 1, lambda tx, p: None).ok
    finally:
        store.close()


async def test_r7_async_own_transaction_adds_no_round_trip(table: str) -> None:
    """The asyncio store sends its own transaction's BEGIN with the claim the same way."""
    store = AsyncPostgresStore(POSTGRES_DSN, table=table, pool_max=1)
    ledger = _ledger(table)
    inbox = oncely.AsyncInbox(store, consumer="c")

    async def book(tx: psycopg.AsyncConnection[Any], payload: object) -> None:
        assert tx.info.transaction_status == pq.TransactionStatus.INTRANS
        await tx.execute(f"INSERT INTO {ledger} (key) VALUES (%s)".encode(), (str(payload),))

    async def fails(tx: psycopg.AsyncConnection[Any], payload: object) -> None:
        await book(tx, payload)
        raise ValueError("no")

    async def answers(tx: psycopg.AsyncConnection[Any], payload: object) -> str:
        await book(tx, payload)
        return str(payload)

    try:
        for i in range(6):  # past psycopg's prepare threshold
            await inbox.handle_in_transaction(f"w{i}", "w", book)
        (conn,) = store._idle  # the pool's only connection, kept by the store
        with _traced(conn) as new:
            assert (await inbox.handle_in_transaction("k", "k", book)).ok
        with _traced(conn) as failed:
            assert (await inbox.handle_in_transaction("x", "x", fails)).ok is False
        with _traced(conn) as dup:
            assert (await inbox.handle_in_transaction("k", "k", book)).ok
        with _traced(conn) as result:
            assert (await inbox.handle_in_transaction("r", "r", answers)).value == "r"
        # BEGIN + claim; the write; COMMIT. For x, ROLLBACK instead, after which psycopg
        # also drops its prepared statements (DEALLOCATE ALL). The duplicate: BEGIN + claim,
        # COMMIT. With a result: its UPDATE goes with the COMMIT.
        assert new["round_trips"] == 3 and failed["round_trips"] == 4
        assert dup["round_trips"] == 2
        assert result["round_trips"] == 3 and result["statements"] == 5
        assert (await inbox.handle_in_transaction("r", "r", answers)).value == "r"
        assert new["waits"] == new["round_trips"]
    finally:
        await store.aclose()
    assert _ledger_counts(ledger) == Counter({"w": 6, "k": 1, "r": 1})


async def test_r7_async_a_claim_cancelled_in_its_pipeline_leaves_a_usable_store(
    table: str,
) -> None:
    """A message cancelled while its pipelined BEGIN + claim waits (here for the row lock of
    an uncommitted claim of the same key) records nothing, and the store serves the next
    messages: the claimer's transaction commits, a redelivery is a duplicate."""
    store = AsyncPostgresStore(POSTGRES_DSN, table=table, pool_max=2)
    inbox = oncely.AsyncInbox(store, consumer="c")

    async def nothing(tx: psycopg.AsyncConnection[Any], payload: object) -> None:
        return None

    try:
        await store.migrate()
        async with await psycopg.AsyncConnection.connect(POSTGRES_DSN) as first:
            claim = await store.claim_in(
                first, "c", "k", fingerprint=None, token="t1", keep_ms=KEEP_MS, takeover=True
            )
            assert claim.status is ClaimStatus.NEW  # uncommitted: the row stays locked
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(inbox.handle_in_transaction("k", 1, nothing), 0.5)
            await first.commit()
        assert (await inbox.handle_in_transaction("k", 1, nothing)).outcome is Outcome.DUPLICATE
        assert (await inbox.handle_in_transaction("k2", 1, nothing)).outcome is (Outcome.PROCESSED)
        for conn in store._idle:
            assert conn.info.transaction_status == pq.TransactionStatus.IDLE
            assert conn._pipeline is None
    finally:
        await store.aclose()


def test_r7_a_result_whose_update_fails_with_the_commit_commits_nothing(table: str) -> None:
    """The result's UPDATE travels with the COMMIT of oncely's own transaction; when it
    fails (here a CHECK the test adds), the COMMIT never runs: a typed error, no marker, no
    business write, and an idle connection for the next message."""
    store = PostgresStore(POSTGRES_DSN, table=table, pool_max=1)
    ledger = _ledger(table)
    insert = f"INSERT INTO {ledger} (key) VALUES (%s)".encode()
    inbox = oncely.Inbox(store, consumer="c")

    def book(tx: psycopg.Connection[Any], payload: object) -> str:
        tx.execute(insert, (str(payload),))
        return str(payload)

    try:
        store.migrate()
        with psycopg.connect(POSTGRES_DSN, autocommit=True) as admin:
            admin.execute(
                f"ALTER TABLE {table} ADD CONSTRAINT short_results "
                "CHECK (result IS NULL OR length(result) < 10)".encode()
            )
        assert inbox.handle_in_transaction("a", "a", book).value == "a"
        with pytest.raises(oncely.StoreError, match="commit"):
            inbox.handle_in_transaction("b", "b" * 40, book)
        (conn,) = store._idle
        assert conn.info.transaction_status == pq.TransactionStatus.IDLE
        assert store.get("c", "b") is None
        assert inbox.handle_in_transaction("a", "a", book).value == "a"  # the stored result
    finally:
        store.close()
    assert _ledger_counts(ledger) == Counter({"a": 1})


def test_r7_a_message_nested_in_an_own_transaction_keeps_both_results(table: str) -> None:
    """A handler in oncely's own transaction that hands a second message to another inbox
    in the same transaction (tx=, a savepoint): each message stores its own result, the
    outer one's UPDATE with the COMMIT, the inner one's inside its savepoint."""
    store = PostgresStore(POSTGRES_DSN, table=table, pool_max=1)
    outer = oncely.Inbox(store, consumer="outer")
    inner = oncely.Inbox(store, consumer="inner")

    def inner_handler(tx: psycopg.Connection[Any], payload: object) -> str:
        return f"inner-{payload}"

    def outer_handler(tx: psycopg.Connection[Any], payload: object) -> str:
        assert inner.handle_in_transaction("k", payload, inner_handler, tx=tx).ok
        return f"outer-{payload}"

    try:
        assert outer.handle_in_transaction("k", 1, outer_handler).value == "outer-1"
        assert outer.handle_in_transaction("k", 1, outer_handler).value == "outer-1"
        assert inner.handle_in_transaction("k", 1, inner_handler).value == "inner-1"
        (conn,) = store._idle
        assert conn.info.transaction_status == pq.TransactionStatus.IDLE
    finally:
        store.close()


class _SlowBlock:
    """An entered psycopg transaction block whose end waits 10 ms first: the failing
    statement's result then reaches the client around the time it sends the COMMIT. Which
    side of that moment it lands on decides where psycopg raises; on this machine about half
    the attempts ended in PipelineAborted before the fix."""

    def __init__(self, block: Any) -> None:
        self.block = block

    def __exit__(self, *exc: Any) -> Any:
        time.sleep(0.01)
        return self.block.__exit__(*exc)

    async def __aexit__(self, *exc: Any) -> Any:
        await asyncio.sleep(0.01)
        return await self.block.__aexit__(*exc)


ATTEMPTS = 30  # with half the attempts failing on the old code, 30 leave no chance to pass


def test_r7_a_statement_failing_with_the_commit_always_raises_its_own_error() -> None:
    """psycopg raised PipelineAborted, an OperationalError, from the pipeline's exit when the
    failing statement's result arrived while the COMMIT was being sent: read as a lost
    connection, a result too long for a CHECK became StoreUnavailable and threw away the
    store's kept connections (a loaded host did it about once in a hundred). The statement's
    own error comes out, every time, and the transaction is left for the caller to roll back."""
    from oncely.stores.postgres.sync_io import commit_after

    with psycopg.connect(POSTGRES_DSN) as conn:
        conn.execute("CREATE TEMP TABLE small (v int CHECK (v < 10))")
        conn.commit()
        for _ in range(ATTEMPTS):
            block = conn.transaction()
            block.__enter__()
            conn.execute("INSERT INTO small VALUES (1)")
            with pytest.raises(psycopg.errors.CheckViolation):
                commit_after(conn, _SlowBlock(block), b"INSERT INTO small VALUES (%s)", (99,))
            assert conn.info.transaction_status == pq.TransactionStatus.INERROR
            conn.rollback()
        assert conn.execute("SELECT count(*) FROM small").fetchone() == (0,)


async def test_r7_async_a_statement_failing_with_the_commit_always_raises_its_own_error() -> None:
    from oncely.stores.postgres.async_io import commit_after

    async with await psycopg.AsyncConnection.connect(POSTGRES_DSN) as conn:
        await conn.execute("CREATE TEMP TABLE small (v int CHECK (v < 10))")
        await conn.commit()
        for _ in range(ATTEMPTS):
            block = conn.transaction()
            await block.__aenter__()
            await conn.execute("INSERT INTO small VALUES (1)")
            with pytest.raises(psycopg.errors.CheckViolation):
                await commit_after(conn, _SlowBlock(block), b"INSERT INTO small VALUES (%s)", (99,))
            assert conn.info.transaction_status == pq.TransactionStatus.INERROR
            await conn.rollback()
        cursor = await conn.execute("SELECT count(*) FROM small")
        assert await cursor.fetchone() == (0,)


@pytest.mark.parametrize("result", [None, "kept"])
def test_r7_writes_a_deferred_constraint_refuses_at_commit_are_the_handlers_failure(
    table: str, result: str | None
) -> None:
    """A handler's write that breaks a DEFERRABLE INITIALLY DEFERRED constraint is refused
    only by the COMMIT of oncely's own transaction. Nothing committed, the marker neither:
    that is the handler's failure (``failed``: retried, dead-lettered once its deliveries
    are spent), as the same write under an immediate constraint is. Before, it raised
    StoreError, which a consumer takes for a store outage and gives back without end."""
    store = PostgresStore(POSTGRES_DSN, table=table, pool_max=1)
    child = f"{table}_ledger"
    parent = f"{table}_parent"
    inbox = oncely.Inbox(store, consumer="c")

    def book(tx: psycopg.Connection[Any], payload: int) -> str | None:
        tx.execute(f"INSERT INTO {child} (key, parent) VALUES ('k', %s)".encode(), (payload,))
        return result

    try:
        with psycopg.connect(POSTGRES_DSN, autocommit=True) as admin:
            admin.execute(f"CREATE TABLE {parent} (id INT PRIMARY KEY)".encode())
            admin.execute(f"INSERT INTO {parent} VALUES (1)".encode())
            admin.execute(
                f"CREATE TABLE {child} (key TEXT, parent INT REFERENCES {parent} (id) "
                "DEFERRABLE INITIALLY DEFERRED)".encode()
            )
        refused = inbox.handle_in_transaction("k", 2, book)
        assert refused.outcome is Outcome.FAILED
        assert refused.action is oncely.Action.RETRY
        assert refused.reason is not None and "foreign key" in refused.reason
        assert store.get("c", "k") is None
        (conn,) = store._idle
        assert conn.info.transaction_status == pq.TransactionStatus.IDLE
        assert inbox.handle_in_transaction("k", 1, book).outcome is Outcome.PROCESSED
        assert _ledger_counts(child) == Counter({"k": 1})
    finally:
        store.close()
        with psycopg.connect(POSTGRES_DSN, autocommit=True) as admin:
            admin.execute(f"DROP TABLE IF EXISTS {child}, {parent}".encode())


async def test_r7_async_a_deferred_constraint_refusing_the_commit_is_a_failure(table: str) -> None:
    """The asyncio store's own transaction answers the same: ``failed``, nothing kept."""
    store = AsyncPostgresStore(POSTGRES_DSN, table=table, pool_max=1)
    child = f"{table}_ledger"
    inbox = oncely.AsyncInbox(store, consumer="c")

    async def book(tx: psycopg.AsyncConnection[Any], payload: int) -> None:
        await tx.execute(f"INSERT INTO {child} (key, parent) VALUES ('k', %s)".encode(), (payload,))

    try:
        with psycopg.connect(POSTGRES_DSN, autocommit=True) as admin:
            admin.execute(
                f"CREATE TABLE {child} (key TEXT, parent INT, CONSTRAINT positive "
                "EXCLUDE USING btree (parent WITH =) DEFERRABLE INITIALLY DEFERRED)".encode()
            )
            admin.execute(f"INSERT INTO {child} VALUES ('other', 2)".encode())
        refused = await inbox.handle_in_transaction("k", 2, book)
        assert refused.outcome is Outcome.FAILED
        assert await store.get("c", "k") is None
        assert (await inbox.handle_in_transaction("k", 1, book)).outcome is Outcome.PROCESSED
    finally:
        await store.aclose()
    assert _ledger_counts(child) == Counter({"other": 1, "k": 1})
