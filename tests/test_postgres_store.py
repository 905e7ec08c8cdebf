"""PostgreSQL-specific behaviour: URLs, names, errors, the snapshot trap, round trips, pools that
survive a server restart, races and SIGKILLs across real processes.

Every test works on tables of its own (``oncely_t_<unique>``) and drops them, so these tests
can share the server with others. The whole contract suite runs on this store through
``tests/backends/postgres.py``; here is what only PostgreSQL has.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test
from psycopg import pq
from psycopg_pool import ConnectionPool

import oncely
from oncely import ClaimStatus, Outcome, Status
from oncely._async.postgres import AsyncPostgresStore
from oncely._core.records import ClaimRequest
from oncely._core.state import ClaimEvent, CompleteEvent, FailEvent
from oncely._core.table import RecordTable
from oncely._dialects.postgres import PostgresDialect, text_array
from oncely._sync._postgres_io import fetchall
from oncely._sync.postgres import PostgresStore
from tests.backends.postgres import drop_tables
from tests.chaos.harness import Processes
from tests.contract.test_model_stateful import Blocking, _machine
from tests.services import POSTGRES_DSN, require

LEASE_MS = 60_000
KEEP_MS = 3_600_000
_TWO_PHASE: dict[str, Any] = {"lease_ms": LEASE_MS, "keep_ms": KEEP_MS, "takeover": True}


@pytest.fixture(autouse=True)
def _server() -> None:
    require("PostgreSQL", POSTGRES_DSN, 5432)


@pytest.fixture
def table() -> Iterator[str]:
    """A unique inbox table name; the table, its meta twin and its ledger are dropped after."""
    name = f"oncely_t_{uuid.uuid4().hex[:12]}"
    try:
        yield name
    finally:
        drop_tables(name, f"{name}_ledger")


@pytest.fixture
def store(table: str) -> Iterator[PostgresStore]:
    made = PostgresStore(POSTGRES_DSN, table=table, pool_max=4)
    try:
        yield made
    finally:
        made.close()


def _sql(query: str, *params: object) -> list[tuple[Any, ...]]:
    with psycopg.connect(POSTGRES_DSN, autocommit=True) as conn:
        cursor = conn.execute(query.encode(), params or None)
        return cursor.fetchall() if cursor.description else []


def _claim(store: Any, key: str = "k", token: str = "t", **kw: Any) -> Any:
    options: dict[str, Any] = {
        "fingerprint": "f",
        "token": token,
        "lease_ms": LEASE_MS,
        "keep_ms": KEEP_MS,
        "takeover": True,
    }
    options.update(kw)
    return store.claim("c", key, **options)


def _ledger(table: str) -> str:
    name = f"{table}_ledger"
    _sql(f"CREATE TABLE IF NOT EXISTS {name} (key TEXT NOT NULL, worker TEXT)")
    return name


def _ledger_counts(ledger: str) -> Counter[str]:
    return Counter(dict(_sql(f"SELECT key, count(*) FROM {ledger} GROUP BY key")))


# ------------------------------------------------------------------ URLs and names


def test_url_options_are_read_and_libpq_parameters_passed_on(table: str) -> None:
    url = (
        "postgres://postgres:s3cret@127.0.0.1:5432/test?schema=public&table="
        f"{table}&pool_min=0&pool_max=3&connect_timeout=4&migrate=false"
        "&application_name=oncely_url_test&sslmode=disable"
    )
    store = oncely.open(url)
    assert isinstance(store, PostgresStore)
    assert "s3cret" not in store.url and "***" in store.url and "s3cret" not in repr(store)
    assert store.table == f"public.{table}"
    with pytest.raises(oncely.SchemaMissing, match="oncely migrate"):
        store.get("c", "k")  # migrate=false was read
    assert store.migrate() == 1
    assert store.get("c", "k") is None
    names = _sql("SELECT application_name FROM pg_stat_activity")
    assert ("oncely_url_test",) in names  # a libpq parameter reached the server
    store.close()
    assert isinstance(oncely.open_async(url), AsyncPostgresStore)


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("postgresql://u@h/db?tabel=x", "unknown option 'tabel'"),
        ("postgresql://u@h/db?password=pw&tabel=x", "unknown option 'tabel'"),
        ("postgresql://u:pw@h/db?pool_max=0", "pool_max"),
        ("postgresql://u@h/db?pool_min=5&pool_max=2", "pool_min"),
        ("postgresql://u@h/db?connect_timeout=soon", "connect_timeout"),
        ("postgresql://u@h/db?migrate=perhaps", "migrate"),
        ("postgresql://u@h:99999/db", "not a valid URL"),
    ],
)
def test_bad_urls_are_refused_without_the_password(url: str, problem: str) -> None:
    with pytest.raises(oncely.ConfigurationError, match=problem) as raised:
        oncely.open(url)
    assert "pw" not in str(raised.value)


def test_passwords_never_show(table: str) -> None:
    shown = [
        PostgresStore(dsn, table=table).url
        for dsn in (
            "postgresql://postgres:topsecret@127.0.0.1/test",
            "postgresql://postgres@127.0.0.1/test?password=topsecret",
            "host=127.0.0.1 dbname=test user=postgres password=topsecret",
        )
    ]
    assert all("topsecret" not in url and "***" in url for url in shown), shown


@pytest.mark.parametrize("bad", ["inbox; DROP TABLE x", "a-b", "", "x" * 64, "1abc", '"q"'])
def test_schema_and_table_names_are_checked(bad: str) -> None:
    with pytest.raises(oncely.InvalidIdentifier):
        PostgresStore(POSTGRES_DSN, table=bad)
    with pytest.raises(oncely.InvalidIdentifier):
        PostgresStore(POSTGRES_DSN, schema=bad)


def test_a_schema_of_its_own_and_names_used_as_given() -> None:
    schema = f"oncely_s_{uuid.uuid4().hex[:8]}"
    try:
        store = PostgresStore(POSTGRES_DSN, schema=schema, table="Order")  # a keyword, mixed case
        inbox = oncely.Inbox(store, consumer="c")
        assert inbox.handle("k", 1, lambda p: p).outcome is Outcome.PROCESSED
        assert _sql(f'SELECT count(*) FROM "{schema}"."Order"') == [(1,)]
        assert _sql(f'SELECT value FROM "{schema}"."Order_meta"') == [("1",)]
        store.close()
    finally:
        _sql(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def test_r13_schema_created_on_first_use_with_no_index_but_the_key(
    store: PostgresStore, table: str
) -> None:
    assert store.get("c", "k") is None
    indexes = _sql("SELECT indexname FROM pg_indexes WHERE tablename = %s", table)
    assert indexes == [(f"{table}_pkey",)]  # no index on expires_ms: updates stay HOT
    collations = _sql(
        "SELECT column_name, collation_name FROM information_schema.columns "
        "WHERE table_name = %s AND column_name IN ('consumer', 'key') ORDER BY 1",
        table,
    )
    assert collations == [("consumer", "C"), ("key", "C")]
    assert store.schema_version() == 1


def test_migrations_racing_in_many_threads_all_succeed(table: str) -> None:
    stores = [PostgresStore(POSTGRES_DSN, table=table, pool_max=1) for _ in range(6)]
    start = threading.Barrier(len(stores))
    versions: list[object] = []

    def migrate(s: PostgresStore) -> None:
        start.wait()
        try:
            versions.append(s.migrate())
        except Exception as exc:
            versions.append(exc)

    threads = [threading.Thread(target=migrate, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert versions == [1] * len(stores)
    for s in stores:
        s.close()


def test_a_newer_schema_is_refused(store: PostgresStore, table: str) -> None:
    store.migrate()
    _sql(f"UPDATE {table}_meta SET value = '9'")
    newer = PostgresStore(POSTGRES_DSN, table=table)
    with pytest.raises(oncely.SchemaTooNew, match="version 9"):
        newer.get("c", "k")
    with pytest.raises(oncely.SchemaTooNew):
        newer.migrate()
    newer.close()


# ------------------------------------------------------------------ errors


def test_a_closed_port_is_store_unavailable() -> None:
    store = PostgresStore("postgresql://postgres@127.0.0.1:1/test", table="t")
    with pytest.raises(oncely.StoreUnavailable, match="refused") as raised:
        store.get("c", "k")
    assert not isinstance(raised.value, psycopg.Error)
    inbox = oncely.Inbox(store, consumer="c")
    with pytest.raises(oncely.StoreUnavailable):
        inbox.handle("k", 1, lambda p: p)


async def test_a_closed_port_is_store_unavailable_async() -> None:
    store = AsyncPostgresStore("postgresql://postgres@127.0.0.1:1/test", table="t")
    with pytest.raises(oncely.StoreUnavailable, match="refused"):
        await store.claim(
            "c", "k", fingerprint=None, token="t", lease_ms=1, keep_ms=1, takeover=False
        )
    await store.aclose()


def test_a_wrong_database_is_a_store_error_not_a_retry() -> None:
    store = PostgresStore("postgresql://postgres@127.0.0.1:5432/no_such_db_x", table="t")
    with pytest.raises(oncely.StoreError, match="does not exist") as raised:
        store.get("c", "k")
    assert not isinstance(raised.value, oncely.StoreUnavailable)


def test_a_dropped_table_is_schema_missing(store: PostgresStore, table: str) -> None:
    _claim(store)
    drop_tables(table)
    with pytest.raises(oncely.SchemaMissing, match="oncely migrate"):
        _claim(store)
    store.migrate()
    assert _claim(store).status is ClaimStatus.NEW


def test_a_key_too_long_for_the_index_is_refused_before_the_statement(
    store: PostgresStore,
) -> None:
    inbox = oncely.Inbox(store, consumer="c", limits=oncely.Limits(max_key_bytes=4096))
    with psycopg.connect(POSTGRES_DSN) as conn:
        conn.execute("SELECT 1")
        tags: list[str] = []
        with _traced(conn, tags), pytest.raises(oncely.StoreError, match="hash_long_keys"):
            inbox.handle_in_transaction("k" * 3000, 1, lambda tx, p: None, tx=conn)
        assert tags == []  # not even the savepoint: it waits for the claim, which never went
        assert conn.execute("SELECT 2").fetchone() == (2,)  # the transaction is intact
    with pytest.raises(oncely.StoreError, match="index entry"):
        store.claim_many("c", [ClaimRequest("k" * 3000, None, "t")], **_TWO_PHASE)
    hashing = oncely.Inbox(
        store, consumer="c", limits=oncely.Limits(max_key_bytes=2048, hash_long_keys=True)
    )
    assert hashing.handle("k" * 3000, 1, lambda p: p).outcome is Outcome.PROCESSED


def test_a_closed_store_refuses_work(store: PostgresStore) -> None:
    store.migrate()
    store.close()
    with pytest.raises(oncely.StoreError, match="closed"):
        store.get("c", "k")


def test_a_caller_pool_is_used_as_it_is_and_left_open(table: str) -> None:
    """A pool of yours: autocommit off and dict rows by default; oncely switches autocommit
    on for its own statements only, reads tuples, and never closes the pool."""
    pool = ConnectionPool(
        POSTGRES_DSN,
        min_size=1,
        max_size=2,
        kwargs={"row_factory": psycopg.rows.dict_row},
        open=True,
    )
    try:
        store = PostgresStore(pool, table=table)
        inbox = oncely.Inbox(store, consumer="c")
        assert inbox.handle("k", 1, lambda p: "r").outcome is Outcome.PROCESSED
        assert inbox.handle("k", 1, lambda p: "r").value == "r"
        store.close()
        with pool.connection() as conn:
            assert conn.autocommit is False
            assert conn.execute(f"SELECT count(*) AS n FROM {table}").fetchone() == {"n": 1}
    finally:
        pool.close()


def test_r13_server_clock_when_no_clock_is_given(store: PostgresStore) -> None:
    store.migrate()
    before = _sql("SELECT floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint")[0][0]
    claim = _claim(store)
    after = _sql("SELECT floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint")[0][0]
    assert before <= claim.now_ms <= after
    assert claim.record.created_ms == claim.now_ms
    assert claim.record.lease_until_ms == claim.now_ms + LEASE_MS
    again = _claim(store, token="t2")
    assert again.status is ClaimStatus.EXISTING and again.now_ms >= claim.now_ms


# ------------------------------------------------------------------ the snapshot trap (R8)


class _Abort(Exception):
    pass


def _wait_for_lock_wait(table: str) -> None:
    """Return once some session waits on a lock in a statement on ``table`` (fail after 10 s:
    without the wait the test would prove nothing)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        rows = _sql(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
            "AND query LIKE %s",
            f"%{table}%",
        )
        if rows[0][0]:
            return
        time.sleep(0.01)
    raise AssertionError("the second claim never waited for the first one's transaction")


