"""The purge index arrives by an online migration that keeps every record (R13, R20).

A table of revision 1 (no ``purge_ms``: every table oncely created before the purge index),
populated with completed, expired, in-progress and failed records, is refused by this oncely
with the command to run; ``migrate`` brings it to revision 2; afterwards every record is read
by ``Inbox.handle`` as before (a duplicate gets the stored result), rows an older oncely writes
(no ``purge_ms``: the column's default) are purged like the others, and the first purge deletes
what expired and moves every unexpired old row to its minute, so the next purge has nothing to
look at.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import psycopg
import pytest

import oncely
from oncely.stores._compact import unpack_fingerprint, unpack_token
from oncely.stores._sql import purge_bucket
from oncely.stores.mysql import MySQLStore
from oncely.stores.postgres import PostgresStore
from oncely.stores.sqlite import SQLiteStore
from tests.backends import BACKENDS, Scope
from tests.backends.mysql import sql as mysql_sql
from tests.backends.mysql import table_name as mysql_table_name
from tests.backends.mysql import url as mysql_url
from tests.backends.postgres import table_name
from tests.cli.helpers import run
from tests.services import POSTGRES_DSN

LONG = 3_600_000


class Raw:
    """SQL on the store's table, bypassing oncely: what an older oncely's table and its
    writes look like."""

    def __init__(
        self, run: Callable[[str, tuple[Any, ...]], list[tuple[Any, ...]]], t: str, meta: str
    ) -> None:
        self.run, self.t, self.meta = run, t, meta
        self.key = "`key`" if t.startswith("`") else "key"

    def to_revision_1(self, index: str) -> None:
        if index:
            self.run(f"DROP INDEX {index}", ())
        self.run(f"ALTER TABLE {self.t} DROP COLUMN purge_ms", ())
        self.to_version_1()
        self.run(f"DELETE FROM {self.meta} WHERE name = 'revision'", ())

    def to_version_1(self) -> None:
        """Schema version 1 (revision 2), as an older oncely left it: every token and
        fingerprint as its text (the SQLite and MariaDB stores keep bytes since version 2)."""
        rows = self.run(f"SELECT consumer, {self.key}, token, fingerprint FROM {self.t}", ())
        for consumer, key, token, fingerprint in rows:
            self.run(
                f"UPDATE {self.t} SET token = %s, fingerprint = %s "
                f"WHERE consumer = %s AND {self.key} = %s",
                (unpack_token(token), unpack_fingerprint(fingerprint), consumer, key),
            )
        self.run(f"UPDATE {self.meta} SET value = '1' WHERE name = 'schema_version'", ())
        self.run(f"UPDATE {self.meta} SET value = '2' WHERE name = 'revision'", ())

    def insert_as_older_oncely(self, key: str, expires_ms: int) -> None:
        self.run(
            f"INSERT INTO {self.t} (consumer, {self.key}, status, fingerprint, token, attempt, "
            "created_ms, updated_ms, lease_until_ms, expires_ms, result, error) "
            "VALUES ('c', %s, 'completed', NULL, 'old', 1, 1, 1, 1, %s, NULL, NULL)",
            (key, expires_ms),
        )

    def behind(self) -> int:
        """Unexpired rows whose purge_ms is behind their expiry's minute."""
        rows = self.run(f"SELECT expires_ms, purge_ms FROM {self.t}", ())
        now = time.time_ns() // 1_000_000
        return sum(1 for e, p in rows if e > now and p < purge_bucket(e))


Opener = Callable[[bool], oncely.Store]


