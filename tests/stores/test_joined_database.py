"""A connection given as ``tx=`` must be on the store's database (R7).

Before, ``handle_in_transaction(tx=conn)`` never looked at which database ``conn`` was on: with
the inbox table there too (a tenant's database, a staging copy), the marker committed in that
database, where the store never reads it, and the outcome was ``processed``; every redelivery
then ran the handler again. Now a connection to another database is refused with
``ConfigurationError`` naming both, before anything is written; one to the store's database
is accepted, by every SQL store, threaded and asyncio. Real servers: PostgreSQL (another
database on the same server), MariaDB (another schema), SQLite (another file).
"""

from __future__ import annotations

import asyncio
import sqlite3
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiomysql
import aiosqlite
import psycopg
import psycopg.rows
import pymysql
import pymysql.cursors
import pytest

import oncely
from tests.services import MYSQL_URL, POSTGRES_DSN, require

OTHER_MYSQL = "oncely_joined_other"


def _pg_on(database: str) -> str:
    return POSTGRES_DSN.rsplit("/", 1)[0] + f"/{database}"


def _mysql_args(database: str, name: str = "database") -> dict[str, Any]:
    """PyMySQL's arguments (aiomysql calls the database ``db``)."""
    return {"host": "127.0.0.1", "port": 3306, "user": "root", "password": "", name: database}


@pytest.fixture
def table() -> str:
    return f"oncely_jd_{uuid.uuid4().hex[:10]}"


@pytest.fixture
def family(request: pytest.FixtureRequest, tmp_path: Path, table: str) -> Iterator[dict[str, Any]]:
    """The store's URL on the test database and another database's, each with the inbox
    table, and how to open a caller's connection (threaded and asyncio) to each."""
    name = request.param
    if name == "sqlite":
        here, there = tmp_path / "here.db", tmp_path / "there.db"

        async def asqlite(path: Path) -> Any:
            conn = await aiosqlite.connect(path, isolation_level=None)
            await conn.execute("BEGIN")
            return conn

        def sqlite(path: Path) -> Any:
            conn = sqlite3.connect(path, isolation_level=None)
            conn.execute("BEGIN")
            return conn

        yield {
            "urls": (f"sqlite:///{here}", f"sqlite:///{there}"),
            "sync": lambda which: sqlite(here if which == "here" else there),
            "async": lambda which: asqlite(here if which == "here" else there),
            "close_async": lambda conn: conn.close(),
        }
        return
    if name == "postgres":
        require("PostgreSQL", POSTGRES_DSN, 5432)
        here, there = POSTGRES_DSN, _pg_on("postgres")

        async def apg(which: str) -> Any:
            return await psycopg.AsyncConnection.connect(here if which == "here" else there)

        yield {
            "urls": (f"{here}?table={table}", f"{there}?table={table}"),
            "sync": lambda which: psycopg.connect(here if which == "here" else there),
            "async": apg,
            "close_async": lambda conn: conn.close(),
        }
        for dsn in (here, there):
            with psycopg.connect(dsn, autocommit=True) as conn:
                for suffix in ("", "_meta", "_offsets"):
                    conn.execute(f'DROP TABLE IF EXISTS "{table}{suffix}"')
        return
    require("MariaDB", MYSQL_URL, 3306)
    with pymysql.connect(**_mysql_args("test"), autocommit=True) as conn, conn.cursor() as cur:
        cur.execute(f"CREATE DATABASE IF NOT EXISTS `{OTHER_MYSQL}`")

    def my(which: str) -> Any:
        conn = pymysql.connect(**_mysql_args("test" if which == "here" else OTHER_MYSQL))
        conn.begin()
        return conn

    async def amy(which: str) -> Any:
        database = "test" if which == "here" else OTHER_MYSQL
        conn = await aiomysql.connect(**_mysql_args(database, "db"))
        await conn.begin()
        return conn

    base = MYSQL_URL.rsplit("/", 1)[0]
    yield {
        "urls": (f"{base}/test?table={table}", f"{base}/{OTHER_MYSQL}?table={table}"),
        "sync": my,
        "async": amy,
        "close_async": lambda conn: conn.ensure_closed(),
    }
    for database in ("test", OTHER_MYSQL):
        admin = pymysql.connect(**_mysql_args(database), autocommit=True)
        with admin as conn, conn.cursor() as cur:
            for suffix in ("", "_meta", "_offsets"):
                cur.execute(f"DROP TABLE IF EXISTS `{table}{suffix}`")


FAMILIES = pytest.mark.parametrize("family", ["sqlite", "postgres", "mysql"], indirect=True)


def _write(conn: Any) -> None:
    """The handler: it writes nothing; what matters is where the marker goes."""