@pytest.mark.parametrize("first", ["commits", "rolls back"])
@pytest.mark.parametrize("second", ["claim", "claim_in"])
def test_r8_a_claim_waits_for_an_uncommitted_claim_and_sees_how_it_ends(
    store: PostgresStore, table: str, first: str, second: str
) -> None:
    """Connection A inserts the marker in an open transaction; connection B claims the same
    key from another thread and blocks on it. A commits: B answers EXISTING with A's record
    (the READ COMMITTED trap: B's first statement sees no row at all, so the store asks
    again). A rolls back: B's insert goes ahead (NEW)."""
    store.migrate()
    answers: dict[str, Any] = {}

    def claim_b() -> None:
        try:
            if second == "claim":
                answers["b"] = _claim(store, token="B")
            else:
                with store.transaction() as tx:
                    answers["b"] = store.claim_in(
                        tx, "c", "k", fingerprint="f", token="B", keep_ms=KEEP_MS, takeover=True
                    )
        except Exception as exc:
            answers["b"] = exc

    b = threading.Thread(target=claim_b)
    ending = pytest.raises(_Abort) if first == "rolls back" else _nothing()
    with ending, store.transaction() as a:
        won = store.claim_in(
            a, "c", "k", fingerprint="f", token="A", keep_ms=KEEP_MS, takeover=True
        )
        assert won.status is ClaimStatus.NEW
        b.start()
        _wait_for_lock_wait(table)
        if first == "rolls back":
            raise _Abort
    b.join(10)
    got = answers["b"]
    assert isinstance(got, oncely.Claim), got
    record = store.get("c", "k")
    if first == "commits":
        assert got.status is ClaimStatus.EXISTING and got.record == won.record == record
    else:
        assert got.status is ClaimStatus.NEW and got.record.token == "B" and got.record == record


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def test_r8_the_trap_is_real_one_claim_statement_alone_returns_nothing(
    store: PostgresStore, table: str
) -> None:
    """Why the store looks again: the claim statement that waited for a concurrent insert
    which then committed returns no row (its snapshot predates the commit)."""
    store.migrate()
    dialect = PostgresDialect("public", table)
    params = {
        "now": None, "consumer": "c", "key": "k", "status": "in_progress", "fingerprint": None,
        "token": "B", "lease": LEASE_MS, "span": KEEP_MS, "error": None,
    }  # fmt: skip
    rows: list[Any] = []

    def claim_b() -> None:
        with psycopg.connect(POSTGRES_DSN, autocommit=True) as conn:
            rows.append(fetchall(conn, dialect.claim, params))

    b = threading.Thread(target=claim_b)
    with store.transaction() as a:
        store.claim_in(a, "c", "k", fingerprint=None, token="A", keep_ms=KEEP_MS, takeover=False)
        b.start()
        _wait_for_lock_wait(table)
    b.join(10)
    assert rows == [[]]
    assert _claim(store, token="B2").record.token == "A"  # the store's claim looks again


