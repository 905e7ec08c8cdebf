"""A SQLite store's first use: safe under concurrency, and never waiting on its caller's lock.

The first use of a store switches the file to WAL and creates the schema. On a file the
application made (rollback journal, no oncely tables), several processes do that at the same
moment, while the application writes too: SQLite answers ``PRAGMA journal_mode = WAL`` with
"database is locked" at once, without calling the busy handler, while another connection holds
the file's write lock (another switch, or a write of the application), so a single attempt
gives spurious outages (R8: every copy of a fleet must get its turn; R12: the store
sets itself up, the user does not hand-roll it). The first use inside a caller's own
``BEGIN IMMEDIATE`` (``handle_in_transaction(tx=conn)``) must not open a second connection that
waits for the lock that very transaction holds: it gets a typed, clear answer at once (the
project rule: bad input or a store that cannot serve gets a typed error, never a stall or a
driver exception).
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
from contextlib import closing
from datetime import timedelta
from pathlib import Path
from typing import Any

import aiosqlite
import pytest

import oncely
from oncely import Outcome
from tests.chaos.harness import Processes

WORKERS = 4
TRIALS = 30
CONSUMER = "fleet"
APP_WRITES = 20


def _application_file(path: Path, *, wal: bool = False) -> None:
    """A database the application made before any oncely: a table of its own, the default
    rollback journal (or WAL when ``wal``), no oncely tables."""
    with closing(sqlite3.connect(path, isolation_level=None)) as conn:
        if wal:
            conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("CREATE TABLE app (x INTEGER)")


def _journal_mode(path: Path) -> str:
    with closing(sqlite3.connect(path)) as conn:
        mode: str = conn.execute("PRAGMA journal_mode").fetchone()[0]
    return mode


def _rows(path: Path, sql: str) -> list[Any]:
    with closing(sqlite3.connect(path)) as conn:
        return conn.execute(sql).fetchall()


def _failure(exc: BaseException) -> str:
    return f"{type(exc).__module__}.{type(exc).__name__}: {exc}"


# ------------------------------------------------------------------ a fleet's cold start


def _deliver_sync(path: str, mode: str, worker: int) -> str:
    store = oncely.SQLiteStore(path)
    inbox = oncely.Inbox(store, consumer=CONSUMER)

    def book(tx: sqlite3.Connection, payload: int) -> None:
        tx.execute("INSERT INTO app (x) VALUES (?)", (payload,))

    try:
        if mode == "transactional":
            handled = inbox.handle_in_transaction(f"k{worker}", worker, book)
        else:
            handled = inbox.handle(f"k{worker}", worker, lambda payload: None)
        return handled.outcome.value
    except Exception as exc:
        return _failure(exc)
    finally:
        store.close()


async def _deliver_async(path: str, mode: str, worker: int) -> str:
    store = oncely.AsyncSQLiteStore(path)
    inbox = oncely.AsyncInbox(store, consumer=CONSUMER)

    async def book(tx: aiosqlite.Connection, payload: int) -> None:
        await tx.execute("INSERT INTO app (x) VALUES (?)", (payload,))

    async def effect(payload: int) -> None:
        return None

    try:
        if mode == "transactional":
            handled = await inbox.handle_in_transaction(f"k{worker}", worker, book)
        else:
            handled = await inbox.handle(f"k{worker}", worker, effect)
        return handled.outcome.value
    except Exception as exc:
        return _failure(exc)
    finally:
        await store.aclose()


def _application_writes(path: str, worker: int, errors: list[str]) -> None:
    """What the rest of the application does meanwhile: short write transactions of its own
    on the same file (on a rollback journal each holds the file's write lock for a while)."""
    try:
        with closing(sqlite3.connect(path, isolation_level=None, timeout=30)) as conn:
            for i in range(APP_WRITES):
                conn.execute("BEGIN IMMEDIATE")
                conn.execute("INSERT INTO app (x) VALUES (?)", (-1 - worker * APP_WRITES - i,))
                conn.execute("COMMIT")
    except sqlite3.Error as exc:
        errors.append(_failure(exc))


def _cold_start_worker(
    paths: list[str], flavour: str, mode: str, worker: int, start_line: Any, out: str
) -> None:
    """One process of the fleet: for each trial's fresh file, wait for the others at the start
    line, then open a store on it and handle a first message, while a thread of the same
    process writes to the application's own table. The process lives across the trials
    (starting an interpreter per trial would spread the starts out)."""
    seen: list[str] = []
    app_errors: list[str] = []

    def application(path: str) -> threading.Thread:
        thread = threading.Thread(target=_application_writes, args=(path, worker, app_errors))
        thread.start()
        return thread

    if flavour == "sync":
        for path in paths:
            start_line.wait(60)
            thread = application(path)
            seen.append(_deliver_sync(path, mode, worker))
            thread.join()
    else:

        async def run() -> None:
            for path in paths:
                start_line.wait(60)  # (blocks the loop: nothing else runs on it meanwhile)
                thread = application(path)
                seen.append(await _deliver_async(path, mode, worker))
                thread.join()

        asyncio.run(run())
    Path(out).write_text(json.dumps({"seen": seen, "app_errors": app_errors}))


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["transactional", "two_phase"])
@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_r8_r12_a_fleet_cold_starting_on_an_application_file_has_no_spurious_outage(
    tmp_path: Path, flavour: str, mode: str
) -> None:
    """R8, R12: four processes released together on a fresh rollback-journal file the
    application made each handle their first message while the application writes to its own
    table in each of them: every message is processed (none gets ``StoreUnavailable: switching
    to WAL: database is locked`` or a schema race), the file ends in WAL with one schema and
    every write, and each of the trials starts again on a fresh file. (Before the fix about
    half the trials had a worker fail.)"""
    paths = [tmp_path / f"app{trial}.db" for trial in range(TRIALS)]
    for path in paths:
        _application_file(path)
    outs = [tmp_path / f"worker{n}.json" for n in range(WORKERS)]
    procs = Processes()
    start_line = procs.ctx.Barrier(WORKERS)
    try:
        started = [
            procs.start(
                _cold_start_worker,
                [str(p) for p in paths],
                flavour,
                mode,
                n,
                start_line,
                str(outs[n]),
                name=f"cold{n}",
            )
            for n in range(WORKERS)
        ]
        for process in started:
            process.join(240)
        codes = [process.exitcode for process in started]
    finally:
        procs.reap()
    assert codes == [0] * WORKERS
    reports = [json.loads(out.read_text()) for out in outs]
    assert [r["app_errors"] for r in reports] == [[]] * WORKERS
    seen = [r["seen"] for r in reports]
    failures = [
        (trial, worker, outcome)
        for worker, outcomes in enumerate(seen)
        for trial, outcome in enumerate(outcomes)
        if outcome != Outcome.PROCESSED.value
    ]
    failed_trials = sorted({trial for trial, _, _ in failures})
    assert not failures, f"{len(failed_trials)} of {TRIALS} trials failed: {failures}"
    keys = [(f"k{n}", "completed") for n in range(WORKERS)]
    for path in paths:
        assert _journal_mode(path) == "wal"
        assert _rows(path, "SELECT key, status FROM oncely_inbox ORDER BY key") == keys
        meta = _rows(path, "SELECT name, value FROM oncely_inbox_meta ORDER BY name")
        assert meta == [("revision", "3"), ("schema_version", "2")]
        assert _rows(path, "SELECT count(*) FROM app WHERE x < 0") == [(WORKERS * APP_WRITES,)]
        if mode == "transactional":
            written = _rows(path, "SELECT x FROM app WHERE x >= 0 ORDER BY x")
            assert written == [(n,) for n in range(WORKERS)]


