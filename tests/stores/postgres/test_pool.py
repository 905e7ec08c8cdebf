"""Pools and process lifetime: a pool heals after its connections are killed, a forked
child opens its own, and a store nobody closed never keeps a process alive.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import psycopg
import pytest

import oncely
from oncely import Outcome
from oncely.stores.postgres.sync_store import PostgresStore
from tests.services import POSTGRES_DSN
from tests.stores.postgres.helpers import _sql


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


@pytest.mark.parametrize("lock", ["_keep_lock", "_ready_lock"])
def test_a_fork_while_another_thread_holds_a_store_lock_does_not_hang_the_child(
    store: PostgresStore, lock: str
) -> None:
    """A thread of the parent (a heartbeat renewing a lease, another consumer thread) holds
    these locks briefly on every operation; a fork at that moment left the lock held forever
    in the child, whose first message then waited for it. A thread holds it across the fork
    here; the child (killed by an alarm if it hangs) must answer."""
    inbox = oncely.Inbox(store, consumer="c")
    assert inbox.handle("from-parent", 1, lambda p: 1).outcome is Outcome.PROCESSED
    holding, done = threading.Event(), threading.Event()

    def hold() -> None:
        with getattr(store, lock):
            holding.set()
            done.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    assert holding.wait(5)
    read, write = os.pipe()
    try:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            try:
                signal.alarm(10)
                outcome = inbox.handle("child-key", 1, lambda p: 3).outcome.value
                os.write(write, outcome.encode())
            finally:
                os._exit(0)
        os.close(write)
        os.waitpid(pid, 0)
    finally:
        done.set()
        holder.join(10)
    with os.fdopen(read) as pipe:
        assert pipe.read() == "processed"
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


# ------------------------------------------------------------------ kept connections


def _requests(store: PostgresStore) -> int:
    """How many connections the store has asked its psycopg_pool for so far."""
    assert store._pool is not None
    return store._pool.get_stats().get("requests_num", 0)


def test_one_caller_reuses_a_kept_connection_without_asking_the_pool(table: str) -> None:
    store = PostgresStore(POSTGRES_DSN, table=table, pool_max=4)
    inbox = oncely.Inbox(store, consumer="c")
    for i in range(5):
        assert inbox.handle(f"warm-{i}", 1, lambda p: p).outcome is Outcome.PROCESSED
    before = _requests(store)
    for i in range(50):  # claim + complete, then a duplicate: 150 operations
        assert inbox.handle(f"k-{i}", 1, lambda p: p).outcome is Outcome.PROCESSED
        assert inbox.handle(f"k-{i}", 1, lambda p: p).outcome is Outcome.DUPLICATE
    assert _requests(store) == before
    store.close()


def test_kept_connections_go_back_to_the_pool_once_their_time_is_up(
    table: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """So the pool's checks and max_lifetime still reach them (see PostgresStore._release)."""
    monkeypatch.setattr("oncely.stores.postgres.sync_store._KEEP_SECONDS", 0.5)
    store = PostgresStore(POSTGRES_DSN, table=table, pool_max=4)
    inbox = oncely.Inbox(store, consumer="c")
    inbox.handle("warm", 1, lambda p: p)
    before = _requests(store)
    for i in range(5):
        inbox.handle(f"kept-{i}", 1, lambda p: p)
    assert _requests(store) == before
    time.sleep(0.6)
    # The claim's release finds the time up and hands the connection back; the completion
    # takes one from the pool, and it is kept again.
    inbox.handle("handed-back", 1, lambda p: p)
    for i in range(5):
        inbox.handle(f"kept-again-{i}", 1, lambda p: p)
    assert _requests(store) == before + 1
    store.close()


def test_threads_sharing_a_store_keep_at_most_pool_max_connections(table: str) -> None:
    store = PostgresStore(POSTGRES_DSN, table=table, pool_max=3)
    inbox = oncely.Inbox(store, consumer="c")
    errors: list[BaseException] = []

    def work(n: int) -> None:
        try:
            for i in range(60):
                key = f"t{n}-{i % 20}"
                outcome = inbox.handle(key, 1, lambda p: p).outcome
                assert outcome in (Outcome.PROCESSED, Outcome.DUPLICATE), outcome
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert store._pool is not None
    assert len(store._idle) <= 3
    assert len({id(conn) for conn in store._idle}) == len(store._idle)  # none kept twice
    assert store._pool.get_stats()["pool_max"] == 3
    store.close()


