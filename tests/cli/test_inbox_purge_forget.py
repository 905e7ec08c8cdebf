"""``oncely inbox purge`` and ``forget`` against a real SQLite file.

Records are created through the real :class:`oncely.Inbox` and store API first (the ``db``
fixture); the CLI then purges and forgets them, and every claim about the database is checked
with sqlite3.
"""

from __future__ import annotations

import sqlite3
import subprocess
from pathlib import Path

import oncely
from tests.backends import BACKENDS
from tests.cli.helpers import EXECUTABLE, LIVE_KEYS, charge, count, rows, run, url_of
from tests.services import POSTGRES_DSN

# ---------------------------------------------------------------------------- purge


def test_r13_purge_deletes_expired_records_only(db: Path) -> None:
    assert count(db, "old") == 3
    result = run("inbox", "purge", "--store", url_of(db))
    assert result.exit_code == 0, result.stderr
    assert result.stdout.strip() == "purged 3 expired records"
    assert count(db, "old") == 0
    assert rows(db, "SELECT count(*) FROM oncely_inbox")[0][0] == len(LIVE_KEYS)
    again = run("inbox", "purge", "--store", url_of(db))
    assert again.stdout.strip() == "purged 0 expired records"


def test_purge_in_bounded_batches(db: Path) -> None:
    result = run("inbox", "purge", "--store", url_of(db), "--batch-size", "2",
                 "--max-batches", "1")  # fmt: skip
    assert result.exit_code == 0, result.stderr
    assert result.stdout.strip() == "purged 2 expired records"
    assert count(db, "old") == 1


def test_purge_refuses_max_batches_for_a_service(db: Path) -> None:
    # Before, --every ran the service and ignored --max-batches without a word.
    result = run("inbox", "purge", "--store", url_of(db), "--every", "1m", "--max-batches", "1")
    assert result.exit_code == 2
    assert "--max-batches is for a one-off purge" in result.stderr
    assert count(db, "old") == 3


def test_r13_a_purge_service_whose_table_is_missing_exits_at_start(tmp_path: Path) -> None:
    """`oncely inbox purge --every` on a store it cannot purge at start (a mistyped table,
    a database never migrated) exits 4 naming the fix, as `oncely consume` refuses to
    start, rather than run for ever purging nothing, which a supervisor takes for health."""
    BACKENDS["postgres"].require()
    empty = tmp_path / "empty.db"
    sqlite3.connect(empty).close()  # the file exists, with no tables
    sep = "&" if "?" in POSTGRES_DSN else "?"
    for url in (url_of(empty), f"{POSTGRES_DSN}{sep}table=oncely_no_such_table"):
        done = subprocess.run(
            [str(EXECUTABLE), "inbox", "purge", "--store", url, "--every", "1s"],
            check=False, capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert done.returncode == 4, (url, done.stdout, done.stderr)
        assert "oncely migrate" in done.stderr


def test_purge_takes_a_pause_between_batches(db: Path) -> None:
    result = run("inbox", "purge", "--store", url_of(db), "--batch-size", "1",
                 "--pause", "0.5")  # fmt: skip
    assert result.exit_code == 0, result.stderr
    assert result.stdout.strip() == "purged 3 expired records"
    refused = run("inbox", "purge", "--store", url_of(db), "--pause", "-1")
    assert refused.exit_code == 2
    assert "--pause" in refused.stderr


# --------------------------------------------------------------------------- forget


def test_forget_with_yes_deletes_the_record(db: Path) -> None:
    result = run("inbox", "forget", "--store", url_of(db), "--consumer", "billing", "order-2",
                 "--yes")  # fmt: skip
    assert result.exit_code == 0, result.stderr
    assert "forgot" in result.stdout
    assert rows(db, "SELECT 1 FROM oncely_inbox WHERE key = 'order-2'") == []
    # The next delivery is processed again as new.
    store = oncely.SQLiteStore(db)
    try:
        handled = oncely.Inbox(store, consumer="billing").handle("order-2", {"amount": 2}, charge)
    finally:
        store.close()
    assert handled.outcome is oncely.Outcome.PROCESSED


def test_forget_asks_first(db: Path) -> None:
    refused = run("inbox", "forget", "--store", url_of(db), "--consumer", "billing", "order-1",
                  stdin="n\n")  # fmt: skip
    assert refused.exit_code == 1
    assert rows(db, "SELECT 1 FROM oncely_inbox WHERE key = 'order-1'") == [(1,)]
    agreed = run("inbox", "forget", "--store", url_of(db), "--consumer", "billing", "order-1",
                 stdin="y\n")  # fmt: skip
    assert agreed.exit_code == 0, agreed.stderr
    assert rows(db, "SELECT 1 FROM oncely_inbox WHERE key = 'order-1'") == []


def test_forget_missing_record_exits_1(db: Path) -> None:
    result = run("inbox", "forget", "--store", url_of(db), "--consumer", "billing", "nope",
                 "--yes")  # fmt: skip
    assert result.exit_code == 1
    assert "no record" in result.stderr
