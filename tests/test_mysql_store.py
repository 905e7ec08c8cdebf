"""MariaDB / MySQL store specifics: URLs, the table layout, InnoDB's locking (R8, R9), joining a
caller's transaction (R7), failures translated, the pool after a server restart, and races and
SIGKILL crashes with real processes.

The shared behaviour (every operation, both modes, sync and async) is the contract suite,
which runs on this store through ``tests/backends/mysql.py``; here is what is particular to a
server with row locks, REPEATABLE READ snapshots and deadlocks. Each test works on tables of
its own in the server's ``test`` database (``tests.services.MYSQL_URL``).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import aiomysql
import pymysql
import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

import oncely
from oncely import ClaimStatus, Outcome, Status
from oncely._async.mysql import AsyncMySQLStore
from oncely._core.records import ClaimRequest
from oncely._core.state import ClaimEvent, CompleteEvent, FailEvent
from oncely._core.table import RecordTable
from oncely._dialects.mysql import MAX_KEY_BYTES
from oncely._drivers.mysql import parse_url, translate
from oncely._sync.mysql import MySQLStore
from oncely.errors import (
    ConfigurationError,
    InvalidIdentifier,
    KeyTooLong,
    SchemaMissing,
    SchemaTooNew,
    StoreError,
    StoreUnavailable,
    TransactionRequired,
)
from tests.backends.mysql import admin, drop_tables, sql, url
from tests.chaos.harness import Processes
from tests.chaos.workers import Broker, Log, Orphan, Tripwire, write_json
from tests.contract.test_model_stateful import Blocking, StoreMatchesModel
from tests.services import MYSQL_URL, require

LEASE_MS = 30_000
KEEP_MS = 7 * 86_400_000


def _claim(store: Any, key: str, token: str, *, consumer: str = "billing") -> oncely.Claim:
    claim: oncely.Claim = store.claim(
        consumer, key, fingerprint="f", token=token, lease_ms=LEASE_MS, keep_ms=KEEP_MS,
        takeover=False,
    )  # fmt: skip
    return claim


def _claim_in(store: Any, tx: Any, key: str, token: str) -> oncely.Claim:
    claim: oncely.Claim = store.claim_in(
        tx, "billing", key, fingerprint="f", token=token, keep_ms=KEEP_MS, takeover=False
    )
    return claim


@pytest.fixture
def server() -> None:
    require("MariaDB", MYSQL_URL, 3306)


@pytest.fixture
def table(server: None) -> Iterator[str]:
    name = f"oncely_m_{uuid.uuid4().hex[:12]}"
    try:
        yield name
    finally:
        drop_tables(name, f"{name}_ledger", f"{name}_scratch")


@pytest.fixture
def store(table: str) -> Iterator[MySQLStore]:
    made = MySQLStore.from_url(url(table))
    made.migrate()
    try:
        yield made
    finally:
        made.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_for_lock_wait(table: str) -> None:
    """Return once a transaction waits for a row lock in a statement on ``table``
    (InnoDB's own view, so no sleep guesses when the other thread is blocked). InnoDB
    refreshes that view only when it was last read over 0.1 s ago: poll slower than that."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        found = sql(
            "SELECT count(*) FROM information_schema.innodb_trx "
            "WHERE trx_state = 'LOCK WAIT' AND trx_query LIKE %s",
            (f"%{table}%",),
        )
        if found[0][0]:
            return
        time.sleep(0.12)
    raise AssertionError(f"nothing waited for a lock on {table}")


def _deadlocks() -> int:
    return int(sql("SHOW GLOBAL STATUS LIKE 'Innodb_deadlocks'")[0][1])


def _in_thread(work: Callable[[], object]) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = work()
        except BaseException as exc:
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


# --------------------------------------------------------------------------- URLs, names


def test_url_options_are_read_and_the_password_is_never_shown() -> None:
    secret = "s3cr%40t"
    text = (
        f"mysql://app:{secret}@db.example:3307/shop?table=inbox_1&pool_size=2"
        "&connect_timeout=3&lock_timeout=7&migrate=false&unix_socket=/run/mysqld.sock"
    )
    options = parse_url(text)
    s = options.settings
    assert (s.host, s.port, s.user, s.password, s.database) == (
        "db.example", 3307, "app", "s3cr@t", "shop",
    )  # fmt: skip
    assert (options.table, options.pool_size, options.migrate) == ("inbox_1", 2, False)
    assert (s.connect_timeout.total_seconds(), s.unix_socket) == (3, "/run/mysqld.sock")
    assert s.lock_timeout is not None and s.lock_timeout.total_seconds() == 7
    assert "innodb_lock_wait_timeout = 7" in s.init_command()
    store = MySQLStore.from_url(text)  # connects lazily: nothing is resolved yet
    for shown in (store.url, repr(store), repr(s)):
        assert "s3cr" not in shown
    assert store.url.startswith("mysql://app:***@db.example:3307/shop?table=inbox_1")
    store.close()


@pytest.mark.parametrize(
    ("query", "named"),
    [
        ("?colour=blue", "'colour'"),
        ("?pool_size=many", "pool_size"),
        ("?pool_size=0", "pool_size"),
        ("?migrate=perhaps", "migrate"),
        ("?connect_timeout=soon", "connect_timeout"),
    ],
)
def test_bad_url_options_are_refused_by_name(query: str, named: str) -> None:
    with pytest.raises(ConfigurationError, match=named) as refused:
        MySQLStore.from_url(f"mysql://app:hunter2@db.example/shop{query}")
    assert "hunter2" not in str(refused.value)


@pytest.mark.parametrize("text", ["mysql://app@db.example", "mysql://app@db.example/", "mysql:///"])
def test_the_url_must_name_a_database(text: str) -> None:
    with pytest.raises(ConfigurationError, match="name the database"):
        MySQLStore.from_url(text)


def test_mysql_and_mariadb_urls_open_both_twins() -> None:
    sync = oncely.open("mariadb://app@db.example/shop")
    assert isinstance(sync, MySQLStore) and sync.table == "oncely_inbox"
    sync.close()
    made = oncely.open_async("mysql://app@db.example/shop?table=t2")
    assert isinstance(made, AsyncMySQLStore) and made.table == "t2"
    asyncio.run(made.aclose())


@pytest.mark.parametrize("name", ["bad-name", "inbox; DROP TABLE x", "", "9lives", "a" * 63])
def test_table_names_are_validated(name: str) -> None:
    with pytest.raises(InvalidIdentifier):
        MySQLStore("test", table=name)


def test_a_reserved_word_is_a_usable_table_name(server: None) -> None:
    name = f"select_{uuid.uuid4().hex[:8]}"
    store = MySQLStore.from_url(url(name))
    try:
        assert _claim(store, "k", "t1").status is ClaimStatus.NEW
        assert sql(f"SELECT count(*) FROM `{name}`") == [(1,)]
    finally:
        store.close()
        drop_tables(name)


# --------------------------------------------------------------------------- schema