# ------------------------------------------------------------------ another connection's lock


class _Holder:
    """Another connection of the application in the middle of a write transaction on the file
    (its RESERVED lock: SQLite then refuses the switch to WAL at once, busy handler or not),
    rolled back from a timer thread, or at the end of the test."""

    def __init__(self, path: Path) -> None:
        self.conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self.conn.execute("BEGIN IMMEDIATE")
        self.conn.execute("INSERT INTO app (x) VALUES (0)")
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None

    def release_after(self, seconds: float) -> None:
        self._timer = threading.Timer(seconds, self.release)
        self._timer.start()

    def release(self) -> None:
        with self._lock:
            if self.conn.in_transaction:
                self.conn.execute("ROLLBACK")

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer.join()
        self.release()
        self.conn.close()


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_r12_the_wal_switch_waits_for_another_connections_write_to_end(
    tmp_path: Path, flavour: str
) -> None:
    """R12: the first use while another connection writes to the rollback-journal file does
    not fail at once (SQLite does not wait by itself for the switch to WAL): it tries again,
    backing off, and succeeds once the writer is done."""
    path = tmp_path / "app.db"
    _application_file(path)
    holder = _Holder(path)
    holder.release_after(0.5)
    settings = oncely.SQLiteSettings(busy_timeout=timedelta(seconds=20))
    try:
        if flavour == "sync":
            store = oncely.SQLiteStore(path, settings=settings)
            outcome = oncely.Inbox(store, consumer="c").handle("k", 1, lambda p: None).outcome
            store.close()
        else:

            async def first() -> Outcome:
                store = oncely.AsyncSQLiteStore(path, settings=settings)

                async def effect(payload: int) -> None:
                    return None

                try:
                    return (
                        await oncely.AsyncInbox(store, consumer="c").handle("k", 1, effect)
                    ).outcome
                finally:
                    await store.aclose()

            outcome = asyncio.run(first())
    finally:
        holder.close()
    assert outcome is Outcome.PROCESSED
    assert _journal_mode(path) == "wal"


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_r12_a_lock_held_past_the_busy_timeout_is_store_unavailable(
    tmp_path: Path, flavour: str
) -> None:
    """R12: the retries of the WAL switch are bounded by the busy timeout; then the first use
    is a typed ``StoreUnavailable`` that names the step (nothing acknowledged: retry later),
    never a sqlite3 exception, and the next use, once the lock is gone, succeeds."""
    path = tmp_path / "app.db"
    _application_file(path)
    holder = _Holder(path)
    settings = oncely.SQLiteSettings(busy_timeout=timedelta(milliseconds=300))
    try:
        if flavour == "sync":
            store = oncely.SQLiteStore(path, settings=settings)
            with pytest.raises(oncely.StoreUnavailable, match="WAL") as raised:
                store.get("c", "k")
            holder.release()
            assert store.get("c", "k") is None
            store.close()
        else:

            async def first() -> None:
                store = oncely.AsyncSQLiteStore(path, settings=settings)
                try:
                    with pytest.raises(oncely.StoreUnavailable, match="WAL") as raised:
                        await store.get("c", "k")
                    assert not isinstance(raised.value, sqlite3.Error)
                    holder.release()
                    assert await store.get("c", "k") is None
                finally:
                    await store.aclose()

            asyncio.run(first())
            return
    finally:
        holder.close()
    assert not isinstance(raised.value, sqlite3.Error)
    assert _journal_mode(path) == "wal"


