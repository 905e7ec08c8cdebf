"""SQLite-specific behaviour: schema versions, failures translated, files shared by processes."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import sqlite3
import stat
import threading
import warnings
from datetime import timedelta
from pathlib import Path

import pytest

import oncely
from oncely import Outcome


def test_schema_is_created_on_first_use_with_wal(tmp_path: Path) -> None:
    path = tmp_path / "o.db"
    store = oncely.SQLiteStore(path)
    assert store.get("c", "k") is None
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        version = conn.execute("SELECT value FROM oncely_inbox_meta").fetchone()[0]
    assert version == "2"
    store.close()


def test_missing_schema_is_a_clear_error_when_migration_is_off(tmp_path: Path) -> None:
    store = oncely.SQLiteStore(tmp_path / "o.db", migrate=False)
    with pytest.raises(oncely.SchemaMissing, match="oncely migrate") as missing:
        store.get("c", "k")
    assert f"table oncely_inbox in {tmp_path / 'o.db'}" in str(missing.value)
    assert store.migrate() == 2
    assert store.get("c", "k") is None
    store.close()


def test_a_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "o.db"
    oncely.SQLiteStore(path).migrate()
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE oncely_inbox_meta SET value = '9' WHERE name = 'schema_version'")
    store = oncely.SQLiteStore(path)
    with pytest.raises(oncely.SchemaTooNew, match="version 9"):
        store.get("c", "k")
    with pytest.raises(oncely.SchemaTooNew):
        store.migrate()


def test_table_names_are_checked_and_used(tmp_path: Path) -> None:
    with pytest.raises(oncely.InvalidIdentifier):
        oncely.SQLiteStore(tmp_path / "o.db", table="inbox; DROP TABLE x")
    store = oncely.SQLiteStore(tmp_path / "o.db", table="billing_inbox")
    inbox = oncely.Inbox(store, consumer="c")
    assert inbox.handle("k", 1, lambda p: p).outcome is Outcome.PROCESSED
    with sqlite3.connect(tmp_path / "o.db") as conn:
        assert conn.execute("SELECT count(*) FROM billing_inbox").fetchone()[0] == 1
    store.close()


def test_store_unavailable_when_the_database_stays_locked(tmp_path: Path) -> None:
    path = tmp_path / "o.db"
    settings = oncely.SQLiteSettings(busy_timeout=timedelta(milliseconds=200))
    store = oncely.SQLiteStore(path, settings=settings)
    store.migrate()
    inbox = oncely.Inbox(store, consumer="c")
    blocker = sqlite3.connect(path, isolation_level=None)
    blocker.execute("BEGIN EXCLUSIVE")
    ran: list[int] = []
    try:
        with pytest.raises(oncely.StoreUnavailable, match="locked"):
            inbox.handle("k", {"a": 1}, lambda p: ran.append(1))
        with pytest.raises(oncely.StoreUnavailable):
            inbox.handle_in_transaction("k2", {"a": 1}, lambda tx, p: ran.append(1))
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    assert not ran  # nothing ran, nothing was recorded: the message is simply retried later
    assert inbox.handle("k", {"a": 1}, lambda p: ran.append(1)).outcome is Outcome.PROCESSED
    store.close()


def test_an_unreadable_file_gives_a_typed_error(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        path = tmp_path / "a-dir"  # root ignores permissions: a directory where the file goes
        path.mkdir()
    else:
        path = tmp_path / "o.db"
        path.write_bytes(b"")
        path.chmod(stat.S_IRUSR)
    store = oncely.SQLiteStore(path)
    with pytest.raises(oncely.StoreError) as raised:
        store.get("c", "k")
    assert not isinstance(raised.value, sqlite3.Error)


def test_a_database_in_a_missing_directory_is_a_configuration_error(tmp_path: Path) -> None:
    """SQLite says only "unable to open database file", which was a StoreUnavailable: a store
    to try again later. Nothing will make the directory: it is a ConfigurationError saying
    so, as the command line says it, from every way of opening the store, sync and asyncio,
    at the first use (a directory made before then is used)."""
    path = tmp_path / "missing" / "dir" / "o.db"
    said = (
        f"cannot open the SQLite database {path}: there is no directory {path.parent} "
        "(oncely creates the database file, not its directory)"
    )
    for store in (oncely.open(f"sqlite:///{path}"), oncely.SQLiteStore(path)):
        with pytest.raises(oncely.ConfigurationError) as raised:
            store.get("c", "k")
        assert str(raised.value) == said
        assert not isinstance(raised.value, oncely.StoreUnavailable)
        with pytest.raises(oncely.ConfigurationError, match="there is no directory"):
            oncely.Inbox(store, consumer="c").handle("k", 1, lambda p: p)
        store.close()

    async def asynchronous() -> None:
        earlier = set(threading.enumerate())  # other tests' connections may still be open
        for store in (oncely.open_async(f"sqlite:///{path}"), oncely.AsyncSQLiteStore(path)):
            with pytest.raises(oncely.ConfigurationError) as raised:
                await store.get("c", "k")
            assert str(raised.value) == said
            with pytest.raises(oncely.ConfigurationError, match="there is no directory"):
                await oncely.AsyncInbox(store, consumer="c").prepare()
            await store.aclose()
            # The failed connect's aiosqlite thread has ended: it cannot report to a loop
            # closed meanwhile (a traceback printed after the error's one line).
            workers = [
                t
                for t in threading.enumerate()
                if "connection_worker" in t.name and t not in earlier
            ]
            assert not workers, workers

    asyncio.run(asynchronous())
    path.parent.mkdir(parents=True)  # made after the store: the same store opens it
    store = oncely.SQLiteStore(path)
    with pytest.raises(oncely.ConfigurationError):
        oncely.SQLiteStore(tmp_path / "nowhere" / "o.db").get("c", "k")
    assert store.get("c", "k") is None
    store.close()


def test_a_file_that_is_not_a_database_gives_a_typed_error(tmp_path: Path) -> None:
    path = tmp_path / "o.db"
    path.write_bytes(b"this is not a sqlite database, just text" * 100)
    with pytest.raises(oncely.StoreError):
        oncely.SQLiteStore(path).get("c", "k")


def test_the_handler_gets_the_store_s_transaction(tmp_path: Path) -> None:
    store = oncely.SQLiteStore(tmp_path / "o.db")
    inbox = oncely.Inbox(store, consumer="c")
    seen: list[bool] = []

    def book(tx: sqlite3.Connection, payload: object) -> None:
        seen.append(tx.in_transaction)
        tx.execute("CREATE TABLE IF NOT EXISTS t (x)")

    inbox.handle_in_transaction("k", 1, book)
    assert seen == [True]
    store.close()


def _child_claims(path: str, queue: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    store = oncely.SQLiteStore(path)
    inbox = oncely.Inbox(store, consumer="c")
    queue.put(inbox.handle("from-child", 1, lambda p: os.getpid()).outcome.value)
    store.close()


def test_a_forked_child_opens_its_own_connections(tmp_path: Path) -> None:
    path = tmp_path / "o.db"
    store = oncely.SQLiteStore(path)
    inbox = oncely.Inbox(store, consumer="c")
    assert inbox.handle("from-parent", 1, lambda p: 1).outcome is Outcome.PROCESSED

    def child(queue: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
        # Inherits the parent's store object and pool; must not reuse its connections.
        queue.put(inbox.handle("from-parent", 1, lambda p: 2).outcome.value)
        queue.put(inbox.handle("child-key", 1, lambda p: 3).outcome.value)

    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=child, args=(queue,))
    proc.start()
    proc.join(30)
    assert proc.exitcode == 0
    assert [queue.get(timeout=5), queue.get(timeout=5)] == ["duplicate", "processed"]
    assert inbox.handle("child-key", 1, lambda p: 4).outcome is Outcome.DUPLICATE
    store.close()


def test_a_closed_store_refuses_work(tmp_path: Path) -> None:
    store = oncely.SQLiteStore(tmp_path / "o.db")
    store.migrate()
    store.close()
    with pytest.raises(oncely.StoreError, match="closed"):
        store.get("c", "k")
    with pytest.raises(oncely.StoreError, match="closed"):
        store.migrate()


def test_migrate_makes_a_dropped_inbox_table_again(tmp_path: Path) -> None:
    """The version row says nothing of the inbox table: migrate runs its CREATE again."""
    path = tmp_path / "o.db"
    oncely.SQLiteStore(path).migrate()
    with sqlite3.connect(path) as conn:
        conn.execute("DROP TABLE oncely_inbox")
    store = oncely.SQLiteStore(path)
    assert store.migrate() == 2
    assert store.get("c", "k") is None
    store.close()


def _claim_program(path: Path) -> list[str]:
    """The opcodes SQLite runs for the store's claim INSERT on the database at ``path``."""
    from oncely.stores.sqlite.dialect import SQLiteDialect

    params = ("c", "k", "completed", None, "t", 1, 1, 1, 2, None, 2)
    with sqlite3.connect(path) as conn:
        return [row[1] for row in conn.execute("EXPLAIN " + SQLiteDialect().insert, params)]