def test_the_table_is_innodb_with_varbinary_keys(store: MySQLStore, table: str) -> None:
    rows = sql(
        "SELECT engine, row_format FROM information_schema.tables "
        "WHERE table_schema = DATABASE() AND table_name = %s",
        (table,),
    )
    assert rows == [("InnoDB", "Dynamic")]
    columns = dict(
        sql(
            "SELECT column_name, column_type FROM information_schema.columns "
            "WHERE table_schema = DATABASE() AND table_name = %s",
            (table,),
        )
    )
    assert columns["consumer"] == "varbinary(800)"
    assert columns["key"] == f"varbinary({MAX_KEY_BYTES})"
    assert columns["created_ms"] == "bigint(20)" and columns["result"] == "longblob"
    assert sql(f"SELECT value FROM `{table}_meta` WHERE name = 'schema_version'") == [("1",)]


def test_missing_tables_are_a_clear_error_when_migration_is_off(table: str) -> None:
    store = MySQLStore.from_url(url(table, migrate="false"))
    try:
        with pytest.raises(SchemaMissing, match="oncely migrate"):
            store.get("c", "k")
        assert store.schema_version() is None
        assert store.migrate() == 1 and store.schema_version() == 1
        assert store.get("c", "k") is None
    finally:
        store.close()


def test_tables_dropped_under_a_running_store_are_reported(store: MySQLStore, table: str) -> None:
    _claim(store, "k", "t1")
    drop_tables(table)
    with pytest.raises(SchemaMissing, match="oncely migrate"):
        _claim(store, "k2", "t2")


def test_a_newer_schema_is_refused(store: MySQLStore, table: str) -> None:
    sql(f"UPDATE `{table}_meta` SET value = '9' WHERE name = 'schema_version'")
    other = MySQLStore.from_url(url(table))
    try:
        with pytest.raises(SchemaTooNew, match="version 9"):
            other.get("c", "k")
        with pytest.raises(SchemaTooNew):
            other.migrate()
    finally:
        other.close()


def test_migrations_racing_in_threads_all_succeed(table: str) -> None:
    stores = [MySQLStore.from_url(url(table)) for _ in range(6)]
    start = threading.Barrier(len(stores))

    def migrate(store: MySQLStore) -> int:
        start.wait(timeout=10)
        return store.migrate()

    runs = [_in_thread(lambda s=s: migrate(s)) for s in stores]  # type: ignore[misc]
    for thread, _ in runs:
        thread.join(30)
    assert [out.get("value", out.get("error")) for _, out in runs] == [1] * len(stores)
    assert sql(f"SELECT count(*) FROM `{table}_meta`") == [(1,)]
    for store in stores:
        store.close()


# --------------------------------------------------------------------------- keys and time


def test_r2_keys_are_exact_bytes(store: MySQLStore) -> None:
    """Case, trailing and leading spaces, accents composed or not, 4-byte characters: each its
    own key (a PAD SPACE or case-insensitive collation would merge some of them)."""
    keys = ["k", "K", "k ", " k", "\u00e9", "e\u0301", "\U0001f600", "\u00df", "ss", "a\tb"]
    for i, key in enumerate(keys):
        assert _claim(store, key, f"t{i}").status is ClaimStatus.NEW, key
    for i, key in enumerate(keys):
        record = store.get("billing", key)
        assert record is not None and (record.key, record.token) == (key, f"t{i}")
    assert [r.key for r in store.scan(consumer="billing", limit=50)] == sorted(keys)