def _postgres(scope: Scope) -> tuple[Opener, Raw, str]:
    BACKENDS["postgres"].make_sync(scope, None).close()  # registers the table's drop
    t = table_name(scope)

    def store(migrate: bool) -> oncely.Store:
        return PostgresStore(POSTGRES_DSN, table=t, migrate=migrate)

    def run(sql: str, params: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        with psycopg.connect(POSTGRES_DSN, autocommit=True) as conn:
            cursor = conn.execute(sql.encode(), params or None)
            return cursor.fetchall() if cursor.description else []

    return store, Raw(run, f'"{t}"', f'"{t}_meta"'), f'"{t}_purge"'


def _sqlite(scope: Scope) -> tuple[Opener, Raw, str]:
    path = scope.tmp_path / "oncely.db"

    def store(migrate: bool) -> oncely.Store:
        return SQLiteStore(path, migrate=migrate)

    def run(sql: str, params: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        conn = sqlite3.connect(str(path), isolation_level=None)
        try:
            return conn.execute(sql.replace("%s", "?"), params).fetchall()
        finally:
            conn.close()

    return store, Raw(run, "oncely_inbox", "oncely_inbox_meta"), '"oncely_inbox_purge"'


def _mysql(scope: Scope) -> tuple[Opener, Raw, str]:
    BACKENDS["mysql"].make_sync(scope, None).close()  # registers the table's drop
    t = mysql_table_name(scope)

    def store(migrate: bool) -> oncely.Store:
        return MySQLStore.from_url(mysql_url(t, migrate=str(migrate).lower()))

    def run(sql: str, params: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        return [tuple(row) for row in mysql_sql(sql.replace('"', "`"), params or None)]

    class MySQLRaw(Raw):
        def to_revision_1(self, index: str) -> None:
            self.run(f"ALTER TABLE {self.t} DROP INDEX {index}", ())
            super().to_revision_1("")

        def to_version_1(self) -> None:
            """Also the purge index of revision 2: the minute alone."""
            index = f"`{t}_purge`"
            if self.purge_index():
                self.run(
                    f"ALTER TABLE {self.t} DROP INDEX {index}, ADD INDEX {index} (purge_ms)", ()
                )
            super().to_version_1()

        def purge_index(self) -> list[str]:
            return [
                str(c)
                for (c,) in self.run(
                    "SELECT column_name FROM information_schema.statistics WHERE "
                    "table_schema = DATABASE() AND table_name = %s AND index_name = %s "
                    "ORDER BY seq_in_index",
                    (t, f"{t}_purge"),
                )
            ]

    return store, MySQLRaw(run, f"`{t}`", f"`{t}_meta`"), f"`{t}_purge`"


STORES = {"mysql": _mysql, "postgres": _postgres, "sqlite": _sqlite}


@pytest.mark.parametrize("name", sorted(STORES))
def test_r13_a_revision_1_table_migrates_online_and_keeps_every_record(
    name: str, scope: Scope
) -> None:
    BACKENDS[name].require()
    open_store, raw, index = STORES[name](scope)
    store = open_store(True)
    store.migrate()
    inbox = oncely.Inbox(store, consumer="c", retention=oncely.Retention(keep=timedelta(hours=1)))
    for i in range(50):
        first = inbox.handle(f"done-{i}", {"n": i}, lambda p: {"paid": p["n"]})
        assert first.outcome.value == "processed"
    for i in range(20):
        store.claim("c", f"running-{i}", fingerprint=None, token=f"r{i}", lease_ms=60_000,
                    keep_ms=LONG, takeover=False)  # fmt: skip
        store.claim("c", f"old-{i}", fingerprint=None, token=f"o{i}", lease_ms=60_000,
                    keep_ms=LONG, takeover=False)  # fmt: skip
        store.complete("c", f"old-{i}", token=f"o{i}", result=None, keep_ms=1)
    store.close()
    raw.to_revision_1(index)

    store = open_store(False)
    with pytest.raises(oncely.SchemaOutdated, match="oncely migrate"):
        store.get("c", "done-0")
    store.migrate()
    now = time.time_ns() // 1_000_000
    for i in range(10):  # an older oncely, still running, writes rows without purge_ms
        raw.insert_as_older_oncely(f"legacy-live-{i}", now + LONG)
        raw.insert_as_older_oncely(f"legacy-gone-{i}", now - 1)
    assert raw.behind() == 50 + 20 + 10  # every unexpired row predates the column

    inbox = oncely.Inbox(store, consumer="c")
    for i in range(50):
        again = inbox.handle(f"done-{i}", {"n": i}, lambda p: pytest.fail("ran twice"))
        assert (again.outcome.value, again.value) == ("duplicate", {"paid": i})
    busy = inbox.handle("running-3", {"n": 3}, lambda p: pytest.fail("ran while in flight"))
    assert busy.outcome.value == "in_flight"

    assert store.purge_expired(batch_size=7) == 20 + 10  # old-* and legacy-gone-*
    assert raw.behind() == 0  # moved to their minute: the next purge looks at none of them
    assert store.purge_expired() == 0
    assert store.get("c", "legacy-live-4") is not None
    assert all(store.get("c", f"old-{i}") is None for i in range(20))
    record = store.get("c", "done-7")
    assert record is not None and json.loads(record.result or b"") == {"paid": 7}
    store.close()


def _migrate_at_once(
    store: oncely.Store, together: threading.Barrier, failures: list[BaseException]
) -> None:
    together.wait()
    try:
        store.migrate()
    except BaseException as exc:
        failures.append(exc)


@pytest.mark.parametrize("name", sorted(STORES))
def test_r13_migrations_started_at_once_all_succeed(name: str, scope: Scope) -> None:
    """Several processes that upgrade one revision 1 table at the same moment (a fleet
    deployed at once, each opened with ``migrate=True``, or ``oncely migrate`` run twice)
    take turns: every one succeeds, the second finding the work done. On PostgreSQL a
    migrator waiting for the lock must not hold a transaction open, which the other's
    ``CREATE INDEX CONCURRENTLY`` would wait for (a deadlock); on MariaDB the check for the
    column and the ``ALTER TABLE`` that adds it must not interleave with another's."""
    BACKENDS[name].require()
    open_store, raw, index = STORES[name](scope)
    for _ in range(4):
        store = open_store(True)
        store.migrate()
        store.claim("c", "k", fingerprint=None, token="t", lease_ms=60_000, keep_ms=LONG,
                    takeover=False)  # fmt: skip
        store.complete("c", "k", token="t", result=b'{"paid": 1}', keep_ms=LONG)
        store.close()
        raw.to_revision_1(index)
        stores = [open_store(False) for _ in range(5)]
        together = threading.Barrier(len(stores))
        failures: list[BaseException] = []

        threads = [
            threading.Thread(target=_migrate_at_once, args=(each, together, failures))
            for each in stores
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for each in stores:
            each.close()
        assert not failures, failures
        store = open_store(False)
        again = oncely.Inbox(store, consumer="c").handle("k", None, lambda p: pytest.fail("ran"))
        assert (again.outcome.value, again.value) == ("duplicate", {"paid": 1})
        store.close()


def test_r13_oncely_migrate_says_it_upgraded_a_revision(scope: Scope) -> None:
    """`oncely migrate` of a PostgreSQL table at revision 1 adds the purge column and builds
    its index (minutes on a large table) within schema version 1: it says so, not that the
    schema was "already in place"; run again, it says that."""
    BACKENDS["postgres"].require()
    open_store, raw, index = _postgres(scope)
    store = open_store(True)
    store.migrate()
    store.close()
    raw.to_revision_1(index)
    sep = "&" if "?" in POSTGRES_DSN else "?"
    url = f"{POSTGRES_DSN}{sep}table={table_name(scope)}"
    first = run("migrate", "--store", url)
    assert first.exit_code == 0, first.stderr
    assert "schema version 1 upgraded from revision 1 to 2" in first.stdout
    again = run("migrate", "--store", url)
    assert again.exit_code == 0, again.stderr
    assert "already in place" in again.stdout
