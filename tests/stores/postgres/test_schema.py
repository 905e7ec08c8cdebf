"""PostgreSQL store schema: made on first use with no index but the key (R13), migrations
racing, a newer schema refused, a dropped table reported, the server's clock.
"""

from __future__ import annotations

import threading

import pytest

import oncely
from oncely.stores import ClaimStatus
from oncely.stores.postgres.sync_store import PostgresStore
from tests.backends.postgres import drop_tables
from tests.services import POSTGRES_DSN
from tests.stores.postgres.helpers import LEASE_MS, _claim, _sql


def test_r13_schema_created_on_first_use_with_no_index_but_the_key(
    store: PostgresStore, table: str
) -> None:
    assert store.get("c", "k") is None
    indexes = _sql("SELECT indexname FROM pg_indexes WHERE tablename = %s", table)
    assert indexes == [(f"{table}_pkey",)]  # no index on expires_ms: updates stay HOT
    collations = _sql(
        "SELECT column_name, collation_name FROM information_schema.columns "
        "WHERE table_name = %s AND column_name IN ('consumer', 'key') ORDER BY 1",
        table,
    )
    assert collations == [("consumer", "C"), ("key", "C")]
    assert store.schema_version() == 1


def test_migrations_racing_in_many_threads_all_succeed(table: str) -> None:
    stores = [PostgresStore(POSTGRES_DSN, table=table, pool_max=1) for _ in range(6)]
    start = threading.Barrier(len(stores))
    versions: list[object] = []

    def migrate(s: PostgresStore) -> None:
        start.wait()
        try:
            versions.append(s.migrate())
        except Exception as exc:
            versions.append(exc)

    threads = [threading.Thread(target=migrate, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert versions == [1] * len(stores)
    for s in stores:
        s.close()


def test_a_newer_schema_is_refused(store: PostgresStore, table: str) -> None:
    store.migrate()
    _sql(f"UPDATE {table}_meta SET value = '9'")
    newer = PostgresStore(POSTGRES_DSN, table=table)
    with pytest.raises(oncely.SchemaTooNew, match="version 9"):
        newer.get("c", "k")
    with pytest.raises(oncely.SchemaTooNew):
        newer.migrate()
    newer.close()


def test_a_dropped_table_is_schema_missing(store: PostgresStore, table: str) -> None:
    _claim(store)
    drop_tables(table)
    with pytest.raises(oncely.SchemaMissing, match="oncely migrate"):
        _claim(store)
    store.migrate()
    assert _claim(store).status is ClaimStatus.NEW


def test_r13_server_clock_when_no_clock_is_given(store: PostgresStore) -> None:
    store.migrate()
    before = _sql("SELECT floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint")[0][0]
    claim = _claim(store)
    after = _sql("SELECT floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint")[0][0]
    assert before <= claim.now_ms <= after
    assert claim.record.created_ms == claim.now_ms
    assert claim.record.lease_until_ms == claim.now_ms + LEASE_MS
    again = _claim(store, token="t2")
    assert again.status is ClaimStatus.EXISTING and again.now_ms >= claim.now_ms
