"""The rows a purge deletes are reclaimed: the table's autovacuum settings make a vacuum due,
and a vacuum makes their space reusable (R12).

``migrate`` gives the inbox table ``autovacuum_vacuum_scale_factor = 0.02`` (the server's
default is 0.2). 30,000 records in oncely's shape (36-character keys, 100-byte results, rows
loaded with COPY), 15% of them expired and scattered among the rest, then the store's purge:

1. the dead rows it leaves (``n_dead_tup``) exceed the autovacuum threshold computed from the
   table's own reloptions (``threshold + scale_factor * reltuples``), and would not reach the
   threshold of the server's defaults;
2. after a ``VACUUM`` (what autovacuum runs) the dead rows are gone, and writing as many new
   records again does not grow the heap: their space is reused;
3. with ``ONCELY_DISRUPTIVE_TESTS=1`` only (it changes a server setting for a minute):
   ``autovacuum_naptime = 1s`` (``ALTER SYSTEM`` + ``pg_reload_conf()``), and autovacuum
   itself vacuums the table after a purge; the setting is reset in a ``finally`` block. A
   server running with ``autovacuum = off`` skips this part (it is not switched on).
"""

from __future__ import annotations

import os
import random
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

import oncely
from oncely.stores import ClaimRequest
from oncely.stores.postgres.sync_store import PostgresStore
from tests.services import POSTGRES_DSN

