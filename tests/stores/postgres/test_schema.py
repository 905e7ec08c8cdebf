"""PostgreSQL store schema: made on first use with the key and the purge index only (R13),
completions that stay heap-only updates, migrations
racing, a newer schema refused, a dropped table reported, the server's clock.
"""

from __future__ import annotations

import threading
import time

import psycopg
import pytest

import oncely
from oncely.stores import ClaimStatus
from oncely.stores.postgres.sync_store import PostgresStore
from tests.backends.postgres import drop_tables
from tests.services import POSTGRES_DSN
from tests.stores.postgres.helpers import KEEP_MS, LEASE_MS, _claim, _sql


def test_r13_schema_created_on_first_use_with_the_key_and_the_purge_index(
    store: PostgresStore, table: str
) -> None:
    assert store.get("c", "k") is None
    indexes = _sql(
        "SELECT indexname, indexdef FROM pg_indexes WHERE tablename = %s ORDER BY 1", table
    )
    assert [name for name, _ in indexes] == [f"{table}_pkey", f"{table}_purge"]
    assert indexes[1][1].endswith("(purge_ms)")  # the expiry's minute, not expires_ms
    options = _sql("SELECT reloptions FROM pg_class WHERE relname = %s", table)[0][0]
    assert "autovacuum_vacuum_scale_factor=0.02" in options
    collations = _sql(
        "SELECT column_name, collation_name FROM information_schema.columns "
        "WHERE table_name = %s AND column_name IN ('consumer', 'key') ORDER BY 1",
        table,
    )
    assert collations == [("consumer", "C"), ("key", "C")]
    assert store.schema_version() == 1


def test_completions_and_renewals_stay_heap_only_updates(store: PostgresStore, table: str) -> None:
    # The purge index is on the expiry's minute, which a completion does not move (unless it
    # crosses a minute): the update writes no index, as before there was a purge index.
    for i in range(40):
        _claim(store, f"k{i}", token=f"t{i}")
        store.renew("c", f"k{i}", token=f"t{i}", lease_ms=LEASE_MS, keep_ms=KEEP_MS)
        store.complete("c", f"k{i}", token=f"t{i}", result=b"done", keep_ms=KEEP_MS)
    deadline = time.monotonic() + 30
    while True:  # the server publishes its counters a moment after the transactions end
        updates, hot = _sql(
            "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relname = %s", table
        )[0]
        if updates >= 80 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert updates == 80
    assert hot >= updates - 2, (updates, hot)  # a minute boundary crossed at most once or twice


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


def test_r13_the_purge_reads_only_the_expired_end_of_its_index(
    store: PostgresStore, table: str
) -> None:
    # With the bounds as a join the planner read the whole index and filtered it: an empty
    # purge then cost the table's size. The bounds must be the index scan's condition (the
    # table is small, so sequential scans are ruled out to see which index plan it makes).
    store.migrate()
    statement = store._dialect.purge.decode()
    statement = statement.replace("%(now)s", "NULL").replace("%(limit)s", "1000")
    with psycopg.connect(POSTGRES_DSN, autocommit=True) as conn:
        conn.execute("SET enable_seqscan = off")
        plan = "\n".join(row[0] for row in conn.execute(f"EXPLAIN {statement}".encode()))
    assert f"Index Scan on {table}_purge" in plan or f"Index Scan using {table}_purge" in plan
    assert "Index Cond: (purge_ms <= $" in plan, plan
