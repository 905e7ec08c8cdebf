"""``oncely inbox stats``: estimates by default, ``--exact`` counts every record.

The SQLite sample database (the ``db`` fixture) is small: its estimate counts every consumer
and the expired records outright, so the default answer has the exact totals, printed as
exact (no ``~``, no "estimate": the README promises consumers of at most 1,000 records are
counted exactly), with no status split (SQLite keeps no statistic of it). A larger SQLite
consumer is estimated and marked ``~`` beside the small ones, and the live total is SQLite's
exact row count less the expired. On PostgreSQL, a table of a few thousand records after
ANALYZE: the default answer is the planner's estimate, within 10%, with its status split,
the small consumer counted; ``--exact`` is the exact count.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from oncely import Inbox, SQLiteStore
from oncely.stores import ClaimRequest
from oncely.stores.postgres import PostgresStore
from tests.backends.postgres import drop_tables
from tests.cli.helpers import LIVE_KEYS, run, url_of
from tests.services import POSTGRES_DSN, require


def _live_per_consumer() -> dict[str, int]:
    found: dict[str, int] = {}
    for consumer, _key in LIVE_KEYS:
        found[consumer] = found.get(consumer, 0) + 1
    return found


def _cells(out: str, consumer: str) -> list[str]:
    line = next(line for line in out.splitlines() if f" {consumer} " in line)
    return line.replace("│", " ").split()[1:]


def test_a_small_table_is_counted_and_never_shown_as_an_estimate(db: Path) -> None:
    # Every consumer has at most 1,000 records and the expired are few: each number of the
    # default answer was counted, so none is marked ~ or called an estimate.
    result = run("inbox", "stats", "--store", url_of(db))
    assert result.exit_code == 0, result.stderr
    out = result.stdout
    assert "~" not in out and "estimate" not in out.replace("not estimated on this store", "")
    assert f"live records: {len(LIVE_KEYS)}; expired, awaiting purge: 3" in out
    assert _cells(out, "billing") == ["6"]
    assert "by status: not estimated on this store (--exact counts them)" in out


def test_a_one_record_table_shows_one_not_about_one(tmp_path: Path) -> None:
    # The new user's trial: `oncely migrate`, one record, `oncely inbox stats`.
    url = url_of(tmp_path / "one.db")
    assert run("migrate", "--store", url).exit_code == 0
    store = SQLiteStore(tmp_path / "one.db")
    try:
        Inbox(store, consumer="billing").handle("k1", 1, lambda _p: 1)
    finally:
        store.close()
    out = run("inbox", "stats", "--store", url).stdout
    assert _cells(out, "billing") == ["1"]
    assert "live records: 1; expired, awaiting purge: 0" in out
    assert "~" not in out and "(estimate)" not in out


def test_the_default_json_holds_exact_false(db: Path) -> None:
    result = run("inbox", "stats", "--store", url_of(db), "--json")
    assert result.exit_code == 0, result.stderr
    stats = json.loads(result.stdout)
    assert stats["exact"] is False
    # Small consumers are counted outright, even by an estimate, and say so.
    assert {c: v["total"] for c, v in stats["consumers"].items()} == _live_per_consumer()
    assert stats["total"] == len(LIVE_KEYS)
    assert stats["expired"] == 3
    assert stats["statuses"] is None
    assert stats["counted"] == {
        "consumers": sorted(_live_per_consumer()), "total": True, "expired": True,
    }  # fmt: skip


def test_a_larger_sqlite_consumer_is_marked_as_estimated(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "big.db")
    try:
        store.migrate()
        for consumer, n in (("orders", 1800), ("mail", 1200), ("rare", 7)):
            requests = [ClaimRequest(f"{consumer}-{i}", None, f"t{i}") for i in range(n)]
            store.claim_many(consumer, requests, lease_ms=60_000, keep_ms=3_600_000,
                             takeover=False)  # fmt: skip
    finally:
        store.close()
    result = run("inbox", "stats", "--store", url_of(tmp_path / "big.db"))
    assert result.exit_code == 0, result.stderr
    out = result.stdout
    assert _cells(out, "rare") == ["7"]  # counted outright
    for consumer, n in (("orders", 1800), ("mail", 1200)):
        (cell,) = _cells(out, consumer)
        assert cell.startswith("~") and abs(int(cell[1:]) - n) <= 0.1 * n, (consumer, cell)
    # SQLite's total: its exact row count, less the expired, counted too.
    assert "live records: 3007; expired, awaiting purge: 0" in out
    assert "~ marks estimates from the database's statistics; --exact counts every" in out


def test_exact_gives_the_counts_per_status(db: Path) -> None:
    result = run("inbox", "stats", "--store", url_of(db), "--exact", "--json")
    assert result.exit_code == 0, result.stderr
    stats = json.loads(result.stdout)
    assert stats["exact"] is True
    assert stats["consumers"]["billing"] == {
        "in_progress": 0, "completed": 5, "failed": 1, "total": 6,
    }  # fmt: skip
    table = run("inbox", "stats", "--store", url_of(db), "--exact")
    assert "estimate" not in table.stdout and "~" not in table.stdout
    assert f"live records: {len(LIVE_KEYS)}; expired, awaiting purge: 3" in table.stdout


def test_estimates_never_write(db: Path) -> None:
    before = db.read_bytes()
    assert run("inbox", "stats", "--store", url_of(db)).exit_code == 0
    assert db.read_bytes() == before


# ------------------------------------------------------------------------- PostgreSQL


@pytest.fixture
def pg_url() -> Iterator[str]:
    require("PostgreSQL", POSTGRES_DSN, 5432)
    table = "oncely_t_cli_stats"
    drop_tables(table)
    store = PostgresStore(POSTGRES_DSN, table=table)
    try:
        store.migrate()
        for consumer, n in (("orders", 4000), ("mail", 1500), ("rare", 7)):
            for start in range(0, n, 500):
                requests = [
                    ClaimRequest(f"{consumer}-{i}", None, f"t{i}")
                    for i in range(start, min(start + 500, n))
                ]
                store.claim_many(
                    consumer, requests, lease_ms=60_000, keep_ms=3_600_000, takeover=False
                )
        for i in range(300):
            store.complete("mail", f"mail-{i}", token=f"t{i}", result=None, keep_ms=3_600_000)
        with psycopg.connect(POSTGRES_DSN, autocommit=True) as conn:
            conn.execute(f'ANALYZE "{table}"')
        yield f"{POSTGRES_DSN}?table={table}"
    finally:
        store.close()
        drop_tables(table)


def test_postgres_default_estimates_and_exact_counts(pg_url: str) -> None:
    estimate = run("inbox", "stats", "--store", pg_url, "--json")
    assert estimate.exit_code == 0, estimate.stderr
    found = json.loads(estimate.stdout)
    assert found["exact"] is False
    totals = {c: v["total"] for c, v in found["consumers"].items()}
    assert totals["rare"] == 7  # counted outright
    assert abs(totals["orders"] - 4000) <= 400 and abs(totals["mail"] - 1500) <= 150
    assert abs(found["statuses"]["completed"] - 300) <= 0.02 * 5507 + 30
    exact = run("inbox", "stats", "--store", pg_url, "--json", "--exact")
    counted = json.loads(exact.stdout)
    assert counted["exact"] is True
    assert counted["consumers"]["mail"] == {
        "in_progress": 1200, "completed": 300, "failed": 0, "total": 1500,
    }  # fmt: skip
    assert counted["total"] == 5507
    table = run("inbox", "stats", "--store", pg_url)
    assert "by status, all consumers: in_progress ~" in table.stdout
    assert _cells(table.stdout, "rare") == ["7"]  # counted, so not marked ~
    assert _cells(table.stdout, "orders")[0].startswith("~")
    assert "live records: ~" in table.stdout  # the planner's share of the total
    assert found["counted"] == {"consumers": ["rare"], "total": False, "expired": True}