ROWS = 30_000
EXPIRED_SHARE = 0.15
DAY_MS = 86_400_000
BUCKET_MS = 60_000
RESULT = bytes(range(100))
FP = oncely.fingerprint({"order": "x" * 200})
COLUMNS = (
    "consumer, key, status, fingerprint, token, attempt, created_ms, updated_ms, "
    "lease_until_ms, expires_ms, result, error, purge_ms"
)
DISRUPTIVE = os.environ.get("ONCELY_DISRUPTIVE_TESTS") == "1"


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def _bucket(ms: int) -> int:
    return -(-ms // BUCKET_MS) * BUCKET_MS


@pytest.fixture
def admin() -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(POSTGRES_DSN, autocommit=True) as conn:
        yield conn


def _load(conn: psycopg.Connection[Any], table: str, rows: int, expired: int) -> None:
    """``rows`` completed records in oncely's shape, ``expired`` of them already past their
    expiry, in random order (so the dead rows of a purge are spread over the heap)."""
    now = _now_ms()
    gone = set(random.sample(range(rows), expired))
    with conn.cursor().copy(f'COPY "{table}" ({COLUMNS}) FROM STDIN') as copy:
        for i in range(rows):
            if i in gone:
                expires = now - random.randint(1_000, DAY_MS)
            else:
                expires = now + random.randint(BUCKET_MS, 7 * DAY_MS)
            written = expires - 7 * DAY_MS
            copy.write_row(
                (
                    "billing", str(uuid.uuid4()), "completed", FP, uuid.uuid4().hex, 1,
                    written, written, written, expires, RESULT, None, _bucket(expires),
                )
            )  # fmt: skip
    conn.execute(f'ANALYZE "{table}"')


def _stat(conn: psycopg.Connection[Any], table: str) -> tuple[int, Any]:
    """``n_dead_tup`` and ``last_autovacuum`` of the table, read afresh."""
    conn.execute("SELECT pg_stat_clear_snapshot()")
    row = conn.execute(
        "SELECT n_dead_tup, last_autovacuum FROM pg_stat_user_tables WHERE relname = %s",
        (table,),
    ).fetchone()
    assert row is not None
    return int(row[0]), row[1]


def _dead_after_flush(conn: psycopg.Connection[Any], table: str, at_least: int) -> int:
    """``n_dead_tup`` once the purging sessions' counts reached the shared statistics (a
    session sends them at most once a second, and when it ends): up to 15 s."""
    deadline = time.monotonic() + 15
    while True:
        dead, _ = _stat(conn, table)
        if dead >= at_least or time.monotonic() > deadline:
            return dead
        time.sleep(0.2)


def _thresholds(conn: psycopg.Connection[Any], table: str) -> tuple[float, float, float]:
    """reltuples, and the autovacuum threshold of dead rows from the table's reloptions and
    from the server's settings alone."""
    row = conn.execute(
        "SELECT reltuples, coalesce(reloptions, '{}') FROM pg_class WHERE relname = %s",
        (table,),
    ).fetchone()
    assert row is not None
    reltuples, reloptions = float(row[0]), dict(o.split("=", 1) for o in row[1])
    settings = dict(
        conn.execute(
            "SELECT name, setting FROM pg_settings WHERE name IN "
            "('autovacuum_vacuum_threshold', 'autovacuum_vacuum_scale_factor')"
        ).fetchall()
    )

    def option(name: str) -> float:
        return float(reloptions.get(name, settings[name]))

    base = option("autovacuum_vacuum_threshold")
    factor = option("autovacuum_vacuum_scale_factor")
    default = (
        float(settings["autovacuum_vacuum_threshold"])
        + float(settings["autovacuum_vacuum_scale_factor"]) * reltuples
    )
    return reltuples, base + factor * reltuples, default


def _purge(table: str) -> int:
    store = PostgresStore(POSTGRES_DSN, table=table, pool_max=2)
    try:
        return store.purge_expired(batch_size=1000)
    finally:
        store.close()  # its sessions end: their statistics are sent now


def _pages(conn: psycopg.Connection[Any], table: str) -> int:
    row = conn.execute(
        "SELECT pg_relation_size(%s) / current_setting('block_size')::int", (f'"{table}"',)
    ).fetchone()
    assert row is not None
    return int(row[0])


def test_r12_a_purge_makes_autovacuum_due_and_vacuum_reuses_the_space(
    store: PostgresStore, table: str, admin: psycopg.Connection[Any]
) -> None:
    store.migrate()
    expired = int(ROWS * EXPIRED_SHARE)
    _load(admin, table, ROWS, expired)
    reltuples, due_at, default_due_at = _thresholds(admin, table)
    assert reltuples == pytest.approx(ROWS, rel=0.05)
    assert due_at < expired < default_due_at  # 650 < 4,500 < 6,050 at 30,000 rows

    pages_before = _pages(admin, table)
    started = admin.execute("SELECT now()").fetchone()
    assert _purge(table) == expired

    # (1) The purge's dead rows make a vacuum due by the table's settings, not by the server's.
    dead = _dead_after_flush(admin, table, expired)
    _, last_autovacuum = _stat(admin, table)
    if last_autovacuum is not None and started is not None and last_autovacuum >= started[0]:
        pass  # autovacuum came by already: the vacuum was due, and ran
    else:
        assert dead >= expired, dead
        assert due_at < dead < default_due_at, (dead, due_at, default_due_at)

    # (2) A VACUUM removes them, and as many new records fit in the space they left.
    admin.execute(f'VACUUM "{table}"')
    dead, _ = _stat(admin, table)
    assert dead <= 5, dead
    pages_vacuumed = _pages(admin, table)
    keys = [str(uuid.uuid4()) for _ in range(expired)]
    for start in range(0, expired, 500):
        requests = [ClaimRequest(k, FP, uuid.uuid4().hex) for k in keys[start : start + 500]]
        store.claim_many("billing", requests, lease_ms=30_000, keep_ms=7 * DAY_MS, takeover=False)
    pages_after = _pages(admin, table)
    assert pages_after <= max(pages_before, pages_vacuumed) + 2, (
        pages_before, pages_vacuumed, pages_after,
    )  # fmt: skip


@pytest.mark.skipif(not DISRUPTIVE, reason="changes autovacuum_naptime: ONCELY_DISRUPTIVE_TESTS=1")
def test_r12_autovacuum_vacuums_the_table_after_a_purge(
    store: PostgresStore, table: str, admin: psycopg.Connection[Any]
) -> None:
    on = admin.execute("SELECT current_setting('autovacuum')").fetchone()
    if on is None or on[0] != "on":
        pytest.skip("the server runs with autovacuum = off: no autovacuum to wait for")
    store.migrate()
    expired = int(ROWS * EXPIRED_SHARE)
    _load(admin, table, ROWS, expired)
    try:
        admin.execute("ALTER SYSTEM SET autovacuum_naptime = '1s'")
        admin.execute("SELECT pg_reload_conf()")
        started = admin.execute("SELECT now()").fetchone()
        assert started is not None
        assert _purge(table) == expired
        deadline = time.monotonic() + 90
        while True:
            dead, last_autovacuum = _stat(admin, table)
            if last_autovacuum is not None and last_autovacuum >= started[0] and dead < expired:
                break
            assert time.monotonic() < deadline, (dead, last_autovacuum)
            time.sleep(1)
        assert dead <= expired // 10, dead
    finally:
        admin.execute("ALTER SYSTEM RESET autovacuum_naptime")
        admin.execute("SELECT pg_reload_conf()")