# ------------------------------------------------------------------ inside the caller's BEGIN

_SHORT = oncely.SQLiteSettings(busy_timeout=timedelta(seconds=2))  # (a stall stays short)


def _prepare(path: Path, state: str) -> None:
    """``fresh``: the application's rollback-journal file, no oncely tables; ``wal``: the same
    in WAL; ``migrated``: oncely's tables there, the file switched back to a rollback journal."""
    _application_file(path, wal=state == "wal")
    if state == "migrated":
        store = oncely.SQLiteStore(path)
        store.migrate()
        store.close()
        with closing(sqlite3.connect(path, isolation_level=None)) as conn:
            conn.execute("PRAGMA journal_mode = DELETE")
        assert _journal_mode(path) == "delete"


def _joined_sync(path: Path, *, migrate: bool) -> tuple[str, bool, list[Any]]:
    """The first use of a store is ``handle_in_transaction(tx=conn)`` inside the caller's
    ``BEGIN IMMEDIATE`` that already wrote: what came of it, whether the caller's transaction
    was still open afterwards, and what the caller's commit kept."""
    store = oncely.SQLiteStore(path, settings=_SHORT, migrate=migrate)
    inbox = oncely.Inbox(store, consumer="c")

    def book(tx: sqlite3.Connection, payload: int) -> None:
        tx.execute("INSERT INTO app (x) VALUES (2)")

    conn = sqlite3.connect(path, isolation_level=None, timeout=2)
    try:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("INSERT INTO app (x) VALUES (1)")
        try:
            result = inbox.handle_in_transaction("k", 1, book, tx=conn).outcome.value
        except Exception as exc:
            result = _failure(exc)
        still_open = conn.in_transaction
        if still_open:
            conn.execute("COMMIT")
    finally:
        conn.close()
        store.close()
    return result, still_open, _rows(path, "SELECT x FROM app ORDER BY x")