def _table_sql(path: Path) -> str:
    with sqlite3.connect(path) as conn:
        sql: str = conn.execute(
            "SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'oncely_inbox'"
        ).fetchone()[0]
    return sql


def test_the_status_check_costs_the_claim_no_temporary_table(tmp_path: Path) -> None:
    """``status IN (...)`` in a CHECK makes SQLite fill a temporary b-tree on every INSERT;
    the table is created with the same constraint as comparisons."""
    path = tmp_path / "o.db"
    oncely.SQLiteStore(path).migrate()
    assert "OpenEphemeral" not in _claim_program(path)
    with sqlite3.connect(path) as conn, pytest.raises(sqlite3.IntegrityError, match="CHECK"):
        conn.execute(
            "INSERT INTO oncely_inbox (consumer, key, status, token, attempt, created_ms, "
            "updated_ms, lease_until_ms, expires_ms) VALUES ('c', 'k', 'done', 't', 1, 1, 1, 1, 2)"
        )


def test_the_store_s_statements_warn_of_nothing(tmp_path: Path) -> None:
    """Python 3.12.0 to 3.12.3 warn of numbered parameters ("?1") bound from a tuple as of
    named ones, on every claim: a user who turns warnings into errors (pytest's
    ``filterwarnings = error``) could not use the store there. The claim's INSERT binds plain
    ones, so no Python warns."""

    async def run_async() -> None:
        store = oncely.open_async(f"sqlite:///{tmp_path / 'a.db'}")
        try:
            inbox = oncely.AsyncInbox(store, consumer="c")

            async def handler(payload: object) -> str:
                return "done"

            assert (await inbox.handle("k", {"n": 1}, handler)).outcome is Outcome.PROCESSED
            assert (await inbox.handle("k", {"n": 1}, handler)).outcome is Outcome.DUPLICATE
        finally:
            await store.aclose()

    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        store = oncely.SQLiteStore(tmp_path / "s.db")
        try:
            inbox = oncely.Inbox(store, consumer="c")
            assert inbox.handle("k", {"n": 1}, lambda p: "done").outcome is Outcome.PROCESSED
            assert inbox.handle("k", {"n": 1}, lambda p: "done").outcome is Outcome.DUPLICATE
        finally:
            store.close()
        asyncio.run(run_async())


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_migrate_rewrites_an_older_tables_status_check_in_place(
    tmp_path: Path, flavour: str
) -> None:
    """A table created before the constraint was rewritten keeps its rows and keeps working,
    also for a store that had it open, and refuses the same rows as before."""
    from oncely.stores.sqlite.dialect import OLD_STATUS_CHECK, STATUS_CHECK, SQLiteDialect

    path = tmp_path / "o.db"
    d = SQLiteDialect()
    with sqlite3.connect(path) as conn:  # the old constraint, at this oncely's revision
        for statement in (*d.create, d.create_purge_index, d.set_revision):
            conn.execute(statement.replace(STATUS_CHECK, OLD_STATUS_CHECK))
    assert OLD_STATUS_CHECK in _table_sql(path)
    assert "OpenEphemeral" in _claim_program(path)  # what the rewrite saves

    early = oncely.SQLiteStore(path)  # opened before, and in use across, the rewrite
    inbox = oncely.Inbox(early, consumer="c")
    assert inbox.handle("k1", {"a": 1}, lambda p: "r1").outcome is Outcome.PROCESSED
    assert OLD_STATUS_CHECK in _table_sql(path)  # opening a store does not edit the schema

    if flavour == "sync":
        store = oncely.SQLiteStore(path)
        assert store.migrate() == 2
        store.close()
    else:

        async def migrate() -> None:
            store = oncely.AsyncSQLiteStore(path)
            assert await store.migrate() == 2
            await store.aclose()

        asyncio.run(migrate())

    sql = _table_sql(path)
    assert STATUS_CHECK in sql and OLD_STATUS_CHECK not in sql
    assert "OpenEphemeral" not in _claim_program(path)
    duplicate = inbox.handle("k1", {"a": 1}, lambda p: "again")
    assert (duplicate.outcome, duplicate.value) == (Outcome.DUPLICATE, "r1")
    assert inbox.handle("k2", {"a": 2}, lambda p: "r2").outcome is Outcome.PROCESSED
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        assert conn.execute("SELECT count(*) FROM oncely_inbox").fetchone()[0] == 2
        with pytest.raises(sqlite3.IntegrityError, match="CHECK"):
            conn.execute("UPDATE oncely_inbox SET status = 'done' WHERE key = 'k1'")
    early.close()


