"""MariaDB / MySQL (PyMySQL, aiomysql) in every contract test, sync and async.

Each test gets tables of its own (``oncely_t_<unique>``, its ``_meta`` twin and a ledger
beside them) in the database named by ``tests.services.MYSQL_URL``, dropped afterwards, so
tests may run concurrently against one server.
"""

from __future__ import annotations

from typing import Any

import pymysql

import oncely
from oncely.stores.mysql.async_store import AsyncMySQLStore
from oncely.stores.mysql.errors import parse_url
from oncely.stores.mysql.sync_store import MySQLStore
from tests.services import MYSQL_URL, require

from . import Backend, Scope


def admin() -> Any:
    """A plain autocommit PyMySQL connection to the test database (for set-up and checks)."""
    s = parse_url(MYSQL_URL).settings
    return pymysql.connect(
        host=s.host,
        port=s.port,
        user=s.user,
        password=s.password or "",
        database=s.database,
        unix_socket=s.unix_socket,
        autocommit=True,
        charset="utf8mb4",
    )


def sql(statement: str, params: Any = None) -> list[Any]:
    """Run one statement on a fresh admin connection; its rows."""
    conn = admin()
    try:
        with conn.cursor() as cursor:
            cursor.execute(statement, params)
            return list(cursor.fetchall())
    finally:
        conn.close()


def drop_tables(*names: str) -> None:
    """Drop the given tables (and an inbox table's ``_meta`` twin) if they exist."""
    conn = admin()
    try:
        with conn.cursor() as cursor:
            cursor.execute("SET SESSION lock_wait_timeout = 10")
            for name in names:
                cursor.execute(f"DROP TABLE IF EXISTS `{name}`, `{name}_meta`, `{name}_offsets`")
    finally:
        conn.close()


def table_name(scope: Scope) -> str:
    name = f"oncely_t_{scope.unique}"
    scope.finalizers.append(lambda: drop_tables(name, f"ledger_{scope.unique}"))
    return name


def url(table: str, **options: object) -> str:
    query = "&".join(f"{k}={v}" for k, v in {"table": table, **options}.items())
    return f"{MYSQL_URL}{'&' if '?' in MYSQL_URL else '?'}{query}"


def _sync(scope: Scope, clock: oncely.FakeClock | None) -> oncely.Store:
    return MySQLStore.from_url(url(table_name(scope)), clock=clock)


def _async(scope: Scope, clock: oncely.FakeClock | None) -> oncely.AsyncStore:
    return AsyncMySQLStore.from_url(url(table_name(scope)), clock=clock)


class MySQLLedger:
    """A ledger without unique keys beside the inbox table: a double application shows."""

    def __init__(self, scope: Scope, store: object) -> None:
        self.table = f"ledger_{scope.unique}"
        sql(
            f"CREATE TABLE IF NOT EXISTS `{self.table}` "
            "(k VARCHAR(255) NOT NULL, amount INT) ENGINE=InnoDB"
        )

    def count(self, key: str) -> int:
        return int(sql(f"SELECT count(*) FROM `{self.table}` WHERE k = %s", (key,))[0][0])


class SyncMySQLLedger(MySQLLedger):
    def write(self, tx: Any, key: str, amount: int) -> None:
        with tx.cursor() as cursor:
            cursor.execute(f"INSERT INTO `{self.table}` (k, amount) VALUES (%s, %s)", (key, amount))


class AsyncMySQLLedger(MySQLLedger):
    async def write(self, tx: Any, key: str, amount: int) -> None:
        cursor = await tx.cursor()
        try:
            await cursor.execute(
                f"INSERT INTO `{self.table}` (k, amount) VALUES (%s, %s)", (key, amount)
            )
        finally:
            await cursor.close()

    async def count(self, key: str) -> int:  # type: ignore[override]
        return super().count(key)


BACKEND = Backend(
    name="mysql",
    make_sync=_sync,
    make_async=_async,
    sync_ledger=SyncMySQLLedger,
    async_ledger=AsyncMySQLLedger,
    require=lambda: require("MariaDB", MYSQL_URL, 3306),
)
