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

LONG = 3_600_000


def _lax(dsn: str) -> str:
    """``dsn`` with every connection's ``synchronous_commit`` off (as a role's or a
    database's setting would have it)."""
    return f"{dsn}{'&' if '?' in dsn else '?'}options=-c%20synchronous_commit%3Doff"


def _said(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "oncely.store"]


def test_r8_a_server_that_may_lose_confirmed_commits_is_named_at_warning(
    table: str, caplog: pytest.LogCaptureFixture
) -> None:
    store = PostgresStore(_lax(POSTGRES_DSN), table=table)
    try:
        with caplog.at_level(logging.WARNING, logger="oncely.store"):
            claim = store.claim("c", "order-1", fingerprint=None, token="t", lease_ms=LONG,
                                keep_ms=LONG, takeover=False)  # fmt: skip
            assert claim.won
            store.claim("c", "order-2", fingerprint=None, token="t", lease_ms=LONG,
                        keep_ms=LONG, takeover=False)  # fmt: skip
    finally:
        store.close()
    (said,) = _said(caplog)  # once, when the store is set up
    assert "synchronous_commit=off" in said and "synchronous_commit=on" in said
    assert "repeated" in said


async def test_r8_the_asyncio_store_says_it_too(
    table: str, caplog: pytest.LogCaptureFixture
) -> None:
    store = AsyncPostgresStore(_lax(POSTGRES_DSN), table=table)
    try:
        with caplog.at_level(logging.WARNING, logger="oncely.store"):
            await store.prepare()
    finally:
        await store.aclose()
    (said,) = _said(caplog)
    assert "synchronous_commit=off" in said


def test_r8_a_durable_server_is_not_mentioned(table: str, caplog: pytest.LogCaptureFixture) -> None:
    store = PostgresStore(POSTGRES_DSN, table=table)
    try:
        with caplog.at_level(logging.WARNING, logger="oncely.store"):
            store.prepare()  # type: ignore[attr-defined]
    finally:
        store.close()
    assert _said(caplog) == []
