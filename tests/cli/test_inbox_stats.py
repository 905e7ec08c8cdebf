"""``oncely inbox stats``: estimates by default, ``--exact`` counts every record.

The SQLite sample database (the ``db`` fixture) is small: its estimate counts every consumer
and the expired records outright, so the default answer has the exact totals, marked as
estimates, with no status split (SQLite keeps no statistic of it). On PostgreSQL, a table of
a few thousand records after ANALYZE: the default answer is the planner's estimate, within
10%, with its status split; ``--exact`` is the exact count.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

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


def test_the_default_is_an_estimate_and_says_so(db: Path) -> None:
    result = run("inbox", "stats", "--store", url_of(db))
    assert result.exit_code == 0, result.stderr
    out = result.stdout
    assert "estimates from the database's statistics; --exact counts every record" in out
    assert f"live records: ~{len(LIVE_KEYS)}; expired, awaiting purge: ~3" in out
    billing = next(line for line in out.splitlines() if "billing" in line)
    assert billing.replace("│", " ").split()[1:] == ["~6"]
    assert "by status: not estimated on this store (--exact counts them)" in out


def test_the_default_json_holds_exact_false(db: Path) -> None:
    result = run("inbox", "stats", "--store", url_of(db), "--json")
    assert result.exit_code == 0, result.stderr
    stats = json.loads(result.stdout)
    assert stats["exact"] is False
    # Small consumers are counted outright, even by an estimate.
    assert {c: v["total"] for c, v in stats["consumers"].items()} == _live_per_consumer()
    assert stats["total"] == len(LIVE_KEYS)
    assert stats["expired"] == 3
    assert stats["statuses"] is None


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
    assert "~7" in table.stdout