async def test_r8_async_claim_waits_for_an_uncommitted_claim(table: str) -> None:
    store = AsyncPostgresStore(POSTGRES_DSN, table=table, pool_max=4)
    await store.migrate()
    async with store.transaction() as a:
        won = await store.claim_in(
            a, "c", "k", fingerprint=None, token="A", keep_ms=KEEP_MS, takeover=False
        )
        pending = asyncio.ensure_future(_claim_async(store))
        await asyncio.to_thread(_wait_for_lock_wait, table)
    got = await asyncio.wait_for(pending, 10)
    assert got.status is ClaimStatus.EXISTING and got.record == won.record
    await store.aclose()


async def _claim_async(store: AsyncPostgresStore) -> oncely.Claim:
    return await store.claim(
        "c", "k", fingerprint=None, token="B", lease_ms=LEASE_MS, keep_ms=KEEP_MS, takeover=True
    )


def test_r8_threads_sharing_one_store_race_one_winner_per_key(store: PostgresStore) -> None:
    store.migrate()
    keys = [f"k{i}" for i in range(200)]
    start = threading.Barrier(8)
    won: Counter[str] = Counter()

    def race(n: int) -> None:
        order = list(keys)
        random.Random(n).shuffle(order)
        start.wait()
        for key in order:
            if _claim(store, key, token=f"t{n}-{key}").won:
                won[key] += 1

    threads = [threading.Thread(target=race, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert won == Counter(dict.fromkeys(keys, 1))


async def test_r8_tasks_sharing_one_async_store_race_one_winner_per_key(table: str) -> None:
    store = AsyncPostgresStore(POSTGRES_DSN, table=table, pool_max=4)
    await store.migrate()
    keys = [f"k{i}" for i in range(200)]

    async def race(n: int) -> list[str]:
        order = list(keys)
        random.Random(n).shuffle(order)
        won = []
        for key in order:
            claim = await store.claim("c", key, fingerprint=None, token=f"t{n}-{key}", **_TWO_PHASE)
            if claim.won:
                won.append(key)
        return won

    results = await asyncio.gather(*(race(n) for n in range(8)))
    assert Counter(k for won in results for k in won) == Counter(dict.fromkeys(keys, 1))
    await store.aclose()


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


# ------------------------------------------------------------------ round trips


@contextmanager
def _traced(conn: Any, tags: list[str] | None = None) -> Iterator[dict[str, int]]:
    """Count the round trips (ReadyForQuery messages) and statements libpq exchanges on
    ``conn`` inside the block, and the waits: each time the client, having sent something,
    reads the server's answer (a pipeline that flushed and waited twice before its Sync
    would be one round trip by ReadyForQuery, two by waits). ``tags`` collects the server's
    command tags (``SAVEPOINT``, ``RELEASE``, ``INSERT 0 1`` ...)."""
    counts: dict[str, int] = {}
    fd, path = tempfile.mkstemp(prefix="oncely-trace-")
    conn.pgconn.trace(fd)
    conn.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)
    try:
        yield counts
    finally:
        conn.pgconn.untrace()
        os.close(fd)
        lines = Path(path).read_text().splitlines()
        os.unlink(path)
        fields = [line.split("\t") for line in lines if line[:2] in ("F\t", "B\t")]
        counts["round_trips"] = sum(1 for f in fields if f[0] == "B" and f[2] == "ReadyForQuery")
        counts["statements"] = sum(
            1 for f in fields if f[0] == "F" and f[2] in ("Query", "Execute")
        )
        counts["waits"] = sum(
            1 for a, b in itertools.pairwise(fields) if a[0] == "F" and b[0] == "B"
        )
        if tags is not None:
            tags += [f[3].strip().strip('"') for f in fields if f[2] == "CommandComplete"]


def test_round_trips_per_operation(table: str) -> None:
    """A new key and a duplicate cost one round trip each; the transactional mode adds one
    round trip (the claim) to the transaction when no result is stored, two with a result;
    joined to a caller's transaction with the default savepoint it still adds one: the
    SAVEPOINT goes out with the claim in one pipeline, and is not released on success."""
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
        assert tx_none["round_trips"] - bare["round_trips"] == 1  # the claim, nothing else
        assert tx_result["round_trips"] - bare["round_trips"] == 2  # + the result UPDATE
        assert tx_dup["round_trips"] == bare["round_trips"]  # BEGIN, claim, COMMIT
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
    from oncely._sync.postgres_tx import OPEN_SAVEPOINTS

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
            assert first["round_trips"] == 2 + messages * 2 + extra + 4  # + the failing one
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


# ------------------------------------------------------------------ batch claims


def _batches_match_the_model(store: Any, clock: oncely.FakeClock, seed: int) -> None:
    """Records in every state (live, stale, completed, failed, expired, absent), then batch
    claims with keys repeated, fingerprints that agree or not, takeover on and off: every
    answer, and then every record, equals the reference model's (the claims made one by one
    at one clock reading)."""
    rng = random.Random(seed)
    model = RecordTable()
    keys = [f"k{i}" for i in range(20)] + ['q"uo\\te', "{a,b}", "NULL", "", "\U0001f600"]
    number = iter(range(1_000_000))

    def event(key: str, lease: int, keep: int, takeover: bool) -> ClaimEvent:
        fp = rng.choice([None, "f", "g"])
        return ClaimEvent("c", key, fp, f"t{next(number)}", lease, keep, takeover)

    for _ in range(12):
        for key in rng.sample(keys, 8):
            ev = event(key, rng.choice([1_000, LEASE_MS]), rng.choice([2_000, KEEP_MS]), True)
            got = store.claim(
                "c", key, fingerprint=ev.fingerprint, token=ev.token, lease_ms=ev.lease_ms,
                keep_ms=ev.keep_ms, takeover=True,
            )  # fmt: skip
            assert got == model.claim(ev, clock.now_ms())
            if got.won and rng.random() < 0.5:
                keep = rng.choice([2_000, KEEP_MS])
                if rng.random() < 0.5:
                    done = CompleteEvent(ev.token, b"r", keep)
                    assert store.complete(
                        "c", key, token=ev.token, result=b"r", keep_ms=keep
                    ) == model.complete("c", key, done, clock.now_ms())
                else:
                    failed = FailEvent(ev.token, "e", keep)
                    assert store.fail(
                        "c", key, token=ev.token, error="e", keep_ms=keep
                    ) == model.fail("c", key, failed, clock.now_ms())
        clock.advance(timedelta(milliseconds=rng.choice([0, 500, 1_500, 2_500, LEASE_MS])))
        takeover = rng.random() < 0.7
        batch = [event(rng.choice(keys), LEASE_MS, KEEP_MS, takeover) for _ in range(25)]
        got_many = store.claim_many(
            "c", [ClaimRequest(e.key, e.fingerprint, e.token) for e in batch],
            lease_ms=LEASE_MS, keep_ms=KEEP_MS, takeover=takeover,
        )  # fmt: skip
        assert got_many == model.claim_many(batch, clock.now_ms())
        clock.advance(timedelta(milliseconds=rng.choice([0, 700])))
    now = clock.now_ms()
    assert [store.get("c", k) for k in keys] == [model.get("c", k, now) for k in keys]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_r8_batch_claims_match_the_model(table: str, seed: int) -> None:
    clock = oncely.FakeClock()
    store = PostgresStore(POSTGRES_DSN, table=table, pool_max=2, clock=clock)
    try:
        _batches_match_the_model(store, clock, seed)
    finally:
        store.close()


def test_r8_a_batch_of_new_keys_answers_the_rows_it_wrote(store: PostgresStore) -> None:
    """New keys are not read back: the answers are built from what was sent and the server's
    clock reading, and must equal the rows, whatever the keys hold (quotes, backslashes,
    braces, commas, empty, NULL as text, 4-byte characters) and with or without fingerprints."""
    odd = ['q"uo\\te', "{a,b}", "NULL", "", " sp ", "\U0001f600", "a\\", '"', "k,1"]
    requests = [
        ClaimRequest(key, None if i % 3 == 0 else f'fp"{i}\\', f"t{i}")
        for i, key in enumerate(odd + [f"plain-{i}" for i in range(40)])
    ]
    requests.append(ClaimRequest("plain-3", "other", "t-again"))  # repeated: the first wins
    before = _server_ms()
    claims = store.claim_many("c", requests, **_TWO_PHASE)
    after = _server_ms()
    assert [c.status for c in claims] == [ClaimStatus.NEW] * (len(requests) - 1) + [
        ClaimStatus.EXISTING
    ]
    assert claims[-1].record == claims[len(odd) + 3].record
    for claim in claims:
        assert claim.record == store.get("c", claim.record.key)
        assert before <= claim.now_ms == claim.record.created_ms <= after
        assert claim.record.lease_until_ms == claim.now_ms + LEASE_MS


def _server_ms() -> int:
    return int(_sql("SELECT floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint")[0][0])


@pytest.mark.parametrize("cache", ["auto", "force_generic_plan"])
def test_r8_a_batch_reads_existing_rows_by_primary_key_only(table: str, cache: str) -> None:
    """The batch statement's read of existing rows is a primary-key lookup per key, even on a
    table whose statistics say it is small (a fresh table, before autovacuum's ANALYZE): a
    join would be planned as a scan of every row of the consumer, whose cost grows with the
    table."""
    store = PostgresStore(POSTGRES_DSN, table=table)
    store.migrate()
    store.close()
    _sql(f"ALTER TABLE {table} SET (autovacuum_enabled = false)")
    _sql(
        f"INSERT INTO {table} SELECT 'c', 'old-' || g, 'completed', NULL, 't' || g, 1, 0, 0, "
        f"0, 9000000000000, NULL, NULL FROM generate_series(1, 20000) g"
    )
    d = PostgresDialect("public", table)
    params = {
        "now": None,
        "consumer": "c",
        "keys": text_array([f"k{i}" for i in range(100)]),
        "fingerprints": text_array([None] * 100),
        "tokens": text_array([f"t-{i}" for i in range(100)]),
        "lease": LEASE_MS,
        "span": KEEP_MS,
    }
    with psycopg.connect(POSTGRES_DSN) as conn:
        conn.execute(f"SET plan_cache_mode = {cache}".encode())
        plan = "\n".join(
            row[0] for row in conn.execute(b"EXPLAIN " + d.claim_many, params, prepare=True)
        )
        conn.rollback()
    scans = [line.strip() for line in plan.splitlines() if f" on {table}" in line]
    assert scans and all(s.startswith("->  Index Scan") or "Insert on" in s for s in scans), plan


# ------------------------------------------------------------------ pools and outages


def test_the_pool_recovers_after_its_connections_are_killed(table: str) -> None:
    """Every server connection of the store is terminated (what a restart does to them): the
    next calls raise StoreUnavailable at most, never a psycopg error, and the pool heals."""
    app = f"oncely_kill_{uuid.uuid4().hex[:8]}"
    store = oncely.open(
        f"{POSTGRES_DSN}?table={table}&pool_min=3&pool_max=3&application_name={app}"
    )
    inbox = oncely.Inbox(store, consumer="c")
    for i in range(20):  # let the pool open all three connections
        inbox.handle(f"before-{i}", 1, lambda p: p)
    killed = _sql(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s", app
    )
    assert killed and all(ok for (ok,) in killed)
    failures = 0
    for i in range(40):
        try:
            handled = inbox.handle(f"after-{i}", 1, lambda p: p)
        except oncely.StoreUnavailable:
            failures += 1
            time.sleep(0.05)
            continue
        assert handled.outcome is Outcome.PROCESSED
    assert failures <= 3, failures  # at most once per dead connection
    assert inbox.handle("final", 1, lambda p: p).outcome is Outcome.PROCESSED
    store.close()


def test_a_forked_child_opens_its_own_pool(store: PostgresStore) -> None:
    inbox = oncely.Inbox(store, consumer="c")
    assert inbox.handle("from-parent", 1, lambda p: 1).outcome is Outcome.PROCESSED
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            outcomes = [
                inbox.handle("from-parent", 1, lambda p: 2).outcome.value,
                inbox.handle("child-key", 1, lambda p: 3).outcome.value,
            ]
            os.write(write, json.dumps(outcomes).encode())
        finally:
            os._exit(0)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    with os.fdopen(read) as pipe:
        assert json.loads(pipe.read()) == ["duplicate", "processed"]
    assert os.waitstatus_to_exitcode(status) == 0
    # The parent's connections were never touched by the child: they still work.
    assert inbox.handle("child-key", 1, lambda p: 4).outcome is Outcome.DUPLICATE


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_a_store_nobody_closed_does_not_keep_the_process_alive(table: str, flavour: str) -> None:
    if flavour == "sync":
        script = (
            "import oncely\n"
            f"store = oncely.open({POSTGRES_DSN + '?table=' + table!r})\n"
            "print(oncely.Inbox(store, consumer='c').handle('k', 1, lambda p: p).outcome)\n"
        )
    else:
        script = (
            "import asyncio, oncely\n"
            "async def main():\n"
            f"    store = oncely.open_async({POSTGRES_DSN + '?table=' + table!r})\n"
            "    async def handler(payload): return None\n"
            "    inbox = oncely.AsyncInbox(store, consumer='c')\n"
            "    print((await inbox.handle('k', 1, handler)).outcome)\n"
            "asyncio.run(main())\n"
        )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "processed"


def test_an_unclosed_async_store_left_while_its_pool_connects_lets_asyncio_run_end(
    table: str,
) -> None:
    # psycopg_pool's workers swallow a cancellation that arrives while they connect; the main
    # coroutine returns here with eight handles still waiting for connections the pool is
    # opening, so asyncio.run's final cancel lands in the middle of those connects. Without
    # the store's pool watch this hung every time.
    script = (
        "import asyncio, oncely\n"
        "async def main():\n"
        f"    store = oncely.open_async({POSTGRES_DSN + '?pool_max=8&table=' + table!r})\n"
        "    async def handler(payload): return None\n"
        "    inbox = oncely.AsyncInbox(store, consumer='c')\n"
        "    print((await inbox.handle('k', 1, handler)).outcome)\n"
        "    pending = [asyncio.create_task(inbox.handle(f'k{i}', 1, handler)) for i in range(8)]\n"
        "    await asyncio.sleep(0.005)\n"
        "asyncio.run(main())\n"
    )
    for _ in range(3):
        done = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
        )
        assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(("flavour", "examples"), [("sync", 40), ("async", 15)])
