"""A PostgreSQL that may lose the commits it confirmed when it crashes
(``synchronous_commit=off``, ``fsync=off``): a completion lost so is its message processed
again when redelivered, and an effect outside the transaction repeated (R8, R10). The store
reads both settings, as its connections see them, when it is set up, and says so at WARNING;
a durable server is not mentioned."""

from __future__ import annotations

import logging

import pytest

from oncely.stores.postgres.async_store import AsyncPostgresStore
from oncely.stores.postgres.sync_store import PostgresStore
from tests.services import POSTGRES_DSN
from tests.stores.durability import claim, said, said_while_set_up


def _lax(dsn: str) -> str:
    """``dsn`` with every connection's ``synchronous_commit`` off (as a role's or a
    database's setting would have it)."""
    return f"{dsn}{'&' if '?' in dsn else '?'}options=-c%20synchronous_commit%3Doff"


def test_r8_a_server_that_may_lose_confirmed_commits_is_named_at_warning(
    table: str, caplog: pytest.LogCaptureFixture
) -> None:
    store = PostgresStore(_lax(POSTGRES_DSN), table=table)
    try:
        with caplog.at_level(logging.WARNING, logger="oncely.store"):
            assert claim(store, "order-1").won
            claim(store, "order-2")
    finally:
        store.close()
    (warning,) = said(caplog)  # once, when the store is set up
    assert "synchronous_commit=off" in warning and "synchronous_commit=on" in warning
    assert "repeated" in warning


async def test_r8_the_asyncio_store_says_it_too(
    table: str, caplog: pytest.LogCaptureFixture
) -> None:
    store = AsyncPostgresStore(_lax(POSTGRES_DSN), table=table)
    try:
        with caplog.at_level(logging.WARNING, logger="oncely.store"):
            await store.prepare()
    finally:
        await store.aclose()
    (warning,) = said(caplog)
    assert "synchronous_commit=off" in warning


def test_r8_a_durable_server_is_not_mentioned(table: str, caplog: pytest.LogCaptureFixture) -> None:
    assert said_while_set_up(PostgresStore(POSTGRES_DSN, table=table), caplog) == []