async def _joined_async(path: Path, *, migrate: bool) -> tuple[str, bool, list[Any]]:
    """:func:`_joined_sync` on the asyncio store, with an aiosqlite connection of the caller's."""
    store = oncely.AsyncSQLiteStore(path, settings=_SHORT, migrate=migrate)
    inbox = oncely.AsyncInbox(store, consumer="c")

    async def book(tx: aiosqlite.Connection, payload: int) -> None:
        await tx.execute("INSERT INTO app (x) VALUES (2)")

    conn = await aiosqlite.connect(path, isolation_level=None, timeout=2)
    try:
        await conn.execute("BEGIN IMMEDIATE")
        await conn.execute("INSERT INTO app (x) VALUES (1)")
        try:
            result = (await inbox.handle_in_transaction("k", 1, book, tx=conn)).outcome.value
        except Exception as exc:
            result = _failure(exc)
        still_open = conn.in_transaction
        if still_open:
            await conn.execute("COMMIT")
    finally:
        await conn.close()
        await store.aclose()
    return result, still_open, _rows(path, "SELECT x FROM app ORDER BY x")


def _joined(path: Path, flavour: str, *, migrate: bool = True) -> tuple[str, bool, list[Any]]:
    if flavour == "sync":
        return _joined_sync(path, migrate=migrate)
    return asyncio.run(_joined_async(path, migrate=migrate))


@pytest.mark.parametrize("migrate", [True, False])
@pytest.mark.parametrize("state", ["fresh", "wal"])
@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_r7_r12_first_use_in_the_callers_transaction_without_tables_is_schema_missing_at_once(
    tmp_path: Path, flavour: str, state: str, migrate: bool
) -> None:
    """R7, R12: the tables cannot be created while the caller's own transaction holds the write
    lock (another connection would wait for it until the busy timeout) and oncely does not slip
    its DDL into the caller's transaction: the first use is a typed ``SchemaMissing`` at once,
    telling to run ``oncely migrate`` first, and the caller's transaction is left open and
    intact. After ``migrate`` (which also switches the file to WAL) the same call works."""
    path = tmp_path / "app.db"
    _prepare(path, state)
    result, still_open, kept = _joined(path, flavour, migrate=migrate)
    assert result.startswith("oncely.errors.SchemaMissing:"), result
    assert "oncely migrate" in result
    if migrate:  # why oncely, told to create them, does not
        assert "transaction" in result
    assert still_open and kept == [(1,)]  # the caller's own write committed; nothing of oncely's
    assert _rows(path, "SELECT name FROM sqlite_master WHERE name LIKE 'oncely%'") == []

    store = oncely.SQLiteStore(path)
    assert store.migrate() == 2
    store.close()
    assert _journal_mode(path) == "wal"
    result, still_open, kept = _joined(path, flavour, migrate=migrate)
    assert (result, still_open, kept) == ("processed", True, [(1,), (1,), (2,)])
    assert _rows(path, "SELECT key, status FROM oncely_inbox") == [("k", "completed")]


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_r7_r12_first_use_in_the_callers_transaction_on_a_rollback_journal_file_with_tables(
    tmp_path: Path, flavour: str
) -> None:
    """R7, R12: the tables are there but the file is not in WAL (and cannot be switched inside
    a transaction): the claim joins the caller's transaction as usual, in whatever journal
    mode the file has (SQLite's lock arbitrates the same in both), without waiting on the
    caller's lock; the store's first connection of its own switches the file to WAL later."""
    path = tmp_path / "app.db"
    _prepare(path, "migrated")
    result, still_open, kept = _joined(path, flavour)
    assert (result, still_open, kept) == ("processed", True, [(1,), (2,)])
    assert _rows(path, "SELECT key, status FROM oncely_inbox") == [("k", "completed")]
    assert _journal_mode(path) == "delete"
    store = oncely.SQLiteStore(path)
    record = store.get("c", "k")
    store.close()
    assert record is not None and record.status is oncely.Status.COMPLETED
    assert _journal_mode(path) == "wal"