def test_r8_r10_store_matches_the_model(flavour: str, examples: int) -> None:
    """The hypothesis state machine of the contract suite, against this store (a fresh table
    per example in a schema of its own): every answer equals the reference model's."""
    schema = f"oncely_m_{uuid.uuid4().hex[:8]}"

    def factory(_dir: Path, clock: oncely.FakeClock) -> object:
        name = f"m_{uuid.uuid4().hex[:12]}"
        if flavour == "sync":
            return PostgresStore(POSTGRES_DSN, schema=schema, table=name, pool_max=2, clock=clock)
        return Blocking(
            AsyncPostgresStore(POSTGRES_DSN, schema=schema, table=name, pool_max=2, clock=clock)
        )

    try:
        run_state_machine_as_test(
            _machine(factory, True),
            settings=settings(max_examples=examples, stateful_step_count=30, deadline=None),
        )
    finally:
        _sql(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


# ------------------------------------------------------------------ the outage (slow)


def _cluster() -> str:
    return sorted(os.listdir("/etc/postgresql"))[-1]


def _pg_ctl(action: str) -> None:
    subprocess.run(
        ["pg_ctlcluster", "--skip-systemctl-redirect", "-m", "fast", _cluster(), "main", action],
        capture_output=True,
        timeout=60,
        check=False,
    )


def _wait_until_ready(seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        ready = subprocess.run(["pg_isready", "-h", "127.0.0.1"], capture_output=True, check=False)
        if ready.returncode == 0:
            return
        time.sleep(0.2)
    raise AssertionError("PostgreSQL did not come back")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_r7_server_restart_mid_run_loses_nothing_and_doubles_nothing(table: str) -> None:
    """PostgreSQL stops (fast shutdown: every session is cut) and starts again while three
    threads process messages in the transactional mode, each message delivered twice. Calls
    during the outage raise StoreUnavailable (never a psycopg error); every message is
    redelivered until acknowledged; afterwards every effect is in the ledger exactly once."""
    if not os.path.isdir("/etc/postgresql") or os.geteuid() != 0:
        pytest.skip("needs a local Debian PostgreSQL cluster and root to restart it")
    keys = [f"order-{i:03d}" for i in range(150)]
    ledger = _ledger(table)
    store = PostgresStore(
        POSTGRES_DSN, table=table, pool_max=4, connect_timeout=timedelta(seconds=1)
    )
    store.migrate()
    inbox = oncely.Inbox(store, consumer="outage")
    deliveries = [k for k in keys for _ in range(2)]
    random.Random(7).shuffle(deliveries)
    pending = list(deliveries)
    lock = threading.Lock()
    tally: Counter[str] = Counter()
    processed: list[str] = []
    strange: list[str] = []
    reasons: Counter[str] = Counter()

    def book(tx: psycopg.Connection[Any], payload: dict[str, str]) -> None:
        tx.execute(f"INSERT INTO {ledger} (key) VALUES (%s)".encode(), (payload["key"],))
        time.sleep(0.002)  # keep transactions open long enough to be cut mid-flight

    def consume() -> None:
        while True:
            with lock:
                if not pending:
                    return
                key = pending.pop()
            try:
                handled = inbox.handle_in_transaction(key, {"key": key}, book)
            except oncely.StoreUnavailable as exc:
                tally["unavailable"] += 1
                reasons[str(exc).split(":")[0] + ": " + str(exc).split(": ", 2)[-1][:50]] += 1
                with lock:
                    pending.insert(0, key)  # redelivered later
                time.sleep(0.05)
                continue
            except Exception as exc:  # a psycopg error escaping would land here
                strange.append(f"{key}: {type(exc).__module__}.{type(exc).__name__}: {exc}")
                with lock:
                    pending.insert(0, key)
                continue
            tally[handled.outcome.value] += 1
            if handled.outcome is Outcome.PROCESSED:
                processed.append(key)
            elif handled.outcome is not Outcome.DUPLICATE:
                # The handler's own write failed when the connection dropped: retried.
                with lock:
                    pending.insert(0, key)

    workers = [threading.Thread(target=consume) for _ in range(3)]
    for w in workers:
        w.start()
    try:
        while len(pending) > len(deliveries) * 2 // 3:
            time.sleep(0.01)
        _pg_ctl("stop")
        time.sleep(1.5)  # connections are refused for a while
    finally:
        _pg_ctl("start")
        _wait_until_ready()
    for w in workers:
        w.join(60)
    store.close()
    print(f"\n[outage] {dict(tally)} {dict(reasons)}")
    assert not strange, strange
    assert not pending, pending
    assert tally["unavailable"] > 0, "the outage was never felt: the test proved nothing"
    counts = _ledger_counts(ledger)
    assert {k: n for k, n in counts.items() if n != 1} == {}
    assert set(counts) == set(keys)
    check = PostgresStore(POSTGRES_DSN, table=table)
    for key in set(processed) | set(keys):
        record = check.get("outage", key)
        assert record is not None and record.status is Status.COMPLETED, key
    check.close()


# ------------------------------------------------------------------ real processes (slow)


def _race_worker(table: str, worker: int, keys: int, api: str, out: str, start_line: Any) -> None:
    order = list(range(keys))
    random.Random(worker).shuffle(order)
    answers: dict[str, tuple[str, str]] = {}

    def note(key: str, claim: oncely.Claim) -> None:
        answers[key] = (claim.status.value, claim.record.token)

    common = {"lease_ms": LEASE_MS, "keep_ms": KEEP_MS, "takeover": False}
    if api == "async":

        async def run() -> None:
            store = AsyncPostgresStore(POSTGRES_DSN, table=table, pool_max=2, migrate=False)
            await store.get("race", "warm-up")
            start_line.wait(60)
            for i in order:
                key = f"k{i}"
                note(
                    key,
                    await store.claim(
                        "race", key, fingerprint=None, token=f"w{worker}-{i}", **common
                    ),
                )  # type: ignore[arg-type]
            await store.aclose()

        asyncio.run(run())
    else:
        store = PostgresStore(POSTGRES_DSN, table=table, pool_max=2, migrate=False)
        store.get("race", "warm-up")
        start_line.wait(60)
        if api == "batch":
            for start in range(0, keys, 50):
                chunk = [
                    ClaimRequest(f"k{i}", None, f"w{worker}-{i}") for i in order[start : start + 50]
                ]
                for request, claim in zip(
                    chunk,
                    store.claim_many("race", chunk, **common),
                    strict=True,  # type: ignore[arg-type]
                ):
                    note(request.key, claim)
        else:
            for i in order:
                key = f"k{i}"
                note(
                    key,
                    store.claim("race", key, fingerprint=None, token=f"w{worker}-{i}", **common),
                )  # type: ignore[arg-type]
        store.close()
    Path(out).write_text(json.dumps(answers))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_r8_eight_processes_race_for_1000_keys_one_winner_each(table: str, tmp_path: Path) -> None:
    PostgresStore(POSTGRES_DSN, table=table).migrate()
    procs = Processes()
    apis = ["sync", "async", "batch", "sync", "async", "batch", "sync", "async"]
    start_line = procs.ctx.Barrier(len(apis))
    outs = [str(tmp_path / f"racer{n}.json") for n in range(len(apis))]
    try:
        started = [
            procs.start(_race_worker, table, n, 1000, api, outs[n], start_line, name=f"racer{n}")
            for n, api in enumerate(apis)
        ]
        for p in started:
            p.join(100)
        codes = [p.exitcode for p in started]
    finally:
        procs.reap()
    assert codes == [0] * len(apis)
    answers = [json.loads(Path(o).read_text()) for o in outs]
    stored = dict(_sql(f"SELECT key, token FROM {table} WHERE consumer = 'race'"))
    winners: Counter[str] = Counter()
    for by_key in answers:
        assert len(by_key) == 1000
        for key, (status, token) in by_key.items():
            assert token == stored[key], (key, status, token, stored[key])
            if status == "new":
                winners[key] += 1
    assert set(winners) == set(stored) and len(stored) == 1000
    assert set(winners.values()) == {1}  # exactly one winner per key
    # Each racer lost some keys: the claims really overlapped.
    assert all(sum(s == "existing" for s, _ in a.values()) > 0 for a in answers)


_KILL_POINTS = ("before the write", "after the write", "after the commit")


def _crash_worker(table: str, keys: list[str], plan: tuple[str, int] | None, out: str) -> None:
    """Handle ``keys`` in the transactional mode; with a ``plan`` (point, n), SIGKILL itself
    the n-th time it reaches that point. Acknowledgements go to ``out``, one ``os.write`` on
    an ``O_APPEND`` file each: a line lands whole or not at all."""
    store = PostgresStore(POSTGRES_DSN, table=table, pool_max=1, migrate=False)
    inbox = oncely.Inbox(store, consumer="crash")
    log = os.open(out, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    reached: Counter[str] = Counter()
    name = os.path.basename(out)

    def point(where: str, key: str) -> None:
        reached[where] += 1
        if plan is not None and plan == (where, reached[where]):
            os.write(log, f"kill {where}|{key}\n".encode())
            os.kill(os.getpid(), signal.SIGKILL)

    def book(tx: psycopg.Connection[Any], payload: dict[str, str]) -> None:
        point("before the write", payload["key"])
        tx.execute(
            f"INSERT INTO {table}_ledger (key, worker) VALUES (%s, %s)".encode(),
            (payload["key"], name),
        )
        point("after the write", payload["key"])

    for key in keys:
        try:
            handled = inbox.handle_in_transaction(key, {"key": key}, book)
        except oncely.StoreUnavailable:
            continue  # not acknowledged: redelivered
        if handled.outcome is Outcome.PROCESSED:
            point("after the commit", key)  # its own effect committed, not acknowledged yet
        if handled.outcome in (Outcome.PROCESSED, Outcome.DUPLICATE):
            os.write(log, f"ack {handled.outcome.value}|{key}\n".encode())
    store.close()
    os.close(log)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_r7_sigkilled_workers_apply_every_effect_exactly_once(table: str, tmp_path: Path) -> None:
    """Four workers in the transactional mode get every unacknowledged message (concurrent
    duplicates). In the first rounds three of them SIGKILL themselves, one before its write,
    one after it (before the commit), one after the commit (before the acknowledgement), and
    the parent SIGKILLs the fourth at a random moment; every message not acknowledged goes to
    a fresh fleet until all are. The ledger has no unique key: each effect must be there
    exactly once, and every record completed at its first attempt."""
    keys = [f"order-{i:03d}" for i in range(200)]
    _ledger(table)
    PostgresStore(POSTGRES_DSN, table=table).migrate()
    seed = int(os.environ.get("ONCELY_CHAOS_SEED", random.randrange(2**32)))
    rng = random.Random(seed)
    pending = set(keys)
    kills: list[tuple[str, str, str]] = []  # (point, key, worker)
    outcomes: Counter[str] = Counter()
    parent_kills = rounds = 0
    procs = Processes()
    try:
        while pending and rounds < 20:
            rounds += 1
            chaos = rounds <= 3
            logs = [str(tmp_path / f"r{rounds}-w{n}.log") for n in range(4)]
            fleet = []
            for n, out in enumerate(logs):
                order = sorted(pending)
                rng.shuffle(order)
                plan = (_KILL_POINTS[n], rng.randint(1, 12)) if chaos and n < 3 else None
                fleet.append(procs.start(_crash_worker, table, order, plan, out, name=out))
            if chaos:
                time.sleep(rng.uniform(0.05, 0.5))
                if fleet[3].is_alive():
                    os.kill(fleet[3].pid, signal.SIGKILL)  # type: ignore[arg-type]
                    parent_kills += 1
            for p in fleet:
                p.join(60)
            procs.reap()
            for out in logs:
                lines = Path(out).read_text().splitlines() if os.path.exists(out) else []
                for line in lines:
                    kind, rest = line.split(" ", 1)
                    what, key = rest.split("|")
                    if kind == "ack":
                        outcomes[what] += 1
                        pending.discard(key)
                    else:
                        kills.append((what, key, os.path.basename(out)))
    finally:
        procs.reap()
    summary = (
        f"seed={seed} rounds={rounds} kills={Counter(w for w, _, _ in kills)} "
        f"parent_kills={parent_kills} outcomes={dict(outcomes)}"
    )
    print(f"\n[crash] {summary}")
    assert not pending, f"never acknowledged: {sorted(pending)[:10]}; {summary}"
    counts = _ledger_counts(f"{table}_ledger")
    assert {k: n for k, n in counts.items() if n != 1} == {}, summary
    assert set(counts) == set(keys), summary
    assert {w for w, _, _ in kills} == set(_KILL_POINTS), summary
    assert outcomes["duplicate"] > 0, summary
    check = PostgresStore(POSTGRES_DSN, table=table)
    records = {r.key: r for r in check.scan(consumer="crash", limit=1000)}
    check.close()
    assert set(records) == set(keys), summary
    assert all(r.status is Status.COMPLETED and r.attempt == 1 for r in records.values())
    applied = dict(_sql(f"SELECT key, worker FROM {table}_ledger"))
    for where, key, worker in kills:
        if where == "after the commit":  # committed, then killed: its effect stands
            assert applied[key] == worker, (where, key, worker, applied[key], summary)
        else:  # killed inside the transaction: its write vanished, another worker's stands
            assert applied[key] != worker, (where, key, worker, summary)
