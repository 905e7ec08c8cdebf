"""Round trips and statements per operation, counted from libpq's own trace."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg_pool import ConnectionPool

import oncely
from oncely.stores.postgres.sync_store import PostgresStore
from tests.services import POSTGRES_DSN
from tests.stores.postgres.helpers import KEEP_MS, _claim, _ledger, _ledger_counts, _traced


def test_round_trips_per_operation(table: str) -> None:
    """A new key and a duplicate cost one round trip each. In its own transaction the
    transactional mode adds no round trip (BEGIN goes out with the claim in one pipeline,
    and a result's UPDATE with the COMMIT: a statement more each, no wait more); joined to a
    caller's transaction with the default savepoint it adds one: the SAVEPOINT goes out
    with the claim in one pipeline, and is not released on success."""
    pool = ConnectionPool(
        POSTGRES_DSN, min_size=1, max_size=1, kwargs={"autocommit": True}, open=True
    )
    ledger = _ledger(table)
    insert = f"INSERT INTO {ledger} (key) VALUES (%s)".encode()

    def writes(key: str, result: str | None = None) -> Callable[[Any, object], str | None]:
        def handler(tx: psycopg.Connection[Any], payload: object) -> str | None:
            tx.execute(insert, (key,))
            return result

        return handler

    try:
        store = PostgresStore(pool, table=table)
        inbox = oncely.Inbox(store, consumer="c")
        store.migrate()
        for i in range(6):  # past psycopg's prepare threshold: the steady state
            inbox.handle_in_transaction(f"warm-{i}", 1, writes("w"))
            inbox.handle(f"warm2-{i}", 1, lambda p: "r")
        conn = pool.getconn()  # the pool's only connection: the store uses it too
        pool.putconn(conn)
        with _traced(conn) as new:
            _claim(store, "new")
        with _traced(conn) as dup:
            _claim(store, "new", token="t2")
        with _traced(conn) as done:
            store.complete("c", "new", token="t", result=b"r", keep_ms=KEEP_MS)
        # The transaction a handler needs anyway: BEGIN, its write, COMMIT.
        with _traced(conn) as bare, pool.connection() as mine, mine.transaction():
            mine.execute(insert, ("bare",))
        with _traced(conn) as tx_none:
            inbox.handle_in_transaction("a", 1, writes("a"))
        with _traced(conn) as tx_result:
            inbox.handle_in_transaction("b", 1, writes("b", result="r"))
        with _traced(conn) as tx_dup:
            inbox.handle_in_transaction("a", 1, writes("a"))
        with _traced(conn) as joined, pool.connection() as mine, mine.transaction():
            mine.execute(insert, ("own",))
            inbox.handle_in_transaction("c", 1, writes("c"), tx=mine)
        with _traced(conn) as joined_result, pool.connection() as mine, mine.transaction():
            mine.execute(insert, ("own",))
            inbox.handle_in_transaction("e", 1, writes("e", result="r"), tx=mine)
        with _traced(conn) as lean, pool.connection() as mine, mine.transaction():
            mine.execute(insert, ("own",))
            inbox.handle_in_transaction("d", 1, writes("d"), tx=mine, savepoint=False)
        print(
            f"\nround trips: new {new} dup {dup} complete {done} bare-tx {bare} "
            f"tx-no-result {tx_none} tx-result {tx_result} tx-dup {tx_dup} joined {joined} "
            f"joined-without-savepoint {lean}"
        )
        assert new == {"round_trips": 1, "statements": 1, "waits": 1}
        assert dup == {"round_trips": 1, "statements": 1, "waits": 1}
        assert done["round_trips"] == 1
        # BEGIN and the claim in one round trip: the same trips as the bare transaction,
        # one statement more (R7 at no round trip of its own).
        assert tx_none["round_trips"] == bare["round_trips"]
        assert tx_none["statements"] - bare["statements"] == 1
        assert tx_result["round_trips"] == bare["round_trips"]  # UPDATE with the COMMIT
        assert tx_result["statements"] - bare["statements"] == 2
        assert tx_dup["round_trips"] == bare["round_trips"] - 1  # BEGIN + claim, COMMIT
        # The caller's transaction with its own write and the handler's: BEGIN, 2 writes,
        # COMMIT; oncely adds SAVEPOINT and the claim, two statements in one round trip.
        assert joined["round_trips"] - (bare["round_trips"] + 1) == 1
        assert joined["statements"] - (bare["statements"] + 1) == 2
        # ... and the result's UPDATE when there is one.
        assert joined_result["round_trips"] - (bare["round_trips"] + 1) == 2
        # With savepoint=False oncely adds only the claim to the caller's transaction.
        assert lean["round_trips"] - (bare["round_trips"] + 1) == 1
        for counted in (new, dup, done, bare, tx_none, tx_result, tx_dup, joined, lean):
            assert counted["waits"] == counted["round_trips"]  # no hidden wait in a pipeline
        store.close()
    finally:
        pool.close()
    assert _ledger_counts(ledger) == Counter(
        {"w": 6, "bare": 1, "a": 1, "b": 1, "own": 3, "c": 1, "d": 1, "e": 1}
    )