def test_the_longest_keys_and_consumers_round_trip(store: MySQLStore) -> None:
    key = "\U0001f600" * (MAX_KEY_BYTES // 4)  # 2048 bytes of 4-byte characters
    consumer = "\U0001f600" * 200  # the longest consumer name oncely accepts
    claim = _claim(store, key, "t1", consumer=consumer)
    assert claim.status is ClaimStatus.NEW
    assert store.get(consumer, key) == claim.record
    with pytest.raises(KeyTooLong, match="hash_long_keys"):
        _claim(store, key + "x", "t2")
    inbox = oncely.Inbox(store, consumer="billing")  # Limits(max_key_bytes=512) by default
    longest = "\u00e9" * 256
    assert inbox.handle(longest, {"a": 1}, lambda p: "ok").outcome is Outcome.PROCESSED
    assert inbox.handle(longest, {"a": 1}, lambda p: "ok").outcome is Outcome.DUPLICATE


def _server_ms() -> int:
    # Another function than the store's expression, in a UTC session: a check, not a copy.
    conn = admin()
    try:
        with conn.cursor() as cursor:
            cursor.execute("SET time_zone = '+00:00'")
            cursor.execute("SELECT CAST(UNIX_TIMESTAMP(NOW(3)) * 1000 AS SIGNED)")
            return int(cursor.fetchone()[0])
    finally:
        conn.close()


def test_time_comes_from_the_server_whatever_the_session_time_zone(store: MySQLStore) -> None:
    before = _server_ms()
    claim = _claim(store, "two-phase", "t1")
    conn = admin()
    try:
        with conn.cursor() as cursor:
            cursor.execute("SET time_zone = '+05:00'")  # a caller's session in another zone
        conn.begin()
        joined = _claim_in(store, conn, "joined", "t2")
        conn.commit()
    finally:
        conn.close()
    after = _server_ms()
    for made in (claim, joined):
        assert before <= made.now_ms <= after
        assert made.record.created_ms == made.now_ms
    assert claim.record.lease_until_ms == claim.now_ms + LEASE_MS
    seen = _claim(store, "two-phase", "t3")
    assert seen.status is ClaimStatus.EXISTING and claim.now_ms <= seen.now_ms <= _server_ms()


# --------------------------------------------------------------------------- round trips


def _questions(conn: Any) -> int:
    with conn.cursor() as cursor:
        cursor.execute("SHOW SESSION STATUS LIKE 'Questions'")
        return int(cursor.fetchone()[1])


def test_r8_a_new_key_is_one_statement_and_a_duplicate_two(table: str) -> None:
    """Counted by the server (the session's ``Questions``) on the store's only connection. A
    batch of new keys is one statement too (its OK packet says every key went in); a batch
    that meets an existing key reads the rows back (two)."""
    store = MySQLStore.from_url(url(table, pool_size=1))
    store.migrate()

    def statements(call: Callable[[], object]) -> int:
        with store.transaction() as tx:
            first = _questions(tx)
        call()
        with store.transaction() as tx:
            return _questions(tx) - first

    try:
        baseline = statements(lambda: None)
        assert statements(lambda: _claim(store, "k", "t1")) - baseline == 1
        assert statements(lambda: _claim(store, "k", "t2")) - baseline == 2
        done = statements(
            lambda: store.complete("billing", "k", token="t1", result=b"r", keep_ms=KEEP_MS)
        )
        assert done - baseline == 2
        batch = [ClaimRequest(f"b{i}", None, f"bt{i}") for i in range(200)]
        many = statements(
            lambda: store.claim_many(
                "billing", batch, lease_ms=LEASE_MS, keep_ms=KEEP_MS, takeover=False
            )
        )
        assert many - baseline == 1
        mixed = [ClaimRequest("b0", None, "bt-again"), ClaimRequest("new", None, "bt-new")]
        again = statements(
            lambda: store.claim_many(
                "billing", mixed, lease_ms=LEASE_MS, keep_ms=KEEP_MS, takeover=False
            )
        )
        assert again - baseline == 2
        with store.transaction() as tx:
            before = _questions(tx)
            _claim_in(store, tx, "joined", "t3")
            assert _questions(tx) - before == 2  # the claim, and this SHOW
    finally:
        store.close()


# --------------------------------------------------------------------------- InnoDB locking


@pytest.mark.parametrize("first", ["commit", "rollback"])
@pytest.mark.parametrize("second", ["two_phase", "joined_with_an_older_snapshot"])
def test_r8_a_claim_waits_for_a_first_claimer_that_has_not_committed(
    store: MySQLStore, table: str, first: str, second: str
) -> None:
    """Connection A claims a key in an open transaction; B claims it from another thread and
    blocks on A's row lock. A commits: B finds A's marker. A rolls back: B inserts its own.

    ``joined_with_an_older_snapshot``: B is inside a transaction of its own that read the
    table before A committed. Under REPEATABLE READ a plain SELECT would still show B that
    snapshot, without A's row, although the INSERT saw it; the store's locking read does not.
    """
    a = admin()
    a.begin()
    assert _claim_in(store, a, "k", "A").status is ClaimStatus.NEW

    def claim_b() -> oncely.Claim:
        if second == "two_phase":
            return _claim(store, "k", "B")
        b = admin()
        try:
            b.begin()
            with b.cursor() as cursor:
                cursor.execute(f"SELECT count(*) FROM `{table}`")  # B's snapshot starts here
                assert cursor.fetchone() == (0,)
            claim = _claim_in(store, b, "k", "B")
            b.commit()
            return claim
        finally:
            b.close()

    thread, out = _in_thread(claim_b)
    _wait_for_lock_wait(table)
    getattr(a, first)()
    thread.join(30)
    a.close()
    assert "error" not in out, out
    claim = out["value"]
    if first == "commit":
        assert claim.status is ClaimStatus.EXISTING and claim.record.token == "A"
        assert claim.record.status is Status.COMPLETED
    else:
        assert claim.status is ClaimStatus.NEW and claim.record.token == "B"
    record = store.get("billing", "k")
    assert record is not None and record.token == claim.record.token


def test_r8_a_deadlocked_batch_claim_is_retried_transparently(
    store: MySQLStore, table: str
) -> None:
    """A real deadlock: transaction A holds key k2 and then wants k1; a batch claim of (k1, k2)
    holds k1 and waits for k2. InnoDB rolls back the lighter one, the batch (A has written
    more rows); the store runs it again, and it answers as if A had simply gone first."""
    sql(f"CREATE TABLE `{table}_ledger` (k VARCHAR(64) NOT NULL) ENGINE=InnoDB")
    deadlocks = _deadlocks()
    a = admin()
    a.begin()
    with a.cursor() as cursor:  # A's weight: rows written before the claims
        for i in range(20):
            cursor.execute(f"INSERT INTO `{table}_ledger` (k) VALUES (%s)", (f"w{i}",))
    assert _claim_in(store, a, "k2", "A2").status is ClaimStatus.NEW
    batch = [ClaimRequest("k1", "f", "B1"), ClaimRequest("k2", "f", "B2")]
    thread, out = _in_thread(
        lambda: store.claim_many(
            "billing", batch, lease_ms=LEASE_MS, keep_ms=KEEP_MS, takeover=False
        )
    )
    _wait_for_lock_wait(table)
    assert _claim_in(store, a, "k1", "A1").status is ClaimStatus.NEW  # closes the cycle
    a.commit()
    a.close()
    thread.join(30)
    assert "error" not in out, out
    claims = out["value"]
    assert [(c.status, c.record.token) for c in claims] == [
        (ClaimStatus.EXISTING, "A1"),
        (ClaimStatus.EXISTING, "A2"),
    ]
    assert _deadlocks() > deadlocks


def test_r7_a_deadlock_inside_a_joined_claim_says_the_transaction_is_gone(
    store: MySQLStore, table: str
) -> None:
    """Two callers' transactions claim k1, k2 in opposite orders. InnoDB rolls back the
    lighter one: its claim raises StoreUnavailable saying the whole transaction is gone."""
    sql(f"CREATE TABLE `{table}_ledger` (k VARCHAR(64) NOT NULL) ENGINE=InnoDB")
    heavy, light = admin(), admin()
    heavy.begin()
    light.begin()
    with heavy.cursor() as cursor:
        for i in range(20):
            cursor.execute(f"INSERT INTO `{table}_ledger` (k) VALUES (%s)", (f"w{i}",))
    _claim_in(store, heavy, "k2", "H2")
    _claim_in(store, light, "k1", "L1")
    thread, out = _in_thread(lambda: _claim_in(store, light, "k2", "L2"))
    _wait_for_lock_wait(table)
    assert _claim_in(store, heavy, "k1", "H1").status is ClaimStatus.NEW
    thread.join(30)
    heavy.commit()
    error = out.get("error")
    assert isinstance(error, StoreUnavailable), out
    assert "rolled back the whole transaction" in str(error)
    light.rollback()
    for conn in (heavy, light):
        conn.close()
    assert [r.token for r in store.scan(consumer="billing")] == ["H1", "H2"]


def test_r7_a_claim_after_the_server_ended_the_callers_transaction_leaves_no_marker(
    store: MySQLStore, table: str
) -> None:
    """The driver still reports the transaction a deadlock rolled back (the error packet
    carries no status); a caller that swallowed the error and joins it anyway gets
    TransactionRequired, and the marker that autocommitted meanwhile is taken back."""
    sql(f"CREATE TABLE `{table}_scratch` (id INT PRIMARY KEY, v INT) ENGINE=InnoDB")
    sql(f"INSERT INTO `{table}_scratch` VALUES (1, 0), (2, 0)")
    a, b = admin(), admin()
    a.begin()
    b.begin()

    def bump(conn: Any, row: int) -> None:
        with conn.cursor() as cursor:
            cursor.execute(f"UPDATE `{table}_scratch` SET v = v + 1 WHERE id = %s", (row,))

    bump(a, 1)
    bump(b, 2)
    thread, out = _in_thread(lambda: bump(a, 2))
    _wait_for_lock_wait(f"{table}_scratch")
    try:
        bump(b, 1)
        survivor, victim = b, a
    except pymysql.err.OperationalError as exc:
        code = exc.args[0]
        survivor, victim = a, b
    else:
        code = 1213
    assert code == 1213
    thread.join(30)
    survivor.commit()
    assert victim is b or isinstance(out.get("error"), pymysql.err.OperationalError)
    store.check_transaction(victim)  # the stale status still says "in a transaction"
    with pytest.raises(TransactionRequired, match="ended before the claim"):
        _claim_in(store, victim, "k", "t1")
    assert store.get("billing", "k") is None
    for conn in (a, b):
        conn.close()


# --------------------------------------------------------------------------- transactions


def test_r7_check_transaction_follows_the_servers_transaction_flag(store: MySQLStore) -> None:
    conn = admin()  # autocommit on
    try:
        with pytest.raises(TransactionRequired):
            store.check_transaction(conn)
        conn.begin()
        store.check_transaction(conn)
        conn.commit()
        with pytest.raises(TransactionRequired):
            store.check_transaction(conn)
        with conn.cursor() as cursor:
            cursor.execute("START TRANSACTION")
        store.check_transaction(conn)
        conn.rollback()
        conn.autocommit(False)  # the next statement opens a transaction the caller commits
        store.check_transaction(conn)
    finally:
        conn.close()
    with pytest.raises(TransactionRequired):
        store.check_transaction(object())


def test_r7_the_marker_commits_with_the_callers_writes(store: MySQLStore, table: str) -> None:
    sql(f"CREATE TABLE `{table}_ledger` (k VARCHAR(64) NOT NULL) ENGINE=InnoDB")
    inbox = oncely.Inbox(store, consumer="billing")

    def book(tx: Any, payload: dict[str, str]) -> str:
        with tx.cursor() as cursor:
            cursor.execute(f"INSERT INTO `{table}_ledger` (k) VALUES (%s)", (payload["k"],))
            cursor.execute("SELECT CONNECTION_ID()")
            return str(cursor.fetchone()[0])

    conn = admin()
    conn.autocommit(False)  # PyMySQL's own default: a transaction opens implicitly
    try:
        first = inbox.handle_in_transaction("k", {"k": "k"}, book, tx=conn)
        with conn.cursor() as cursor:
            cursor.execute("SELECT CONNECTION_ID()")
            assert first.value == str(cursor.fetchone()[0])  # the handler got our connection
        assert first.outcome is Outcome.PROCESSED and store.get("billing", "k") is None
        conn.commit()
        assert sql(f"SELECT count(*) FROM `{table}_ledger`") == [(1,)]
        assert inbox.handle_in_transaction("k", {"k": "k"}, book).outcome is Outcome.DUPLICATE
    finally:
        conn.close()


def test_nested_savepoints_roll_back_only_their_own_writes(store: MySQLStore, table: str) -> None:
    sql(f"CREATE TABLE `{table}_ledger` (k VARCHAR(64) NOT NULL) ENGINE=InnoDB")
    inbox = oncely.Inbox(store, consumer="billing")

    def write(tx: Any, key: str) -> None:
        with tx.cursor() as cursor:
            cursor.execute(f"INSERT INTO `{table}_ledger` (k) VALUES (%s)", (key,))

    def inner_fails(tx: Any, payload: object) -> None:
        raise ValueError("inner")

    def outer(tx: Any, payload: object) -> str:
        write(tx, "outer")
        failed = inbox.handle_in_transaction("inner", {"i": 1}, inner_fails, tx=tx)
        assert failed.outcome is Outcome.FAILED
        write(tx, "after")
        return "ok"

    with store.transaction() as tx:
        assert inbox.handle_in_transaction("outer", {"o": 1}, outer, tx=tx).ok
    assert sorted(sql(f"SELECT k FROM `{table}_ledger`")) == [("after",), ("outer",)]
    assert store.get("billing", "inner") is None and store.get("billing", "outer") is not None


def _batches_match_the_model(store: Any, clock: oncely.FakeClock, seed: int) -> None:
    """Records in every state (live, stale, completed, failed, expired, absent), then batch
    claims with keys repeated, fingerprints that agree or not, takeover on and off: every
    answer, and then every record, equals the reference model's (the claims made one by one
    at one clock reading). Both paths run: batches of new keys only, and mixed ones."""
    rng = random.Random(seed)
    model = RecordTable()
    keys = [f"k{i}" for i in range(20)] + ["K0", "k0 ", "", "q'uo\\te", "\U0001f600"]
    number = iter(range(1_000_000))

    def event(key: str, lease: int, keep: int, takeover: bool) -> ClaimEvent:
        fp = rng.choice([None, "f", "g"])
        return ClaimEvent("billing", key, fp, f"t{next(number)}", lease, keep, takeover)

    def batch_of(events: list[ClaimEvent], takeover: bool) -> None:
        got = store.claim_many(
            "billing", [ClaimRequest(e.key, e.fingerprint, e.token) for e in events],
            lease_ms=LEASE_MS, keep_ms=KEEP_MS, takeover=takeover,
        )  # fmt: skip
        assert got == model.claim_many(events, clock.now_ms())

    for round_ in range(12):
        fresh = [f"new-{round_}-{i}" for i in range(rng.randint(1, 6))]
        batch_of([event(rng.choice(fresh), LEASE_MS, KEEP_MS, False) for _ in range(8)], False)
        for key in rng.sample(keys, 8):
            ev = event(key, rng.choice([1_000, LEASE_MS]), rng.choice([2_000, KEEP_MS]), True)
            got = store.claim(
                "billing", key, fingerprint=ev.fingerprint, token=ev.token,
                lease_ms=ev.lease_ms, keep_ms=ev.keep_ms, takeover=True,
            )  # fmt: skip
            assert got == model.claim(ev, clock.now_ms())
            if got.won and rng.random() < 0.5:
                keep = rng.choice([2_000, KEEP_MS])
                if rng.random() < 0.5:
                    done = CompleteEvent(ev.token, b"r", keep)
                    assert store.complete(
                        "billing", key, token=ev.token, result=b"r", keep_ms=keep
                    ) == model.complete("billing", key, done, clock.now_ms())
                else:
                    failed = FailEvent(ev.token, "e", keep)
                    assert store.fail(
                        "billing", key, token=ev.token, error="e", keep_ms=keep
                    ) == model.fail("billing", key, failed, clock.now_ms())
        clock.advance(timedelta(milliseconds=rng.choice([0, 500, 1_500, 2_500, LEASE_MS])))
        takeover = rng.random() < 0.7
        batch_of(
            [event(rng.choice(keys), LEASE_MS, KEEP_MS, takeover) for _ in range(25)], takeover
        )
        clock.advance(timedelta(milliseconds=rng.choice([0, 700])))
    now = clock.now_ms()
    assert [store.get("billing", k) for k in keys] == [model.get("billing", k, now) for k in keys]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_r8_batch_claims_match_the_model(table: str, seed: int) -> None:
    clock = oncely.FakeClock()
    store = MySQLStore.from_url(url(table), clock=clock)
    try:
        _batches_match_the_model(store, clock, seed)
    finally:
        store.close()


def test_r8_a_batch_of_new_keys_answers_the_rows_it_wrote(store: MySQLStore) -> None:
    """New keys are not read back: the answers are built from what was sent and the clock
    reading the OK packet carries, and must equal the rows, whatever the keys hold (quotes,
    backslashes, NUL, trailing spaces, case, 4-byte characters), with or without
    fingerprints."""
    odd = ["q'uo\\te", 'd"q', "a\x00b", "k ", "K", "k", "", "\U0001f600", "x" * MAX_KEY_BYTES]
    requests = [
        ClaimRequest(key, None if i % 3 == 0 else f"fp'{i}\\", f"t{i}")
        for i, key in enumerate(odd + [f"plain-{i}" for i in range(40)])
    ]
    requests.append(ClaimRequest("plain-3", "other", "t-again"))  # repeated: the first wins
    before = _server_ms()
    claims = store.claim_many(
        "billing", requests, lease_ms=LEASE_MS, keep_ms=KEEP_MS, takeover=False
    )
    after = _server_ms()
    assert [c.status for c in claims] == [ClaimStatus.NEW] * (len(requests) - 1) + [
        ClaimStatus.EXISTING
    ]
    assert claims[-1].record == claims[len(odd) + 3].record
    for claim in claims:
        assert claim.record == store.get("billing", claim.record.key)
        assert before <= claim.now_ms == claim.record.created_ms <= after
        assert claim.record.lease_until_ms == claim.now_ms + LEASE_MS


def test_r7_a_joined_message_adds_its_savepoint_and_claim_and_no_release(
    store: MySQLStore, table: str
) -> None:
    """Counted by the server on the caller's connection: the default savepoint costs one
    statement (SAVEPOINT) besides the claim, none at the end of a successful handler, and a
    failing handler adds only the ROLLBACK TO."""
    sql(f"CREATE TABLE `{table}_ledger` (k VARCHAR(64) NOT NULL) ENGINE=InnoDB")
    inbox = oncely.Inbox(store, consumer="billing")

    def book(tx: Any, payload: str) -> None:
        with tx.cursor() as cursor:
            cursor.execute(f"INSERT INTO `{table}_ledger` (k) VALUES (%s)", (payload,))
        if payload.startswith("bad"):
            raise ValueError(payload)

    conn = admin()
    try:
        conn.begin()
        counted = []
        for key in ("a", "bad", "b"):
            before = _questions(conn)
            inbox.handle_in_transaction(key, key, book, tx=conn)
            counted.append(_questions(conn) - before - 1)  # less the SHOW of _questions
        conn.commit()
    finally:
        conn.close()
    # SAVEPOINT, claim, the handler's INSERT; and the ROLLBACK TO for the failing one
    assert counted == [3, 4, 3]
    assert sorted(sql(f"SELECT k FROM `{table}_ledger`")) == [("a",), ("b",)]


def test_r7_savepoints_left_in_place_never_hide_the_one_to_roll_back_to(
    store: MySQLStore, table: str
) -> None:
    """In one caller transaction: messages that fail between, inside and around successful
    ones (nested handlers, a second store nesting in the first, the caller's own savepoints
    in between) undo exactly their own writes and markers."""
    sql(f"CREATE TABLE `{table}_ledger` (k VARCHAR(64) NOT NULL) ENGINE=InnoDB")
    other = MySQLStore.from_url(url(table))
    inbox = oncely.Inbox(store, consumer="billing")
    second = oncely.Inbox(other, consumer="second")

    def write(tx: Any, key: str) -> None:
        with tx.cursor() as cursor:
            cursor.execute(f"INSERT INTO `{table}_ledger` (k) VALUES (%s)", (key,))

    def book(tx: Any, payload: str) -> None:
        write(tx, payload)
        if payload.startswith("bad"):
            raise ValueError(payload)

    def nested(via: oncely.Inbox, inner_fails: bool, outer_fails: bool) -> Any:
        def outer(tx: Any, payload: str) -> None:
            write(tx, f"{payload}-outer")
            inner_key = f"{'bad-' if inner_fails else ''}{payload}-inner"
            inner = via.handle_in_transaction(inner_key, inner_key, book, tx=tx)
            assert inner.ok is not inner_fails
            write(tx, f"{payload}-after")
            if outer_fails:
                raise ValueError(payload)

        return outer

    conn = admin()
    try:
        conn.begin()
        for key in ("a", "bad-1", "b"):
            inbox.handle_in_transaction(key, key, book, tx=conn)
        assert not inbox.handle_in_transaction("n1", "n1", nested(inbox, False, True), tx=conn).ok
        assert inbox.handle_in_transaction("n2", "n2", nested(inbox, True, False), tx=conn).ok
        assert not inbox.handle_in_transaction("n3", "n3", nested(second, False, True), tx=conn).ok
        assert inbox.handle_in_transaction("n4", "n4", nested(second, True, False), tx=conn).ok
        with conn.cursor() as cursor:
            cursor.execute("SAVEPOINT mine")
        inbox.handle_in_transaction("gone", "gone", book, tx=conn)
        with conn.cursor() as cursor:
            cursor.execute("ROLLBACK TO SAVEPOINT mine")
        inbox.handle_in_transaction("c", "c", book, tx=conn)
        inbox.handle_in_transaction("bad-2", "bad-2", book, tx=conn)
        conn.commit()
    finally:
        conn.close()
        other.close()
    written = {"a", "b", "n2-outer", "n2-after", "n4-outer", "n4-after", "c"}
    assert sorted(sql(f"SELECT k FROM `{table}_ledger`")) == sorted((k,) for k in written)
    assert {r.key for r in store.scan()} == {"a", "b", "n2", "n4", "c"}


async def test_r7_async_check_transaction_and_joined_claims(table: str) -> None:
    store = AsyncMySQLStore.from_url(url(table))
    s = parse_url(MYSQL_URL).settings
    conn = await aiomysql.connect(
        host=s.host, port=s.port, user=s.user, password=s.password or "", db=s.database,
        autocommit=True, charset="utf8mb4",
    )  # fmt: skip
    try:
        with pytest.raises(TransactionRequired):
            store.check_transaction(conn)
        await conn.begin()
        store.check_transaction(conn)
        claim = await store.claim_in(
            conn, "billing", "k\U0001f600", fingerprint=None, token="t1", keep_ms=KEEP_MS,
            takeover=False,
        )  # fmt: skip
        assert claim.status is ClaimStatus.NEW
        await conn.rollback()
        with pytest.raises(TransactionRequired):
            store.check_transaction(conn)
        assert await store.get("billing", "k\U0001f600") is None
    finally:
        conn.close()
        await store.aclose()


def test_translation_of_deadlocks_and_lock_waits() -> None:
    deadlock = pymysql.err.OperationalError(1213, "Deadlock found when trying to get lock")
    wait = pymysql.err.OperationalError(1205, "Lock wait timeout exceeded")
    for exc in (deadlock, wait):
        assert isinstance(translate(exc, "claim"), StoreUnavailable)
    assert "rolled back the whole transaction" in str(translate(deadlock, "x", joined=True))
    assert "still open" in str(translate(wait, "x", joined=True))
    syntax = pymysql.err.ProgrammingError(1064, "You have an error in your SQL syntax")
    translated = translate(syntax, "claim")
    assert type(translated) is StoreError
    assert isinstance(translate(pymysql.err.OperationalError(2013, "Lost"), "x"), StoreUnavailable)
    assert isinstance(translate(ConnectionResetError(104, "reset"), "x"), StoreUnavailable)


# --------------------------------------------------------------------------- failures


def test_a_closed_port_is_unavailable_at_once(server: None) -> None:
    port = _free_port()
    store = MySQLStore.from_url(f"mysql://root@127.0.0.1:{port}/test?connect_timeout=2")
    with pytest.raises(StoreUnavailable, match=r"connecting to mysql://root@127\.0\.0\.1"):
        store.get("c", "k")
    store.close()


def test_a_wrong_password_is_an_error_that_does_not_show_it(table: str) -> None:
    s = parse_url(MYSQL_URL).settings
    user = f"oncely_{uuid.uuid4().hex[:8]}"
    sql(f"CREATE USER '{user}'@'%' IDENTIFIED BY 'right-one'")
    try:
        store = MySQLStore.from_url(
            f"mysql://{user}:wrong-one@{s.host}:{s.port}/{s.database}?table={table}"
        )
        with pytest.raises(StoreError) as failed:
            store.get("c", "k")
        assert not isinstance(failed.value, StoreUnavailable)  # retrying will not help
        assert "wrong-one" not in str(failed.value) and "***" in str(failed.value)
        store.close()
    finally:
        sql(f"DROP USER '{user}'@'%'")


def test_an_unknown_database_is_an_error(server: None) -> None:
    s = parse_url(MYSQL_URL).settings
    store = MySQLStore.from_url(f"mysql://{s.user}@{s.host}:{s.port}/no_such_db_{os.getpid()}")
    with pytest.raises(StoreError, match="Unknown database"):
        store.get("c", "k")
    store.close()


def _session_ids(store: MySQLStore, count: int) -> list[int]:
    """The connection ids of ``count`` pooled connections (all held at once, then returned)."""
    blocks = [store.transaction() for _ in range(count)]
    txs = [block.__enter__() for block in blocks]
    try:
        ids = []
        for tx in txs:
            with tx.cursor() as cursor:
                cursor.execute("SELECT CONNECTION_ID()")
                ids.append(int(cursor.fetchone()[0]))
        return ids
    finally:
        for block in reversed(blocks):
            block.__exit__(None, None, None)


def test_the_pool_drops_connections_the_server_killed(table: str) -> None:
    store = MySQLStore.from_url(url(table, pool_size=2))
    try:
        _claim(store, "k1", "t1")
        for session in _session_ids(store, 2):
            sql(f"KILL CONNECTION {session}")
        assert _claim(store, "k2", "t2").status is ClaimStatus.NEW  # no error surfaces
        record = store.get("billing", "k1")
        assert record is not None and record.token == "t1"
    finally:
        store.close()


async def test_the_async_pool_drops_connections_the_server_killed(table: str) -> None:
    store = AsyncMySQLStore.from_url(url(table, pool_size=2))
    try:
        await store.claim(
            "billing", "k1", fingerprint=None, token="t1", lease_ms=LEASE_MS, keep_ms=KEEP_MS,
            takeover=False,
        )  # fmt: skip
        async with store.transaction() as t1, store.transaction() as t2:
            ids = []
            for tx in (t1, t2):
                cursor = await tx.cursor()
                await cursor.execute("SELECT CONNECTION_ID()")
                ids.append(int((await cursor.fetchone())[0]))
                await cursor.close()
        for session in ids:
            sql(f"KILL CONNECTION {session}")
        await asyncio.sleep(0.05)  # let the event loop read the end of file
        record = await store.get("billing", "k1")
        assert record is not None and record.token == "t1"
    finally:
        await store.aclose()


# --------------------------------------------------------------------------- a server restart


class PrivateServer:
    """A MariaDB server of this test's own (data directory, port, socket under ``base``), so
    it can be SIGKILLed and restarted without disturbing the shared one."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.port = _free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self.user = "root" if os.geteuid() == 0 else os.environ.get("USER", "")
        subprocess.run(
            [
                str(shutil.which("mariadb-install-db")), "--no-defaults",
                f"--datadir={base / 'data'}", f"--user={self.user}",
                "--auth-root-authentication-method=normal", "--skip-test-db",
            ],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip

    def start(self) -> None:
        log = open(self.base / "server.log", "ab")  # noqa: SIM115 - the server owns it
        self.process = subprocess.Popen(
            [
                str(shutil.which("mariadbd")), "--no-defaults", f"--datadir={self.base / 'data'}",
                f"--port={self.port}", "--bind-address=127.0.0.1",
                f"--socket={self.base / 'sock'}", f"--pid-file={self.base / 'pid'}",
                f"--user={self.user}", "--skip-log-bin", "--innodb-buffer-pool-size=16M",
            ],
            stdout=log, stderr=log,
        )  # fmt: skip
        log.close()
        deadline = time.monotonic() + 30
        while True:
            try:
                conn = pymysql.connect(host="127.0.0.1", port=self.port, user="root")
                break
            except pymysql.err.OperationalError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        with conn.cursor() as cursor:
            cursor.execute("CREATE DATABASE IF NOT EXISTS oncely")
        conn.close()

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)  # a crash, not a clean shutdown
            self.process.wait(timeout=30)
        self.process = None

    @property
    def url(self) -> str:
        return f"mysql://root@127.0.0.1:{self.port}/oncely?connect_timeout=2&pool_size=2"


@pytest.fixture
def private_server(tmp_path: Path, server: None) -> Iterator[PrivateServer]:
    if not (shutil.which("mariadbd") and shutil.which("mariadb-install-db")):
        pytest.skip("mariadbd is not installed here")
    made = PrivateServer(tmp_path)
    made.start()
    try:
        yield made
    finally:
        made.kill()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_store_recovers_after_its_server_crashes_and_restarts(
    private_server: PrivateServer,
) -> None:
    store = MySQLStore.from_url(private_server.url)
    try:
        _claim(store, "committed", "t1")
        pending = store.transaction()
        tx = pending.__enter__()
        _claim_in(store, tx, "in-flight", "t2")
        private_server.kill()
        with pytest.raises(StoreUnavailable):
            pending.__exit__(None, None, None)  # the COMMIT never reached a server
        with pytest.raises(StoreUnavailable):
            store.get("billing", "committed")  # nobody listens: refused at once
        private_server.start()
        record = store.get("billing", "committed")  # dead connections dropped, new ones made
        assert record is not None and record.token == "t1"  # InnoDB recovered the commit
        assert store.get("billing", "in-flight") is None  # and rolled back the open one
        assert _claim(store, "after", "t3").status is ClaimStatus.NEW
    finally:
        store.close()

    async def async_side() -> None:
        made = AsyncMySQLStore.from_url(private_server.url)
        try:
            assert await made.get("billing", "after") is not None
            private_server.kill()
            private_server.start()
            await asyncio.sleep(0.05)  # let the event loop read the end of file
            record = await made.get("billing", "committed")
            assert record is not None and record.token == "t1"
        finally:
            await made.aclose()

    asyncio.run(async_side())


# --------------------------------------------------------------------------- races (R8)

RACE_KEYS = 1000
RACERS = ("sync", "async") * 4


def race_worker(
    store_url: str, api: str, worker: str, seed: int, out: str, start: Any, parent_pid: int
) -> None:
    """Claim every one of ``RACE_KEYS`` keys in an order of this worker's own; write what it
    won and which token it saw win each key."""
    order = list(range(RACE_KEYS))
    random.Random(seed).shuffle(order)
    tally: dict[str, Any] = {"worker": worker, "won": [], "seen": {}, "errors": []}
    orphan = Orphan(parent_pid)

    def note(key: str, claim: oncely.Claim) -> None:
        if claim.won:
            tally["won"].append(key)
        tally["seen"][key] = claim.record.token

    def run_sync() -> None:
        store = MySQLStore.from_url(store_url)
        store.get("racer", "warm-up")  # connect now, so the race starts at the first claim
        start.wait(timeout=60)
        for i in order:
            key = f"order-{i:04d}"
            try:
                note(key, _claim(store, key, f"{worker}/{i}", consumer="racer"))
            except StoreError as exc:
                tally["errors"].append(f"{key}: {exc!r}")
            if i % 100 == 0:
                orphan.check()
        store.close()

    async def run_async() -> None:
        store = AsyncMySQLStore.from_url(store_url)
        await store.get("racer", "warm-up")
        start.wait(timeout=60)  # blocking on purpose: nothing else runs before the start
        for i in order:
            key = f"order-{i:04d}"
            try:
                claim = await store.claim(
                    "racer", key, fingerprint="f", token=f"{worker}/{i}", lease_ms=LEASE_MS,
                    keep_ms=KEEP_MS, takeover=False,
                )  # fmt: skip
                note(key, claim)
            except StoreError as exc:
                tally["errors"].append(f"{key}: {exc!r}")
            if i % 100 == 0:
                orphan.check()
        await store.aclose()

    started = time.monotonic()
    if api == "sync":
        run_sync()
    else:
        asyncio.run(run_async())
    tally["seconds"] = time.monotonic() - started
    write_json(out, tally)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_r8_r9_eight_processes_racing_over_the_same_keys_elect_one_winner_each(
    table: str, tmp_path: Path
) -> None:
    """Eight processes (four on each twin), released together from a barrier, each claim the
    same 1,000 keys in its own random order: InnoDB's unique key gives each key to exactly
    one of them, and every other one is told who won."""
    store_url = url(table)
    MySQLStore.from_url(store_url).migrate()
    procs = Processes()
    deadlocks = _deadlocks()
    start = procs.ctx.Barrier(len(RACERS))
    outs = [tmp_path / f"racer{n}.json" for n in range(len(RACERS))]
    seed = random.randrange(2**32)
    try:
        started = [
            procs.start(
                race_worker,
                store_url,
                api,
                f"racer{n}-{api}",
                seed + n,
                str(outs[n]),
                start,
                os.getpid(),
                name=f"racer{n}",
            )
            for n, api in enumerate(RACERS)
        ]
        for process in started:
            process.join(timeout=100)
        codes = [p.exitcode for p in started]
    finally:
        left = procs.reap()
    assert not left and codes == [0] * len(RACERS), (left, codes)
    tallies = [json.loads(out.read_text()) for out in outs]
    errors = [e for t in tallies for e in t["errors"]]
    assert not errors, errors[:5]
    winners: dict[str, list[str]] = {}
    for tally in tallies:
        for key in tally["won"]:
            winners.setdefault(key, []).append(tally["worker"])
    keys = [f"order-{i:04d}" for i in range(RACE_KEYS)]
    assert sorted(winners) == keys
    doubled = {k: w for k, w in winners.items() if len(w) != 1}
    assert not doubled, f"seed={seed}: {doubled}"
    checker = MySQLStore.from_url(store_url)
    try:
        stored = {r.key: r.token for r in checker.scan(consumer="racer", limit=RACE_KEYS + 10)}
    finally:
        checker.close()
    for tally in tallies:
        mismatched = [k for k in keys if tally["seen"][k] != stored[k]]
        assert not mismatched, f"{tally['worker']} saw other winners for {mismatched[:5]}"
    wins = Counter({t["worker"]: len(t["won"]) for t in tallies})
    slowest = max(t["seconds"] for t in tallies)
    print(
        f"\n[R8 MariaDB race] seed={seed} {len(RACERS)} processes x {RACE_KEYS} keys: "
        f"wins {dict(wins)}; {len(RACERS) * RACE_KEYS / slowest:.0f} claims/s overall "
        f"(slowest racer {slowest:.2f}s); InnoDB deadlocks {_deadlocks() - deadlocks}"
    )


# --------------------------------------------------------------------------- SIGKILL (R7)

CRASH_KEYS = 150
CLAIMED, EFFECT_WRITTEN, COMPLETED = "claimed", "effect_written", "completed"
# The n-th time an incarnation reaches a point it SIGKILLs itself; restarts take the rest.
CRASH_PLANS = [
    (CLAIMED, 2), (EFFECT_WRITTEN, 3), (COMPLETED, 2), (EFFECT_WRITTEN, 1), (CLAIMED, 5),
    (COMPLETED, 4), (COMPLETED, 1), (CLAIMED, 1), (EFFECT_WRITTEN, 6),
]  # fmt: skip
PARENT_KILLS = 8


@dataclass(frozen=True)
class CrashJob:
    """One incarnation of a transactional consumer draining the broker."""

    store_url: str
    ledger: str
    broker: str
    worker: str
    log: str
    parent_pid: int
    kill_point: str | None = None
    kill_after: int = 1
    visibility_s: float = 0.5


def crash_worker(job: CrashJob) -> None:
    """Consume until the broker is drained; any surprise is logged and exits with 3."""
    log = Log(job.log)
    try:
        _consume(job, log)
    except BaseException as exc:
        log.write("ERROR", "-", repr(exc))
        os._exit(3)


def _consume(job: CrashJob, log: Log) -> None:
    orphan = Orphan(job.parent_pid)
    trip = Tripwire(job.kill_point, job.kill_after, log)
    broker = Broker(job.broker, visibility_s=job.visibility_s)
    store = MySQLStore.from_url(job.store_url)
    inbox = oncely.Inbox(store, consumer="chaos")

    def book(tx: Any, payload: dict[str, str]) -> dict[str, str]:
        key = payload["key"]
        trip.reached(CLAIMED, key)
        with tx.cursor() as cursor:
            cursor.execute(
                f"INSERT INTO `{job.ledger}` (k, worker) VALUES (%s, %s)", (key, job.worker)
            )
        trip.reached(EFFECT_WRITTEN, key)
        return {"worker": job.worker}

    log.write("START", "-", f"kill_point={job.kill_point} kill_after={job.kill_after}")
    while True:
        orphan.check()
        delivery = broker.receive()
        if delivery is None:
            if broker.unfinished() == 0:
                break
            time.sleep(0.02)
            continue
        message_id, key = delivery
        try:
            handled = inbox.handle_in_transaction(key, {"key": key}, book)
        except StoreUnavailable as exc:  # a lock wait or a deadlock: nothing was recorded
            log.write("UNAVAILABLE", key, str(exc))
            broker.requeue(message_id, delay_s=0.05)
            continue
        log.write("OUT", key, f"{handled.outcome} {handled.reason or ''}")
        if handled.outcome is Outcome.PROCESSED:
            trip.reached(COMPLETED, key)
        if handled.action is oncely.Action.ACK:
            broker.ack(message_id)
        elif handled.action in (oncely.Action.REQUEUE_LATER, oncely.Action.RETRY):
            broker.requeue(message_id, delay_s=0.05)
        else:
            raise AssertionError(f"unexpected outcome {handled.outcome} for {key}")
    log.write("DONE", "-")
    store.close()
    broker.close()


def _lines(path: str) -> list[str]:
    log = Path(path)
    return log.read_text().splitlines() if log.exists() else []


def _drain_with_kills(
    procs: Processes, template: CrashJob, logs: Path, seed: int, slots: int = 3
) -> dict[str, Any]:
    """Run ``slots`` consumers until the broker is drained, SIGKILLing them (by plan, and from
    here at random moments) and restarting the dead; the kills that fired, by point."""
    rng = random.Random(seed)
    broker = Broker(template.broker, visibility_s=template.visibility_s)
    plans = deque(CRASH_PLANS)
    live: dict[int, tuple[Any, CrashJob]] = {}
    report: dict[str, Any] = {"self": [], "parent": 0, "incarnations": 0}
    started = time.monotonic()
    kills_left, next_kill = PARENT_KILLS, time.monotonic() + rng.uniform(0.1, 0.3)

    def launch(slot: int) -> None:
        point, nth = plans.popleft() if plans else (None, 1)
        name = f"w{slot}.{report['incarnations']}"
        job = replace(
            template, worker=name, log=str(logs / f"{name}.log"), kill_point=point, kill_after=nth
        )
        live[slot] = (procs.start(crash_worker, job, name=name), job)
        report["incarnations"] += 1

    try:
        for slot in range(slots):
            launch(slot)
        while live:
            assert time.monotonic() - started < 90, f"not drained: {broker.unfinished()} left"
            for slot, (process, job) in list(live.items()):
                if process.exitcode is None:
                    continue
                del live[slot]
                lines = _lines(job.log)
                assert process.exitcode in (0, -signal.SIGKILL), "\n".join(lines)
                fired = [line.split(" ", 2)[1:] for line in lines if line.startswith("KILL ")]
                if fired:
                    report["self"].append((fired[0][1], fired[0][0], job.worker))
                elif job.kill_point is not None:
                    plans.appendleft((job.kill_point, job.kill_after))
                if broker.unfinished() > 0:
                    launch(slot)
            now = time.monotonic()
            if kills_left and now >= next_kill:
                alive = [p for p, j in live.values() if p.exitcode is None and _lines(j.log)]
                if alive:
                    rng.choice(alive).kill()
                    report["parent"] += 1
                    kills_left -= 1
                next_kill = now + rng.uniform(0.05, 0.3)
            time.sleep(0.01)
        assert broker.unfinished() == 0
        report["deliveries"] = broker.deliveries()
    finally:
        broker.close()
        procs.reap()
    report["seconds"] = time.monotonic() - started
    return report


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_r7_sigkill_at_any_point_applies_every_effect_exactly_once(
    table: str, tmp_path: Path
) -> None:
    """Transactional mode: consumers SIGKILLed after the claim, after the effect is written
    (before the commit) and after the commit (before the acknowledgement), plus at random
    moments. A kill before the commit loses marker and effect together (InnoDB rolls the dead
    session's transaction back); after it, the redelivery finds the marker. The ledger has no
    unique key, so an effect applied twice would show as two rows."""
    ledger = f"{table}_ledger"
    sql(f"CREATE TABLE `{ledger}` (k VARCHAR(64) NOT NULL, worker VARCHAR(64)) ENGINE=InnoDB")
    store_url = url(table)
    MySQLStore.from_url(store_url).migrate()
    keys = [f"order-{i:04d}" for i in range(CRASH_KEYS)]
    Broker.create(str(tmp_path / "broker.db"), keys, copies=2)
    (tmp_path / "logs").mkdir()
    seed = int(os.environ.get("ONCELY_CHAOS_SEED", random.randrange(2**32)))
    template = CrashJob(
        store_url=store_url, ledger=ledger, broker=str(tmp_path / "broker.db"), worker="",
        log="", parent_pid=os.getpid(),
    )  # fmt: skip
    report = _drain_with_kills(Processes(), template, tmp_path / "logs", seed)
    summary = (
        f"seed={seed} deliveries={report['deliveries']} parent kills={report['parent']} "
        f"self kills={Counter(point for point, _, _ in report['self'])} "
        f"incarnations={report['incarnations']} in {report['seconds']:.1f}s"
    )
    print(f"\n[R7 MariaDB SIGKILL] {summary}")
    applied: dict[str, list[str]] = {}
    for key, worker in sql(f"SELECT k, worker FROM `{ledger}`"):
        applied.setdefault(key, []).append(worker)
    assert sorted(applied) == keys, f"effects lost: {sorted(set(keys) - set(applied))}; {summary}"
    doubled = {k: w for k, w in applied.items() if len(w) > 1}
    assert not doubled, f"effects applied twice: {doubled}; {summary}"
    checker = MySQLStore.from_url(store_url)
    try:
        held = {r.key: r for r in checker.scan(consumer="chaos", limit=CRASH_KEYS + 10)}
    finally:
        checker.close()
    assert sorted(held) == keys and all(r.status is Status.COMPLETED for r in held.values())
    points = {point for point, _, _ in report["self"]}
    assert points == {CLAIMED, EFFECT_WRITTEN, COMPLETED}, summary
    for point, key, worker in report["self"]:
        if point == COMPLETED:  # committed, killed before the ack: its effect stands
            assert applied[key] == [worker], summary
            assert json.loads(held[key].result or b"{}") == {"worker": worker}
        else:  # killed before the commit: its write vanished with its transaction
            assert worker not in applied[key], f"{point} {key} {worker}: {summary}"


# --------------------------------------------------------------------------- the model


def _model_table() -> str:
    return f"oncely_h_{uuid.uuid4().hex[:12]}"


class _SyncMatchesModel(StoreMatchesModel):
    """The reference model's state machine on this store (its own table per example)."""

    factory = staticmethod(
        lambda _dir, clock: MySQLStore.from_url(url(_model_table()), clock=clock)
    )
    transactional = True

    def teardown(self) -> None:
        table = self.store.table
        try:
            super().teardown()
        finally:
            drop_tables(table)


class _AsyncMatchesModel(_SyncMatchesModel):
    factory = staticmethod(
        lambda _dir, clock: Blocking(AsyncMySQLStore.from_url(url(_model_table()), clock=clock))
    )


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("machine", [_SyncMatchesModel, _AsyncMatchesModel], ids=["sync", "async"])
def test_r8_r10_the_store_matches_the_model(server: None, machine: type[StoreMatchesModel]) -> None:
    """Hypothesis drives this store and the state table side by side (claims, takeovers,
    fenced writes, transactional claims, purges, clock steps onto lease and retention edges)
    and compares every answer, as it does for the SQLite store."""
    run_state_machine_as_test(
        machine, settings=settings(max_examples=30, stateful_step_count=40, deadline=None)
    )


def test_a_connection_left_without_autocommit_is_not_pooled_again(table: str) -> None:
    """A handler that turned autocommit off on the store's connection: were it pooled again,
    the next two-phase claim on it would wait for a COMMIT that never comes."""
    store = MySQLStore.from_url(url(table, pool_size=1))
    try:
        with store.transaction() as tx:
            tx.autocommit(False)
        _claim(store, "k", "t1")
        assert sql(f"SELECT token FROM `{table}`") == [(b"t1",)]  # committed: seen elsewhere
    finally:
        store.close()


def test_a_closed_store_refuses_work(store: MySQLStore) -> None:
    store.close()
    with pytest.raises(StoreError, match="closed"):
        store.get("c", "k")
