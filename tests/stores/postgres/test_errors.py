"""PostgreSQL store errors: a closed port, a wrong database, a key too long for the index
and a closed store, each translated into oncely's errors.
"""

from __future__ import annotations

import psycopg
import pytest

import oncely
from oncely import Outcome
from oncely._core.records import ClaimRequest
from oncely.stores.postgres.async_store import AsyncPostgresStore
from oncely.stores.postgres.sync_store import PostgresStore
from tests.services import POSTGRES_DSN
from tests.stores.postgres.helpers import _TWO_PHASE, _traced


def test_a_closed_port_is_store_unavailable() -> None:
    store = PostgresStore("postgresql://postgres@127.0.0.1:1/test", table="t")
    with pytest.raises(oncely.StoreUnavailable, match="refused") as raised:
        store.get("c", "k")
    assert not isinstance(raised.value, psycopg.Error)
    inbox = oncely.Inbox(store, consumer="c")
    with pytest.raises(oncely.StoreUnavailable):
        inbox.handle("k", 1, lambda p: p)


async def test_a_closed_port_is_store_unavailable_async() -> None:
    store = AsyncPostgresStore("postgresql://postgres@127.0.0.1:1/test", table="t")
    with pytest.raises(oncely.StoreUnavailable, match="refused"):
        await store.claim(
            "c", "k", fingerprint=None, token="t", lease_ms=1, keep_ms=1, takeover=False
        )
    await store.aclose()


def test_a_wrong_database_is_a_store_error_not_a_retry() -> None:
    store = PostgresStore("postgresql://postgres@127.0.0.1:5432/no_such_db_x", table="t")
    with pytest.raises(oncely.StoreError, match="does not exist") as raised:
        store.get("c", "k")
    assert not isinstance(raised.value, oncely.StoreUnavailable)


def test_a_key_too_long_for_the_index_is_refused_before_the_statement(
    store: PostgresStore,
) -> None:
    inbox = oncely.Inbox(store, consumer="c", limits=oncely.Limits(max_key_bytes=4096))
    with psycopg.connect(POSTGRES_DSN) as conn:
        conn.execute("SELECT 1")
        tags: list[str] = []
        with _traced(conn, tags), pytest.raises(oncely.StoreError, match="hash_long_keys"):
            inbox.handle_in_transaction("k" * 3000, 1, lambda tx, p: None, tx=conn)
        # Only the read of which database the connection is on; not even the savepoint: it
        # waits for the claim, which never went.
        assert tags == ["SELECT 1"]
        assert conn.execute("SELECT 2").fetchone() == (2,)  # the transaction is intact
    with pytest.raises(oncely.StoreError, match="index entry"):
        store.claim_many("c", [ClaimRequest("k" * 3000, None, "t")], **_TWO_PHASE)
    hashing = oncely.Inbox(
        store, consumer="c", limits=oncely.Limits(max_key_bytes=2048, hash_long_keys=True)
    )
    assert hashing.handle("k" * 3000, 1, lambda p: p).outcome is Outcome.PROCESSED


def test_a_closed_store_refuses_work(store: PostgresStore) -> None:
    store.migrate()
    store.close()
    with pytest.raises(oncely.StoreError, match="closed"):
        store.get("c", "k")