def test_only_connections_the_store_holds_alone_reuse_its_cursor(table: str) -> None:
    """The store reuses one cursor per connection it checked out of its pool (creating a
    psycopg cursor costs more than a sixth of a duplicate's claim), but never on a caller's
    connection (tx=), which other threads may share, and it forgets the cursor when the
    connection goes back to a pool, also to a pool of the caller's."""
    from psycopg_pool import ConnectionPool

    from oncely.stores.postgres import sync_io as _postgres_io

    store = PostgresStore(POSTGRES_DSN, table=table, pool_max=1)
    inbox = oncely.Inbox(store, consumer="c")
    try:
        assert inbox.handle("k", 1, lambda p: "r").outcome is Outcome.PROCESSED
        (kept,) = store._idle
        cursor = _postgres_io._OWN[kept]
        assert inbox.handle("k", 1, lambda p: "r").outcome is Outcome.DUPLICATE
        assert store._idle == [kept] and _postgres_io._OWN[kept] is cursor  # reused
        with psycopg.connect(POSTGRES_DSN) as mine:
            assert inbox.handle_in_transaction("t", 1, lambda tx, p: None, tx=mine).ok
            assert mine not in _postgres_io._OWN
            mine.commit()
    finally:
        store.close()
    assert kept not in _postgres_io._OWN  # handed back to the pool at close

    pool = ConnectionPool(POSTGRES_DSN, min_size=1, max_size=1, open=True)
    try:
        given = PostgresStore(pool, table=table)
        assert oncely.Inbox(given, consumer="c").handle("k", 1, lambda p: "x").value == "r"
        with pool.connection() as lent:  # the caller's pool: the store kept nothing of it
            assert lent not in _postgres_io._OWN
        given.close()
    finally:
        pool.close()


# ------------------------------------------------------------------ a read-only spell


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_the_store_writes_again_once_a_read_only_spell_ends(flavour: str) -> None:
    """The database turns read-only (what a failover does while a standby is promoted, or
    ``default_transaction_read_only`` set by an operator) and its connections are replaced
    meanwhile: the new ones start read-only and stay so, since a session keeps the default
    it opened with. Calls during the spell fail with StoreUnavailable; once the database is
    writable again (its sessions left running), the store renews its connections and
    writes: the last ten calls are processed."""
    database = f"oncely_ro_{uuid.uuid4().hex[:8]}"
    app = f"oncely_ro_{uuid.uuid4().hex[:8]}"
    _sql(f'CREATE DATABASE "{database}"')
    base, _, _ = POSTGRES_DSN.rpartition("/")
    url = f"{base}/{database}?pool_min=2&pool_max=2&application_name={app}"

    def spell(on: bool) -> None:
        if on:
            _sql(f'ALTER DATABASE "{database}" SET default_transaction_read_only = on')
            _sql("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s",
                 database)  # fmt: skip
        else:
            _sql(f'ALTER DATABASE "{database}" RESET default_transaction_read_only')

    def run_sync() -> list[str]:
        store = oncely.open(url)
        inbox = oncely.Inbox(store, consumer="c")
        seen: list[str] = []
        try:
            for i in range(5):
                seen.append(inbox.handle(f"before-{i}", 1, lambda p: p).outcome.value)
            for phase, n in (("during", 10), ("after", 40)):
                spell(phase == "during")
                for i in range(n):
                    try:
                        seen.append(inbox.handle(f"{phase}-{i}", 1, lambda p: p).outcome.value)
                    except oncely.StoreUnavailable:
                        seen.append("unavailable")
                    time.sleep(0.05)
        finally:
            store.close()
        return seen

    async def run_async() -> list[str]:
        store = oncely.open_async(url)
        inbox = oncely.AsyncInbox(store, consumer="c")

        async def handler(payload: object) -> object:
            return payload

        seen: list[str] = []
        try:
            for i in range(5):
                seen.append((await inbox.handle(f"before-{i}", 1, handler)).outcome.value)
            for phase, n in (("during", 10), ("after", 40)):
                await asyncio.to_thread(spell, phase == "during")
                for i in range(n):
                    try:
                        handled = await inbox.handle(f"{phase}-{i}", 1, handler)
                        seen.append(handled.outcome.value)
                    except oncely.StoreUnavailable:
                        seen.append("unavailable")
                    await asyncio.sleep(0.05)
        finally:
            await store.aclose()
        return seen

    try:
        seen = run_sync() if flavour == "sync" else asyncio.run(run_async())
    finally:
        _sql("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s",
             database)  # fmt: skip
        _sql(f'DROP DATABASE IF EXISTS "{database}"')
    assert seen[:5] == ["processed"] * 5
    assert "unavailable" in seen[5:15], seen  # the spell was real
    assert seen[-10:] == ["processed"] * 10, seen