def test_an_async_store_nobody_closed_does_not_keep_the_process_alive(tmp_path: Path) -> None:
    script = (
        "import asyncio, oncely, sys\n"
        "async def main():\n"
        f"    store = oncely.AsyncSQLiteStore({str(tmp_path / 'o.db')!r})\n"
        "    inbox = oncely.AsyncInbox(store, consumer='c')\n"
        "    async def handler(payload): return None\n"
        "    print((await inbox.handle('k', {'a': 1}, handler)).outcome)\n"
        "asyncio.run(main())\n"
    )
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "processed"


async def test_r7_async_transaction_begins_in_the_claims_hop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The asyncio store's own transaction begins (BEGIN IMMEDIATE, the write lock taken at
    once) inside the claim's hop to the connection's thread: one hop fewer per message. Its
    connections go back to the pool in autocommit mode whatever happened, so a two-phase
    claim after them still commits on its own."""
    import aiosqlite

    path = tmp_path / "o.db"
    settings = oncely.SQLiteSettings(busy_timeout=timedelta(milliseconds=100))
    store = oncely.AsyncSQLiteStore(path, settings=settings)
    await store.migrate()
    inbox = oncely.AsyncInbox(store, consumer="c")
    hops: list[str] = []
    real = aiosqlite.Connection.execute_fetchall

    async def counted(self: aiosqlite.Connection, sql: str, params: object = None) -> object:
        hops.append(sql.split(maxsplit=1)[0])
        return await real(self, sql, params)  # type: ignore[arg-type]

    monkeypatch.setattr(aiosqlite.Connection, "execute_fetchall", counted)
    locked: list[bool] = []

    async def book(tx: aiosqlite.Connection, payload: object) -> None:
        other = sqlite3.connect(path, isolation_level=None, timeout=0)
        try:
            other.execute("BEGIN IMMEDIATE")  # must fail: the claim took the write lock
            other.execute("ROLLBACK")
            locked.append(False)
        except sqlite3.OperationalError:
            locked.append(tx.in_transaction)
        finally:
            other.close()
        await tx.execute("CREATE TABLE IF NOT EXISTS t (x)")
        await tx.execute("INSERT INTO t VALUES (?)", (str(payload),))

    async def fails(tx: aiosqlite.Connection, payload: object) -> None:
        await book(tx, payload)
        raise ValueError("no")

    def autocommit_everywhere() -> None:
        for conn in store._pool._idle:
            assert conn.isolation_level is None and not conn.in_transaction

    assert (await inbox.handle_in_transaction("a", "a", book)).outcome is Outcome.PROCESSED
    assert hops == ["INSERT", "COMMIT"]  # no BEGIN hop: the INSERT began the transaction
    assert locked == [True]
    autocommit_everywhere()
    assert (await inbox.handle_in_transaction("b", "b", fails)).outcome is Outcome.FAILED
    assert (await inbox.handle_in_transaction("a", "a", book)).outcome is Outcome.DUPLICATE
    autocommit_everywhere()
    blocker = sqlite3.connect(path, isolation_level=None)
    blocker.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(oncely.StoreUnavailable, match="locked"):
            await inbox.handle_in_transaction("c", "c", book)
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    autocommit_everywhere()

    # A two-phase claim on those connections commits by itself: another connection sees it.
    async def effect(payload: object) -> None:
        return None

    assert (await inbox.handle("d", "d", effect)).outcome is Outcome.PROCESSED
    reader = sqlite3.connect(path)
    try:
        rows = reader.execute("SELECT key, status FROM oncely_inbox ORDER BY key").fetchall()
        written = reader.execute("SELECT x FROM t ORDER BY x").fetchall()
    finally:
        reader.close()
    await store.aclose()
    assert rows == [("a", "completed"), ("d", "completed")]
    assert written == [("a",)]  # b rolled back with its marker; c never ran


_SLOW_SQL = (
    "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 3000000) "
    "SELECT count(*) FROM c"
)


async def test_r7_async_a_transaction_cancelled_while_its_statement_waits_records_nothing(
    tmp_path: Path,
) -> None:
    """aiosqlite runs a statement on the connection's thread even when the task awaiting it
    was cancelled. A transaction cancelled while its BEGIN or its claim still waits behind
    other work on that thread must neither commit its marker later (the handler never ran:
    its redelivery must run it) nor leave a transaction open on a pooled connection (the
    next message's claim would be rolled back with it)."""
    path = tmp_path / "o.db"
    store = oncely.AsyncSQLiteStore(path, pool_size=1)
    await store.migrate()
    inbox = oncely.AsyncInbox(store, consumer="c")
    ran: list[object] = []

    async def book(tx: object, payload: object) -> None:
        ran.append(payload)

    async def effect(payload: object) -> None:
        ran.append(payload)

    async def cancelled_behind_slow_work(call: object) -> None:
        await store.get("c", "warm")  # (re)opens the pool's only connection if needed
        (conn,) = store._pool._idle
        slow = asyncio.ensure_future(conn.execute_fetchall(_SLOW_SQL))  # busies its thread
        await asyncio.sleep(0.01)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(call, 0.05)  # type: ignore[arg-type]
        await slow  # the queued statement of the cancelled call runs after this

    # The inbox's own transaction: BEGIN travels with the claim's INSERT.
    await cancelled_behind_slow_work(inbox.handle_in_transaction("a", "a", book))
    # A transaction with its own BEGIN hop (store.transaction(), as claim_many uses it).
    await cancelled_behind_slow_work(
        store.claim_many(
            "c",
            [oncely.stores.ClaimRequest("b", None, "t")],
            lease_ms=1000,
            keep_ms=1000,
            takeover=True,
        )
    )
    # The next message on the pool: its claim must commit, nothing of a/b may have.
    assert (await inbox.handle("n", "n", effect)).outcome is Outcome.PROCESSED
    await asyncio.sleep(0.1)
    assert (await inbox.handle_in_transaction("a", "a", book)).outcome is Outcome.PROCESSED
    reader = sqlite3.connect(path)
    try:
        keys = reader.execute("SELECT key, status FROM oncely_inbox ORDER BY key").fetchall()
    finally:
        reader.close()
    await store.aclose()
    assert keys == [("a", "completed"), ("n", "completed")]
    assert ran == ["n", "a"]


async def test_r7_async_a_memory_store_keeps_its_database_after_a_cancelled_transaction() -> None:
    """A ``:memory:`` store's only connection is its whole database: a transaction
    cancelled while its claim waits on that connection's thread is rolled back behind it,
    and the connection, with every record, is kept."""
    store = oncely.AsyncSQLiteStore(":memory:")
    inbox = oncely.AsyncInbox(store, consumer="c")
    ran: list[object] = []

    async def book(tx: object, payload: object) -> None:
        ran.append(payload)

    assert (await inbox.handle_in_transaction("before", 1, book)).outcome is Outcome.PROCESSED
    (conn,) = store._pool._idle
    slow = asyncio.ensure_future(conn.execute_fetchall(_SLOW_SQL))
    await asyncio.sleep(0.01)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(inbox.handle_in_transaction("cut", 2, book), 0.05)
    await slow
    assert (await inbox.handle_in_transaction("before", 1, book)).outcome is Outcome.DUPLICATE
    assert await store.get("c", "cut") is None  # rolled back behind the slow statement
    assert (await inbox.handle_in_transaction("cut", 2, book)).outcome is Outcome.PROCESSED
    assert store._pool._idle == [conn]  # the same connection: the database is intact
    await store.aclose()
    assert ran == [1, 2]


async def test_r7_async_closing_right_after_a_cancelled_transaction_waits_for_its_rollback(
    tmp_path: Path,
) -> None:
    """A store closed while a cancelled transaction's connection is still settling waits for
    that rollback, then closes the connection: nothing of the message is left, and no task
    outlives the store."""
    path = tmp_path / "o.db"
    store = oncely.AsyncSQLiteStore(path, pool_size=1)
    await store.migrate()
    inbox = oncely.AsyncInbox(store, consumer="c")

    async def book(tx: object, payload: object) -> None:
        return None

    await store.get("c", "warm")
    (conn,) = store._pool._idle
    slow = asyncio.ensure_future(conn.execute_fetchall(_SLOW_SQL))
    await asyncio.sleep(0.01)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(inbox.handle_in_transaction("cut", 1, book), 0.05)
    assert store._pool._settling  # the rollback waits behind the slow statement
    await store.aclose()
    assert not store._pool._settling and not store._pool._idle
    await slow
    reader = sqlite3.connect(path)
    try:
        assert reader.execute("SELECT count(*) FROM oncely_inbox").fetchone() == (0,)
    finally:
        reader.close()


def test_r7_a_failed_transactional_attempt_reports_its_attempt_number(tmp_path: Path) -> None:
    # Before, a transactional ``failed`` reported attempt 0 (in the log and in Handled),
    # where a two-phase one reported 1.
    inbox = oncely.Inbox(oncely.open(f"sqlite:///{tmp_path / 'a.db'}"), consumer="c")

    def broken(tx: object, payload: object) -> None:
        raise RuntimeError("the ledger is down")

    assert inbox.handle_in_transaction("k", {}, broken).attempt == 1
    assert inbox.handle("k2", {}, lambda p: 1 / 0).attempt == 1
