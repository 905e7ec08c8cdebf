"""The ``oncely`` command line, against real SQLite files and the installed executable.

Records are created through the real :class:`oncely.Inbox` and store API first; the CLI then
reads, purges and forgets them, and every claim about the database is checked with sqlite3.

The tests named ``test_demo_*`` (marked DEMO below) run the demo engine ``oncely.demo``, which
is written separately; without it they fail with "the demo is not available".
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import tempfile
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from hypothesis import given
from hypothesis import strategies as st

import oncely
from oncely.cli import cli
from oncely.cli._demo import self_check
from oncely.cli._durations import parse_duration
from oncely.cli._retention import recommend

EXECUTABLE = Path(sys.executable).parent / "oncely"
SECRET = "s3cret-Pa55"
PAST = datetime(2020, 1, 1, tzinfo=UTC)
TOKEN = "ab" * 16


def url_of(path: Path) -> str:
    return f"sqlite:///{path}"


def run(*args: str, env: dict[str, str] | None = None, stdin: str | None = None) -> Result:
    """``oncely ARGS`` in this process, stdout and stderr apart."""
    # ONCELY_STORE from the developer's shell must not leak into a test.
    environment: dict[str, str | None] = {"ONCELY_STORE": None}
    environment.update(env or {})
    return CliRunner().invoke(cli, list(args), env=environment, input=stdin)


def rows(path: Path, sql: str) -> list[tuple[object, ...]]:
    with sqlite3.connect(path) as conn:
        return list(conn.execute(sql))


def charge(payload: dict[str, int]) -> dict[str, int]:
    return {"charged": payload["amount"]}


def refuse(_payload: object) -> None:
    raise oncely.Reject("amount is negative")


@pytest.fixture
def db(tmp_path: Path) -> Path:
    """A migrated SQLite file holding a known set of records:

    * billing: order-1..order-5 completed (JSON results), order-bad failed (poison)
    * email: msg-live in progress under a live lease; msg-stale in progress, lease lapsed
    * files: blob completed with a binary result; ansi completed with escape codes in it
    * a/b (a consumer name with a slash): k1 completed
    * old: 3 expired records (written in 2020 with one day of retention), awaiting a purge
    """
    path = tmp_path / "inbox.db"
    store = oncely.SQLiteStore(path)
    past = oncely.SQLiteStore(path, clock=oncely.FakeClock(PAST))
    try:
        billing = oncely.Inbox(store, consumer="billing")
        for n in range(1, 6):
            assert billing.handle(f"order-{n}", {"amount": n}, charge).outcome is (
                oncely.Outcome.PROCESSED
            )
        assert billing.handle("order-bad", {"amount": -1}, refuse).outcome is (
            oncely.Outcome.REJECTED
        )
        store.claim(
            "email", "msg-live", fingerprint=None, token=TOKEN,
            lease_ms=3_600_000, keep_ms=86_400_000, takeover=False,
        )  # fmt: skip
        # Claimed in 2020 with a one-second lease and retention until far in the future.
        past.claim(
            "email", "msg-stale", fingerprint=None, token=TOKEN,
            lease_ms=1000, keep_ms=100 * 365 * 86_400_000, takeover=False,
        )  # fmt: skip
        files = oncely.Inbox(store, consumer="files", codec=oncely.RawCodec())
        files.handle("blob", "b", lambda _p: b"\x89PNG\x00\xff\x1b[31m" + bytes(100))
        files.handle("ansi", "a", lambda _p: b"\x1b[2Jcleared [bold]screen[/bold]")
        oncely.Inbox(store, consumer="a/b").handle("k1", 1, lambda _p: 1)
        old = oncely.Inbox(past, consumer="old", retention=oncely.Retention(keep=timedelta(days=1)))
        for n in range(3):
            old.handle(f"gone-{n}", n, lambda _p: None)
    finally:
        store.close()
        past.close()
    return path


LIVE_KEYS = [
    ("a/b", "k1"),
    ("billing", "order-1"),
    ("billing", "order-2"),
    ("billing", "order-3"),
    ("billing", "order-4"),
    ("billing", "order-5"),
    ("billing", "order-bad"),
    ("email", "msg-live"),
    ("email", "msg-stale"),
    ("files", "ansi"),
    ("files", "blob"),
]


# ----------------------------------------------------------------------------- help


def test_help_documents_every_command_and_the_exit_codes() -> None:
    result = run("--help")
    assert result.exit_code == 0
    for command in ("demo", "migrate", "inbox", "retention"):
        assert command in result.stdout
    assert "Exit codes" in result.stdout
    for line in ("0  success", "3  store unavailable", "4  schema problem"):
        assert line in result.stdout
    assert "ONCELY_STORE" in result.stdout


@pytest.mark.parametrize(
    "command",
    [
        ["demo"],
        ["migrate"],
        ["retention"],
        ["inbox"],
        ["inbox", "stats"],
        ["inbox", "list"],
        ["inbox", "show"],
        ["inbox", "purge"],
        ["inbox", "forget"],
    ],
)
def test_every_command_has_help(command: list[str]) -> None:
    result = run(*command, "--help")
    assert result.exit_code == 0, result.stderr
    assert "Usage: oncely " + " ".join(command) in result.stdout
    # A real description, not just the option list.
    description = result.stdout.split("Options:")[0].splitlines()[2:]
    assert any(line.strip() for line in description)


# -------------------------------------------------------------------------- migrate


def test_migrate_creates_the_schema_and_is_repeatable(tmp_path: Path) -> None:
    path = tmp_path / "fresh.db"
    first = run("migrate", "--store", url_of(path))
    assert first.exit_code == 0, first.stderr
    assert "schema version 1 ready" in first.stdout
    assert rows(path, "SELECT value FROM oncely_inbox_meta WHERE name = 'schema_version'") == [
        ("1",)
    ]
    second = run("migrate", "--store", url_of(path))
    assert second.exit_code == 0
    assert "already in place" in second.stdout


def test_migrate_uses_oncely_store_from_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "env.db"
    result = run("migrate", env={"ONCELY_STORE": url_of(path)})
    assert result.exit_code == 0, result.stderr
    assert path.exists()
    assert str(path) in result.stdout


def test_migrate_defaults_to_oncely_db_in_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    result = run("migrate")
    assert result.exit_code == 0, result.stderr
    assert "sqlite:///oncely.db" in result.stdout
    assert (tmp_path / "oncely.db").exists()


def test_migrate_memory_store() -> None:
    result = run("migrate", "--store", "memory://")
    assert result.exit_code == 0
    assert "schema version 1" in result.stdout


# ---------------------------------------------------------------------------- stats


def test_r5_stats_counts_per_consumer_and_status(db: Path) -> None:
    result = run("inbox", "stats", "--store", url_of(db), "--json")
    assert result.exit_code == 0, result.stderr
    stats = json.loads(result.stdout)
    assert stats["consumers"]["billing"] == {
        "in_progress": 0,
        "completed": 5,
        "failed": 1,
        "total": 6,
    }
    assert stats["consumers"]["email"]["in_progress"] == 2
    assert stats["consumers"]["files"]["completed"] == 2
    assert "old" not in stats["consumers"]  # expired records count as absent...
    assert stats["expired"] == 3  # ...but wait for a purge
    assert stats["total"] == len(LIVE_KEYS)


def test_stats_table(db: Path) -> None:
    result = run("inbox", "stats", "--store", url_of(db))
    assert result.exit_code == 0, result.stderr
    billing = next(line for line in result.stdout.splitlines() if "billing" in line)
    assert [int(n) for n in billing.replace("│", " ").split()[1:]] == [0, 5, 1, 6]
    assert f"live records: {len(LIVE_KEYS)}; expired, awaiting purge: 3" in result.stdout


def test_inspection_never_creates_a_database(tmp_path: Path) -> None:
    path = tmp_path / "typo.db"
    for command in (["stats"], ["list"], ["purge"], ["show", "--consumer", "c", "k"]):
        result = run("inbox", *command, "--store", url_of(path))
        assert result.exit_code == 4, (command, result.stderr)
        assert "oncely migrate --store" in result.stderr
    assert not path.exists()


def test_missing_tables_exit_4_with_the_fix(tmp_path: Path) -> None:
    path = tmp_path / "other.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE unrelated (x)")
    result = run("inbox", "stats", "--store", url_of(path))
    assert result.exit_code == 4
    assert "oncely migrate" in result.stderr
    assert rows(path, "SELECT name FROM sqlite_master WHERE name LIKE 'oncely%'") == []


# ----------------------------------------------------------------------------- list


def test_list_json_holds_every_live_record_in_order(db: Path) -> None:
    result = run("inbox", "list", "--store", url_of(db), "--json")
    assert result.exit_code == 0, result.stderr
    page = json.loads(result.stdout)
    assert [(r["consumer"], r["key"]) for r in page["records"]] == LIVE_KEYS
    assert page["next"] is None
    first = page["records"][1]
    assert first["status"] == "completed"
    assert first["result_size"] == len(b'{"charged":1}')
    assert datetime.fromisoformat(first["expires_at"]) > datetime.now(UTC)


def test_list_filters_by_consumer_and_status(db: Path) -> None:
    result = run(
        "inbox", "list", "--store", url_of(db), "--consumer", "billing", "--status", "failed",
        "--json",
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    records = json.loads(result.stdout)["records"]
    assert [(r["key"], r["error"]) for r in records] == [("order-bad", "amount is negative")]


def test_list_paginates_with_the_printed_cursor(db: Path) -> None:
    seen: list[tuple[str, str]] = []
    after: list[str] = []
    for _ in range(10):
        result = run("inbox", "list", "--store", url_of(db), "--limit", "3", "--json", *after)
        assert result.exit_code == 0, result.stderr
        page = json.loads(result.stdout)
        assert len(page["records"]) <= 3
        seen += [(r["consumer"], r["key"]) for r in page["records"]]
        if page["next"] is None:
            break
        after = ["--after-consumer", page["next"]["consumer"], "--after-key", page["next"]["key"]]
    assert seen == LIVE_KEYS


def test_list_table_prints_the_next_page_option(db: Path) -> None:
    result = run("inbox", "list", "--store", url_of(db), "--limit", "2")
    assert result.exit_code == 0, result.stderr
    # The second record is billing/order-1; the cursor is ready to paste.
    assert "next page: --after billing/order-1" in result.stdout
    follow = run("inbox", "list", "--store", url_of(db), "--limit", "2", "--after",
                 "billing/order-1", "--json")  # fmt: skip
    keys = [(r["consumer"], r["key"]) for r in json.loads(follow.stdout)["records"]]
    assert keys == LIVE_KEYS[2:4]


def test_list_cursor_for_a_consumer_with_a_slash(db: Path) -> None:
    result = run("inbox", "list", "--store", url_of(db), "--limit", "1")
    assert "next page: --after-consumer a/b --after-key k1" in result.stdout
    # --after splits at the first slash, so it cannot name that consumer: it says so.
    after = run("inbox", "list", "--store", url_of(db), "--after", "/k1")
    assert after.exit_code == 2
    assert "--after-consumer" in after.stderr


def test_list_rejects_both_cursor_forms(db: Path) -> None:
    result = run("inbox", "list", "--store", url_of(db), "--after", "billing/x",
                 "--after-consumer", "billing")  # fmt: skip
    assert result.exit_code == 2


def test_list_never_writes_control_characters_to_the_terminal(tmp_path: Path) -> None:
    path = tmp_path / "evil.db"
    store = oncely.SQLiteStore(path)
    try:
        inbox = oncely.Inbox(store, consumer="evil\x1b]0;owned\x07")
        inbox.handle("key\x1b[2J[bold]x[/bold]", 1, lambda _p: "\x1b[31m")
    finally:
        store.close()
    for args in (["list"], ["stats"], ["list", "--json"], ["stats", "--json"]):
        result = run("inbox", *args, "--store", url_of(path))
        assert result.exit_code == 0, result.stderr
        assert "\x1b" not in result.stdout
        assert "\x07" not in result.stdout
    table = run("inbox", "list", "--store", url_of(path)).stdout
    assert "\\x1b[2J[bold]x[/bold]" in table  # escaped, and markup shown literally


# ----------------------------------------------------------------------------- show


def test_show_json_has_the_full_record(db: Path) -> None:
    result = run("inbox", "show", "--store", url_of(db), "--consumer", "billing", "order-3",
                 "--json")  # fmt: skip
    assert result.exit_code == 0, result.stderr
    record = json.loads(result.stdout)
    assert record["status"] == "completed"
    assert record["attempt"] == 1
    assert record["fingerprint"]
    assert record["result_encoding"] == "utf-8"
    assert json.loads(record["result_preview"]) == {"charged": 3}
    for field in ("created_at", "updated_at", "lease_until", "expires_at"):
        assert datetime.fromisoformat(record[field]).tzinfo is not None
    assert record["lease"] == "none (not in progress)"


def test_show_text(db: Path) -> None:
    result = run("inbox", "show", "--store", url_of(db), "--consumer", "billing", "order-bad")
    assert result.exit_code == 0, result.stderr
    for word in ("failed", "amount is negative", "order-bad", "expires"):
        assert word in result.stdout


def test_r10_show_tells_a_live_lease_from_a_stale_one(db: Path) -> None:
    live = run("inbox", "show", "--store", url_of(db), "--consumer", "email", "msg-live",
               "--json")  # fmt: skip
    stale = run("inbox", "show", "--store", url_of(db), "--consumer", "email", "msg-stale",
                "--json")  # fmt: skip
    live_record, stale_record = json.loads(live.stdout), json.loads(stale.stdout)
    assert (live_record["live"], live_record["stale"]) == (True, False)
    assert live_record["lease"].startswith("held until")
    assert (stale_record["live"], stale_record["stale"]) == (False, True)
    assert "stale" in stale_record["lease"]
    assert stale_record["lease_until"].startswith("2020-01-01T00:00:01")


def test_show_binary_result_as_hex(db: Path) -> None:
    for args in ([], ["--json"]):
        result = run("inbox", "show", "--store", url_of(db), "--consumer", "files", "blob", *args)
        assert result.exit_code == 0, result.stderr
        assert "\x00" not in result.stdout
        assert "\x1b" not in result.stdout
        assert "89 50 4e 47 00 ff 1b" in result.stdout
    record = json.loads(result.stdout)
    assert record["result_encoding"] == "binary"
    assert record["result_size"] == len(b"\x89PNG\x00\xff\x1b[31m") + 100


def test_show_escapes_text_results(db: Path) -> None:
    result = run("inbox", "show", "--store", url_of(db), "--consumer", "files", "ansi")
    assert result.exit_code == 0
    assert "\x1b" not in result.stdout
    assert "\\x1b[2Jcleared [bold]screen[/bold]" in result.stdout


def test_show_missing_key_is_a_clear_error(db: Path) -> None:
    result = run("inbox", "show", "--store", url_of(db), "--consumer", "billing", "order-99")
    assert result.exit_code == 1
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1
    assert "no live record for consumer 'billing' and key 'order-99'" in result.stderr
    # An expired record is absent too, even before the purge.
    expired = run("inbox", "show", "--store", url_of(db), "--consumer", "old", "gone-0")
    assert expired.exit_code == 1


# ---------------------------------------------------------------------------- purge


def count(path: Path, consumer: str) -> int:
    found = rows(path, f"SELECT count(*) FROM oncely_inbox WHERE consumer = '{consumer}'")
    return int(str(found[0][0]))


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


# ------------------------------------------------------------------------- retention


def test_r13_retention_horizon_and_recommendation() -> None:
    result = run("retention", "--max-deliveries", "10", "--lock", "5m", "--message-ttl", "3d",
                 "--redelivery-delay", "1m", "--resubmit-window", "1d", "--json")  # fmt: skip
    assert result.exit_code == 0, result.stderr
    figures = json.loads(result.stdout)
    # 3d + 10 x (5m + 1m) + 1d = 4d1h
    assert figures["horizon"] == "4d1h"
    assert figures["horizon_ms"] == (4 * 24 + 1) * 3_600_000
    assert figures["formula"] == (
        "max_deliveries=10 x (lock=5m + delay=1m) + message_ttl=3d + resubmit_window=1d"
    )
    # 4d1h x 1.25 = 5d1h15m, rounded up to whole days
    assert figures["recommended"] == "6d"
    assert figures["keep"] is None


def test_r13_retention_text_output() -> None:
    result = run("retention", "--max-deliveries", "10", "--lock", "5m", "--message-ttl", "3d")
    assert result.exit_code == 0, result.stderr
    assert "redelivery horizon     3d50m" in result.stdout
    assert "max_deliveries=10 x lock=5m + message_ttl=3d" in result.stdout
    assert "recommended retention  4d" in result.stdout
    assert "timedelta(days=4)" in result.stdout


def test_r13_retention_keep_long_enough() -> None:
    result = run("retention", "--max-deliveries", "10", "--lock", "5m", "--message-ttl", "3d",
                 "--keep", "7d")  # fmt: skip
    assert result.exit_code == 0, result.stderr
    assert "retention 7d covers the horizon (3d23h10m to spare)" in result.stdout
    exact = run("retention", "--max-deliveries", "10", "--lock", "5m", "--message-ttl", "3d",
                "--keep", "3d50m")  # fmt: skip
    assert exact.exit_code == 0
    assert "below the recommended" in exact.stdout


def test_r13_retention_too_short_exits_1_with_the_reason() -> None:
    result = run("retention", "--max-deliveries", "10", "--lock", "5m", "--message-ttl", "3d",
                 "--keep", "1h")  # fmt: skip
    assert result.exit_code == 1
    assert result.stderr.strip() == (
        "Error: retention 1h is below the redelivery horizon 3d50m "
        "(max_deliveries=10 x lock=5m + message_ttl=3d); raise retention or lower the "
        "broker's limits"
    )
    as_json = run("retention", "--max-deliveries", "10", "--lock", "5m", "--message-ttl", "3d",
                  "--keep", "3d49m", "--json")  # fmt: skip
    assert as_json.exit_code == 1
    assert json.loads(as_json.stdout)["keep_ok"] is False


@pytest.mark.parametrize(
    ("horizon", "expected"),
    [
        (timedelta(0), timedelta(hours=1)),
        (timedelta(minutes=1), timedelta(hours=1)),
        (timedelta(hours=1), timedelta(hours=2)),
        (timedelta(hours=19, minutes=12), timedelta(days=1)),
        (timedelta(days=3, minutes=50), timedelta(days=4)),
        (timedelta(days=14), timedelta(days=18)),
    ],
)
def test_recommendation_rounds_up_a_quarter_more(horizon: timedelta, expected: timedelta) -> None:
    assert recommend(horizon) == expected
    assert recommend(horizon) >= horizon * 1.25


# ------------------------------------------------------------------------- durations


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("30s", timedelta(seconds=30)),
        ("5m", timedelta(minutes=5)),
        ("2h", timedelta(hours=2)),
        ("3d", timedelta(days=3)),
        ("1d12h", timedelta(days=1, hours=12)),
        ("250ms", timedelta(milliseconds=250)),
        ("1m30s", timedelta(seconds=90)),
        ("1d2h3m4s5ms", timedelta(days=1, hours=2, minutes=3, seconds=4, milliseconds=5)),
        ("0s", timedelta(0)),
        ("90m", timedelta(minutes=90)),
    ],
)
def test_durations_parse(text: str, expected: timedelta) -> None:
    assert parse_duration(text) == expected


@pytest.mark.parametrize(
    "text",
    ["", "5", "5x", "1.5h", "-5m", "+5m", "5 m", " 5m", "5m ", "5M", "1h1d", "1h1h", "ms", "m5",
     "5mss", "1d 2h", "9999999999999d", "99999999999d"],
)  # fmt: skip
def test_bad_durations_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match=r"duration|unit"):
        parse_duration(text)


@pytest.mark.parametrize("text", ["5x", "1.5h", "5", "1h1d"])
def test_bad_duration_is_a_usage_error(text: str) -> None:
    result = run("retention", "--max-deliveries", "3", "--lock", text, "--message-ttl", "1d")
    assert result.exit_code == 2
    assert "Invalid value for '--lock'" in result.stderr
    assert result.stdout == ""


@given(st.integers(min_value=0, max_value=10**12))
def test_durations_read_back_what_format_duration_writes(ms: int) -> None:
    delta = timedelta(milliseconds=ms)
    assert parse_duration(oncely.format_duration(delta)) == delta


def test_zero_max_deliveries_is_a_usage_error() -> None:
    result = run("retention", "--max-deliveries", "0", "--lock", "1m", "--message-ttl", "1d")
    assert result.exit_code == 2


@pytest.mark.parametrize("lock", ["99999999d", "999999990d"])
def test_an_absurd_horizon_is_a_usage_error(lock: str) -> None:
    result = run("retention", "--max-deliveries", "1000", "--lock", lock, "--message-ttl", "1d")
    assert result.exit_code == 2
    assert "longer than any retention" in result.stderr


# ------------------------------------------------------------------------ exit codes


def test_schema_too_new_exits_4(db: Path) -> None:
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE oncely_inbox_meta SET value = '99' WHERE name = 'schema_version'")
    for command in (["inbox", "stats"], ["inbox", "list"], ["migrate"]):
        result = run(*command, "--store", url_of(db))
        assert result.exit_code == 4, (command, result.stderr)
        assert "schema version 99" in result.stderr
        assert "upgrade oncely" in result.stderr
        assert "Traceback" not in result.stderr
    assert rows(db, "SELECT value FROM oncely_inbox_meta")[0] == ("99",)


def test_unopenable_store_exits_3(tmp_path: Path) -> None:
    # A directory where the database file should be, and a file in a missing directory.
    for url in (url_of(tmp_path), url_of(tmp_path / "missing" / "x.db")):
        result = run("migrate", "--store", url)
        assert result.exit_code == 3, result.stderr
        assert result.stderr.startswith("Error: ")
        assert result.stderr.count("\n") == 1


def test_locked_store_exits_3(db: Path) -> None:
    holder = sqlite3.connect(db, isolation_level=None)
    try:
        holder.execute("BEGIN EXCLUSIVE")
        result = run("inbox", "purge", "--store", url_of(db) + "?busy_timeout=0.2")
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert result.exit_code == 3, result.stderr
    assert "locked" in result.stderr
    assert count(db, "old") == 3


def test_corrupt_file_exits_5(tmp_path: Path) -> None:
    path = tmp_path / "garbage.db"
    path.write_bytes(b"this is not a database, just text " * 200)
    result = run("inbox", "stats", "--store", url_of(path))
    assert result.exit_code == 5, result.stderr
    assert "not a database" in result.stderr
    assert "Traceback" not in result.stderr


def test_debug_shows_the_exception_instead(tmp_path: Path) -> None:
    result = run("--debug", "migrate", "--store", url_of(tmp_path))
    assert isinstance(result.exception, oncely.StoreUnavailable)


@pytest.mark.parametrize(
    "url",
    ["mongodb://admin@db.example/app", "kafka://localhost:9092", "ftp://x/y", "oncely.db"],
)
def test_unsupported_url_scheme_is_a_usage_error(url: str) -> None:
    result = run("inbox", "stats", "--store", url)
    assert result.exit_code == 2
    assert "unsupported store URL scheme" in result.stderr
    assert "sqlite://" in result.stderr  # names what is supported


@pytest.mark.parametrize(
    "url",
    [
        f"postgresql://admin:{SECRET}@db.invalid:5432/app?connect_timeout=1",
        f"redis://admin:{SECRET}@db.invalid:6379/0?password={SECRET}",
        f"sqlite://admin:{SECRET}@db.example/x.db",
        f"mysql://admin:{SECRET}@db.example/app?x=1",
        f"postgresql://admin:{SECRET}@[db.example/app",  # malformed: cannot even be parsed
    ],
)
def test_a_password_in_the_url_is_never_printed(url: str) -> None:
    commands = [
        ["migrate", "--store", url],
        ["inbox", "stats", "--store", url],
        ["inbox", "list", "--store", url, "--json"],
        ["inbox", "show", "--store", url, "--consumer", "c", "k"],
        ["inbox", "purge", "--store", url],
        ["inbox", "forget", "--store", url, "--consumer", "c", "k", "--yes"],
        ["--debug", "inbox", "stats", "--store", url],
    ]
    for command in commands:
        result = run(*command)
        assert SECRET not in result.stdout + result.stderr + str(result.exception)
        if command[0] == "--debug" and result.exit_code == 1:
            continue  # --debug raises the store error for its traceback
        # A usage error (bad URL, unknown option) or an unreachable server: never a crash.
        assert result.exit_code in (2, 3), (command, result.stderr)
        assert "***" in result.stderr or "not a valid URL" in result.stderr
    from_env = run("inbox", "stats", env={"ONCELY_STORE": url})
    assert from_env.exit_code in (2, 3)
    assert SECRET not in from_env.stdout + from_env.stderr


# --------------------------------------------------------------- the real executable


def test_installed_executable_help_and_migrate(tmp_path: Path) -> None:
    assert EXECUTABLE.exists(), f"{EXECUTABLE} is missing: pip install -e '.[cli]'"
    helped = subprocess.run(
        [str(EXECUTABLE), "--help"], capture_output=True, text=True, timeout=60, check=False
    )
    assert helped.returncode == 0, helped.stderr
    assert "Exit codes" in helped.stdout
    path = tmp_path / "proc.db"
    env = {**os.environ, "ONCELY_STORE": url_of(path)}
    migrated = subprocess.run(
        [str(EXECUTABLE), "migrate"], capture_output=True, text=True, env=env, timeout=60,
        check=False,
    )  # fmt: skip
    assert migrated.returncode == 0, migrated.stderr
    assert migrated.stdout.strip() == f"schema version 1 ready in {url_of(path)}"
    assert rows(path, "SELECT value FROM oncely_inbox_meta") == [("1",)]
    stats = subprocess.run(
        [str(EXECUTABLE), "inbox", "stats", "--json"], capture_output=True, text=True, env=env,
        timeout=60, check=False,
    )  # fmt: skip
    assert stats.returncode == 0, stats.stderr
    assert json.loads(stats.stdout)["total"] == 0


def test_installed_executable_exit_codes(tmp_path: Path) -> None:
    def code(*args: str) -> int:
        env = {k: v for k, v in os.environ.items() if k != "ONCELY_STORE"}
        done = subprocess.run(
            [str(EXECUTABLE), *args], capture_output=True, text=True, env=env, cwd=tmp_path,
            timeout=60, check=False,
        )  # fmt: skip
        assert "Traceback" not in done.stderr
        return done.returncode

    assert code("inbox", "stats") == 4  # ./oncely.db does not exist
    assert code("retention", "--max-deliveries", "2", "--lock", "1m", "--message-ttl", "1h",
                "--keep", "1m") == 1  # fmt: skip
    assert code("retention", "--lock", "soon") == 2
    assert code("migrate", "--store", url_of(tmp_path)) == 3


def test_python_dash_m() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "oncely.cli", "--version"], capture_output=True, text=True,
        timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0
    assert oncely.__version__ in done.stdout


# --------------------------------------------------------------------------- the demo


def test_demo_self_check_rules() -> None:
    clean = {
        "naive": {"extra_effects": 12, "lost": 0},
        "oncely-transactional": {"extra_effects": 0, "lost": 0},
        "oncely-two-phase": {"extra_effects": 0, "lost": 0},
    }
    assert self_check(clean) == []
    assert self_check({**clean, "oncely-two-phase": {"extra_effects": 1, "lost": 0}}) == [
        "oncely-two-phase: extra_effects=1"
    ]
    assert self_check({**clean, "oncely-transactional": {"extra_effects": 0, "lost": 2}}) == [
        "oncely-transactional: lost=2"
    ]
    assert self_check({"naive": clean["naive"]}) == [
        "oncely-transactional: missing from the report",
        "oncely-two-phase: missing from the report",
    ]
    assert self_check({**clean, "oncely-extra": {"lost": 0}}) == [
        "oncely-extra: extra_effects=None"
    ]


# DEMO: the tests below run the real demo engine (oncely.demo, written separately). Without it
# they fail with "the demo is not available in this installation". Each run takes a
# few seconds (worker processes, a SIGKILL, an expired lock), so there are only two.

DEMO = ("demo", "--messages", "40", "--workers", "2", "--seed", "7")


def test_demo_json_keep_with_the_real_executable(tmp_path: Path) -> None:
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    env.pop("ONCELY_STORE", None)
    done = subprocess.run(
        [str(EXECUTABLE), *DEMO, "--json", "--keep"], capture_output=True, text=True, env=env,
        timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)  # exactly one JSON document on stdout, nothing else
    assert {"naive", "oncely-transactional", "oncely-two-phase"} <= set(report)
    for name in ("oncely-transactional", "oncely-two-phase"):
        assert report[name]["extra_effects"] == 0
        assert report[name]["lost"] == 0
    assert report["naive"]["extra_effects"] > 0  # the duplicates were real
    line = next(x for x in done.stderr.splitlines() if x.startswith("work directory kept: "))
    workdir = Path(line.removeprefix("work directory kept: "))
    assert workdir.is_dir()
    assert workdir.parent == tmp_path


def test_demo_table_and_cleanup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    result = run(*DEMO)
    assert result.exit_code == 0, result.stderr
    for name in ("naive", "oncely-transactional", "oncely-two-phase"):
        assert name in result.stdout
    assert "self-check passed" in result.stdout
    assert list(tmp_path.iterdir()) == []  # without --keep the work directory is gone


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--store", "memory://"], "memory://"),
        (["--store", f"postgresql://admin:{SECRET}@db/app"], "SQLite store"),
        (["--messages", "5"], "5 is not in the range x>=12"),
    ],
)
def test_demo_refuses_options_it_cannot_run(args: list[str], says: str) -> None:
    result = run("demo", *args)
    assert result.exit_code == 2, result.stderr
    assert says in result.stderr
    assert SECRET not in result.stdout + result.stderr


def test_demo_defaults_are_the_engines() -> None:
    from oncely.demo import DemoOptions

    defaults = DemoOptions()
    params = {p.name: p.default for p in cli.commands["demo"].params}
    assert (params["messages"], params["workers"], params["seed"]) == (
        defaults.messages,
        defaults.workers,
        defaults.seed,
    )
