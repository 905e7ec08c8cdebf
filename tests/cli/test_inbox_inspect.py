"""``oncely inbox stats``, ``list`` and ``show`` against a real SQLite file.

Records are created through the real :class:`oncely.Inbox` and store API first (the ``db``
fixture); the CLI then reads them, and every claim about the database is checked with sqlite3.
Inspection never writes: not a record, not even the database file.
"""

from __future__ import annotations

import json
import re
import sqlite3
import subprocess
from datetime import UTC, datetime
from pathlib import Path

import oncely
from tests.cli.helpers import LIVE_KEYS, rows, run, url_of

# ---------------------------------------------------------------------------- stats


def test_r5_stats_counts_per_consumer_and_status(db: Path) -> None:
    result = run("inbox", "stats", "--store", url_of(db), "--json", "--exact")
    assert result.exit_code == 0, result.stderr
    stats = json.loads(result.stdout)
    assert stats["exact"] is True
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
    result = run("inbox", "stats", "--store", url_of(db), "--exact")
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
    for field in ("created_at", "updated_at", "expires_at"):
        assert datetime.fromisoformat(record[field]).tzinfo is not None
    assert record["lease"] == "none (not in progress)"
    assert record["lease_until"] is None  # a settled record holds no lease


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
    # An escalated claim looks the same in the store: the operator is told how to settle it.
    assert "oncely inbox resolve" in stale_record["lease"], stale_record["lease"]
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


def test_list_table_cursor_names_a_key_with_control_characters_exactly(tmp_path: Path) -> None:
    """The table escapes control characters, so a cursor printed through it named another
    key ("line\\nbreak" pasted back as a backslash and an n) and the next page skipped the
    records in between. It is printed in bash's $'...' form, which the shell reads back as
    the key itself."""
    path = tmp_path / "keys.db"
    keys = ["a", "line\nbreak", "line\u0085\tnel", "line1", "line\\n", "z'q"]
    store = oncely.SQLiteStore(path)
    try:
        inbox = oncely.Inbox(store, consumer="c")
        for key in keys:
            inbox.handle(key, 1, lambda _p: None)
    finally:
        store.close()
    seen: list[str] = []
    after: list[str] = []
    for _ in range(len(keys) + 1):
        result = run("inbox", "list", "--store", url_of(path), "--limit", "1", *after)
        assert result.exit_code == 0, result.stderr
        page = run("inbox", "list", "--store", url_of(path), "--limit", "1", "--json", *after)
        seen += [r["key"] for r in json.loads(page.stdout)["records"]]
        found = re.search(r"next page: (.*)$", result.stdout, re.MULTILINE)
        if found is None:
            break
        # What the operator pastes, read by the shell as it would read it.
        words = subprocess.run(["bash", "-c", f"printf '%s\\0' {found.group(1)}"],
                               env={"LC_ALL": "C.UTF-8"}, capture_output=True,
                               check=True).stdout  # fmt: skip
        after = [w.decode("utf-8") for w in words.split(b"\0")[:-1]]
    assert seen == sorted(keys)
