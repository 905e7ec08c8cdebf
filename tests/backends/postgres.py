"""PostgreSQL (psycopg 3 + psycopg_pool) in every contract test, sync and async.

Each test gets tables of its own (``oncely_t_<unique>`` and a ledger beside it) on the server
named by ``tests.services.POSTGRES_DSN``, dropped afterwards, so tests may run concurrently
against one server.
"""

from __future__ import annotations

from typing import Any

import psycopg

import oncely
from oncely.stores.postgres.async_store import AsyncPostgresStore
from oncely.stores.postgres.sync_store import PostgresStore
from tests.services import POSTGRES_DSN, require

from . import Backend, Scope


def table_name(scope: Scope) -> str:
    return f"oncely_t_{scope.unique}"


def drop_tables(*names: str) -> None:
    """Drop the given tables (and an inbox table's ``_meta`` twin) if they exist."""
    with psycopg.connect(POSTGRES_DSN, autocommit=True) as conn:
        conn.execute("SET lock_timeout = '10s'")
        for name in names:
            conn.execute(f'DROP TABLE IF EXISTS "{name}", "{name}_meta", "{name}_offsets"')


def _register_drop(scope: Scope) -> str:
    name = table_name(scope)
    scope.finalizers.append(lambda: drop_tables(name, f"ledger_{scope.unique}"))
    return name


def _sync(scope: Scope, clock: oncely.FakeClock | None) -> oncely.Store:
    return PostgresStore(POSTGRES_DSN, table=_register_drop(scope), pool_max=4, clock=clock)


def _async(scope: Scope, clock: oncely.FakeClock | None) -> oncely.AsyncStore:
    return AsyncPostgresStore(POSTGRES_DSN, table=_register_drop(scope), pool_max=4, clock=clock)


class PostgresLedger:
    """A ledger without unique keys beside the inbox table: a double application shows."""

    def __init__(self, scope: Scope, store: object) -> None:
        self.table = f"ledger_{scope.unique}"
        with psycopg.connect(POSTGRES_DSN, autocommit=True) as conn:
            conn.execute(f"CREATE TABLE IF NOT EXISTS {self.table} (key TEXT NOT NULL, amount INT)")

    def count(self, key: str) -> int:
        with psycopg.connect(POSTGRES_DSN, autocommit=True) as conn:
            row = conn.execute(
                f"SELECT count(*) FROM {self.table} WHERE key = %s", (key,)
            ).fetchone()
        assert row is not None
        return int(row[0])


class SyncPostgresLedger(PostgresLedger):
    def write(self, tx: Any, key: str, amount: int) -> None:
        tx.execute(f"INSERT INTO {self.table} (key, amount) VALUES (%s, %s)", (key, amount))


class AsyncPostgresLedger(PostgresLedger):
    async def write(self, tx: Any, key: str, amount: int) -> None:
        await tx.execute(f"INSERT INTO {self.table} (key, amount) VALUES (%s, %s)", (key, amount))

    async def count(self, key: str) -> int:  # type: ignore[override]
        return super().count(key)


BACKEND = Backend(
    name="postgres",
    make_sync=_sync,
    make_async=_async,
    sync_ledger=SyncPostgresLedger,
    async_ledger=AsyncPostgresLedger,
    require=lambda: require("PostgreSQL", POSTGRES_DSN, 5432),
)
