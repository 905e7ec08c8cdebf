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

SILENT_FOR = 20.0
"""Seconds the relay stays silent at most: far more than the short ``read_timeout`` (1 s),
less than the long one (60 s), which only the relay's cut at the end ends."""


async def test_r19_a_statement_on_a_silent_connection_is_cut_at_the_read_timeout(
    table: str,
) -> None:
    """Two threaded stores on one silent server: one waits (``read_timeout=60``) when the
    other, whose bound is far sooner (1 s), sends its statement; the second still raises
    ``StoreUnavailable`` (saying so) while the server is silent: the watchdog, asleep until
    the first's deadline, was woken for the sooner one. Once the server is back both stores
    work again."""
    async with Proxy(f"{POSTGRES_DSN}?table={table}") as proxy:
        patient = oncely.open(f"{proxy.url}&read_timeout=60")
        quick = oncely.open(f"{proxy.url}&read_timeout=1")
        assert isinstance(patient, PostgresStore) and isinstance(quick, PostgresStore)
        try:
            for store in (patient, quick):  # their connections open, and are kept
                assert await asyncio.to_thread(store.get, "c", "k") is None
            proxy.silent = True
            waiting = asyncio.create_task(asyncio.to_thread(patient.get, "c", "k"))
            await asyncio.sleep(0.2)  # the patient one's statement is sent first
            told = asyncio.create_task(asyncio.to_thread(quick.get, "c", "k"))
            done, _ = await asyncio.wait({told}, timeout=SILENT_FOR)
            assert done, "the statement waited past its read_timeout"
            assert proxy.silent
            with pytest.raises(oncely.StoreUnavailable, match=r"no answer .* within 1s"):
                told.result()
            assert not waiting.done()  # its own bound is a minute
            proxy.silent = False
            proxy.cut()
            with pytest.raises(oncely.StoreUnavailable):
                await waiting
            for store in (patient, quick):  # the pool replaces the cut connections
                assert await _eventually(store) is None
        finally:
            patient.close()
            quick.close()


async def _eventually(store: PostgresStore) -> object:
    for _ in range(100):
        try:
            return await asyncio.to_thread(store.get, "c", "k")
        except oncely.StoreUnavailable:
            await asyncio.sleep(0.2)
    return await asyncio.to_thread(store.get, "c", "k")


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
            done, _ = await asyncio.wait({told}, timeout=SILENT_FOR)
            assert done, "the statement waited past its read_timeout"
            assert proxy.silent
            with pytest.raises(oncely.StoreUnavailable, match="no answer"):
                told.result()
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