@FAMILIES
def test_r7_a_connection_to_another_database_is_refused(family: dict[str, Any]) -> None:
    here_url, there_url = family["urls"]
    there = oncely.open(there_url)
    there.migrate()  # the inbox table exists in the other database too
    there.close()
    store = oncely.open(here_url)
    store.migrate()
    inbox = oncely.Inbox(store, consumer="billing")
    connect: Callable[[str], Any] = family["sync"]
    wrong, right = connect("there"), connect("here")
    try:
        with pytest.raises(oncely.ConfigurationError, match="the connection given as tx is"):
            inbox.handle_in_transaction("o-1", {"n": 1}, lambda tx, p: _write(tx), tx=wrong)
        wrong.rollback()
        outcomes = [  # the second: the connection's answer kept
            inbox.handle_in_transaction(key, {"n": 2}, lambda tx, p: _write(tx), tx=right).outcome
            for key in ("o-2", "o-2")
        ]
        right.commit()
        assert outcomes == [oncely.Outcome.PROCESSED, oncely.Outcome.DUPLICATE]
        assert inbox.get("o-1") is None and inbox.get("o-2") is not None
    finally:
        wrong.close()
        right.close()
        store.close()


@FAMILIES
def test_r7_an_asyncio_connection_to_another_database_is_refused(family: dict[str, Any]) -> None:
    here_url, there_url = family["urls"]

    async def main() -> None:
        there = oncely.open_async(there_url)
        await there.migrate()
        await there.aclose()
        store = oncely.open_async(here_url)
        await store.migrate()
        inbox = oncely.AsyncInbox(store, consumer="billing")
        wrong, right = await family["async"]("there"), await family["async"]("here")

        async def handler(tx: Any, payload: Any) -> None:
            _write(tx)

        try:
            with pytest.raises(oncely.ConfigurationError, match="the connection given as tx is"):
                await inbox.handle_in_transaction("o-1", {"n": 1}, handler, tx=wrong)
            done = await inbox.handle_in_transaction("o-2", {"n": 2}, handler, tx=right)
            await right.commit()
            assert done.outcome is oncely.Outcome.PROCESSED
            assert await inbox.get("o-1") is None and await inbox.get("o-2") is not None
        finally:
            for conn in (wrong, right):
                closing = family["close_async"](conn)
                if asyncio.iscoroutine(closing):
                    await closing
            await store.aclose()

    asyncio.run(main())


@pytest.mark.parametrize("name", ["sqlite", "postgres", "mysql"])
def test_r7_a_connection_that_reads_rows_as_dicts_is_joined(
    name: str, tmp_path: Path, table: str
) -> None:
    # A caller's connection made to read rows as dicts (PyMySQL's DictCursor, psycopg's
    # dict_row, sqlite3.Row): oncely's statements on it read tuples all the same. Before,
    # the threaded MariaDB store read the claim's row with the connection's own cursor class.
    conn: Any
    if name == "sqlite":
        url = f"sqlite:///{tmp_path / 'inbox.db'}"
        conn = sqlite3.connect(tmp_path / "inbox.db", isolation_level=None)
        conn.row_factory = sqlite3.Row
        conn.execute("BEGIN")
    elif name == "postgres":
        require("PostgreSQL", POSTGRES_DSN, 5432)
        url = f"{POSTGRES_DSN}?table={table}"
        conn = psycopg.connect(POSTGRES_DSN, row_factory=psycopg.rows.dict_row)
    else:
        require("MariaDB", MYSQL_URL, 3306)
        url = f"{MYSQL_URL.rsplit('/', 1)[0]}/test?table={table}"
        conn = pymysql.connect(**_mysql_args("test"), cursorclass=pymysql.cursors.DictCursor)
        conn.begin()
    store = oncely.open(url)
    try:
        store.migrate()
        inbox = oncely.Inbox(store, consumer="billing")
        outcomes = [
            inbox.handle_in_transaction("o-1", {"n": 1}, lambda tx, p: "done", tx=conn)
            for _ in range(2)
        ]
        conn.commit()
        assert [h.outcome for h in outcomes] == [
            oncely.Outcome.PROCESSED,
            oncely.Outcome.DUPLICATE,
        ]
        assert outcomes[1].value == "done"
    finally:
        conn.close()
        store.close()
        if name == "postgres":
            with psycopg.connect(POSTGRES_DSN, autocommit=True) as admin:
                for suffix in ("", "_meta", "_offsets"):
                    admin.execute(f'DROP TABLE IF EXISTS "{table}{suffix}"')
        elif name == "mysql":
            admin = pymysql.connect(**_mysql_args("test"), autocommit=True)
            with admin, admin.cursor() as cur:
                for suffix in ("", "_meta", "_offsets"):
                    cur.execute(f"DROP TABLE IF EXISTS `{table}{suffix}`")


def test_r7_a_sqlite3_connection_is_read_once_not_per_message(tmp_path: Path) -> None:
    # sqlite3's connections cannot be weakly referenced: the store holds the checked one
    # (Django's, SQLAlchemy's) rather than read its database again for every message.
    path = tmp_path / "inbox.db"
    store = oncely.open(f"sqlite:///{path}")
    conn = sqlite3.connect(path, isolation_level=None)
    statements: list[str] = []
    conn.set_trace_callback(statements.append)
    try:
        store.migrate()
        inbox = oncely.Inbox(store, consumer="billing")
        conn.execute("BEGIN")
        for key in ("o-1", "o-2", "o-3"):
            done = inbox.handle_in_transaction(key, {"k": key}, lambda tx, p: None, tx=conn)
            assert done.outcome is oncely.Outcome.PROCESSED
        conn.execute("COMMIT")
    finally:
        conn.close()
        store.close()
    assert sum("database_list" in s for s in statements) == 1, statements
