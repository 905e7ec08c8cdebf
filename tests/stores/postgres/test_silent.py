"""A server gone silent (a dead route: the connections held, nothing answered, no reset): a
statement on one of the store's connections is cut at its ``read_timeout`` and raises
:class:`~oncely.StoreUnavailable` while the server is still silent, in both twins; the
connections oncely opens itself carry libpq's TCP keepalives unless the URL says otherwise
(R19: a caller is never held for ever by its store).

The server is reached through ``tests.brokers.common.Proxy``, which the test makes silent and
then cuts (what it swallowed is lost)."""

from __future__ import annotations

import asyncio
import uuid

import pytest

import oncely
from oncely.stores.postgres.async_store import AsyncPostgresStore
from oncely.stores.postgres.sync_store import PostgresStore
from tests.brokers.common import Proxy
from tests.services import POSTGRES_DSN
from tests.stores.silent import (
    assert_a_sooner_read_timeout_is_kept_while_a_later_one_waits,
    assert_cut_while_silent,
)


async def test_r19_a_statement_on_a_silent_connection_is_cut_at_the_read_timeout(
    table: str,
) -> None:
    """A store whose ``read_timeout`` is sooner than another's, waiting, is cut at its own,
    while the server is silent (the check is the MariaDB store's too)."""
    await assert_a_sooner_read_timeout_is_kept_while_a_later_one_waits(
        f"{POSTGRES_DSN}?table={table}", PostgresStore
    )


async def test_r19_the_asyncio_store_is_cut_at_its_read_timeout_too(table: str) -> None:
    """The asyncio twin shares the watchdog: a statement on a silent connection raises
    ``StoreUnavailable`` at ``read_timeout`` (1 s here) while the server is still silent,
    without a caller's own timeout (a consumer's ``handle``, not only the ASGI middleware,
    which bounds its calls itself)."""
    async with Proxy(f"{POSTGRES_DSN}?table={table}&read_timeout=1") as proxy:
        store = oncely.open_async(proxy.url)
        assert isinstance(store, AsyncPostgresStore)
        try:
            assert await store.get("c", "k") is None
            proxy.silent = True
            told = asyncio.create_task(store.get("c", "k"))
            await assert_cut_while_silent(proxy, told, "no answer")
        finally:
            proxy.silent = False
            proxy.cut()
            await store.aclose()


def test_the_connections_oncely_opens_have_tcp_keepalives_unless_the_url_says_otherwise(
    table: str,
) -> None:
    """libpq's keepalives and ``tcp_user_timeout`` are set on the store's connections (a
    dead peer is found in about 30 s, not the system's two hours); a value in the URL is
    kept as given."""
    app = f"oncely_ka_{uuid.uuid4().hex[:8]}"
    for query, idle in (("", "15"), ("&keepalives_idle=42", "42")):
        store = PostgresStore(f"{POSTGRES_DSN}?application_name={app}{query}", table=table)
        try:
            assert store.get("c", "k") is None
            with store._connection("test") as conn:
                said = {o.keyword.decode(): (o.val or b"").decode() for o in conn.pgconn.info}
            assert said["keepalives_idle"] == idle
            assert said["keepalives"] == "1" and said["tcp_user_timeout"] == "30000"
        finally:
            store.close()


def test_read_timeout_from_the_url_and_its_bad_values() -> None:
    assert PostgresStore.from_url(f"{POSTGRES_DSN}?read_timeout=2.5")._read_seconds == 2.5
    assert PostgresStore.from_url(f"{POSTGRES_DSN}?read_timeout=0")._read_seconds is None
    assert PostgresStore(POSTGRES_DSN)._read_seconds == 10.0
    with pytest.raises(oncely.ConfigurationError, match="read_timeout"):
        oncely.open(f"{POSTGRES_DSN}?read_timeout=-1")
    with pytest.raises(oncely.ConfigurationError, match="read_timeout"):
        oncely.open(f"{POSTGRES_DSN}?read_timeout=soon")
