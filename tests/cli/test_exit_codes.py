"""The exit codes of the ``oncely`` command line (schema problem, store unavailable, corrupt
file, usage errors), that a message names the store URL as the user typed it (a Redis that is
down, MariaDB's errors as sentences, on the real servers), and that a password in a store URL
is never printed.
"""

from __future__ import annotations

import logging
import socket
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlsplit

import pytest

import oncely
from oncely.cli._stores import opened
from tests.backends.postgres import drop_tables as drop_postgres_tables
from tests.cli.helpers import SECRET, count, rows, run, url_of
from tests.services import MYSQL_URL, POSTGRES_DSN, REDIS_URL, require

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
    # Not SQLite's "unable to open database file", nor a hint to run migrate (which fails too).
    for command in (["migrate"], ["inbox", "stats"]):
        result = run(*command, "--store", url_of(tmp_path / "missing" / "x.db"))
        assert result.exit_code == 3, result.stderr
        assert f"there is no directory {tmp_path / 'missing'}" in result.stderr, result.stderr
        assert "oncely migrate" not in result.stderr


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
    ["foo://bar", f"foo://admin:{SECRET}@bar/x?y=1", "sqlite:///x.db?bogus=1", "memory://?x=1"],
)
def test_a_refused_url_is_named_as_typed(url: str) -> None:
    # Inspection commands open the store with migrate=false added to its URL: the message
    # names the URL the user typed (redacted), never that query.
    result = run("inbox", "stats", "--store", url)
    assert result.exit_code == 2, result.stderr
    assert f"Invalid value for '--store': {oncely.redact(url)}: " in result.stderr
    assert "migrate" not in result.stderr.split("(known:")[0]


# -------------------------------------------------- store errors name the URL typed


def test_a_redis_that_is_down_is_named(unused_port: int) -> None:
    url = f"redis://127.0.0.1:{unused_port}/0?connect_timeout=2"
    result = run("inbox", "stats", "--store", url)
    assert result.exit_code == 3, result.stderr
    # As PostgreSQL's store names its server: the URL, without oncely's options.
    assert f"on redis://127.0.0.1:{unused_port}/0: " in result.stderr
    assert "Connection refused" in result.stderr and "migrate" not in result.stderr


def test_a_redis_that_is_down_is_not_blamed_on_its_eviction_policy(
    unused_port: int, caplog: pytest.LogCaptureFixture
) -> None:
    """A server that cannot be reached is store unavailable, said once: not first a warning
    that its maxmemory-policy could not be read (as for a server that refused INFO), which
    sends the operator to check a setting of a server that is not even up."""
    url = f"redis://127.0.0.1:{unused_port}/0?connect_timeout=2"
    result = run("inbox", "stats", "--store", url)
    assert result.exit_code == 3, result.stderr
    assert "Connection refused" in result.stderr
    assert not [r for r in caplog.records if "maxmemory-policy" in r.getMessage()]


def test_a_redis_without_the_marker_is_named_as_typed() -> None:
    require("Redis", REDIS_URL, 6379)
    url = f"{REDIS_URL}?prefix=oncely_cli_{uuid.uuid4().hex[:10]}"
    result = run("inbox", "stats", "--store", url)
    assert result.exit_code == 4, result.stderr
    assert f"at {url}; run `oncely migrate" in result.stderr
    assert "migrate=false" not in result.stderr


def test_an_unknown_mysql_database_reads_as_a_sentence() -> None:
    require("MariaDB", MYSQL_URL, 3306)
    parts = urlsplit(MYSQL_URL)
    url = parts._replace(path="/nosuchdb").geturl()
    result = run("inbox", "stats", "--store", url)
    assert result.exit_code == 5, result.stderr
    assert "MariaDB/MySQL error 1049: Unknown database 'nosuchdb'" in result.stderr
    assert "/nosuchdb: " in result.stderr  # the store's URL
    assert "(1049," not in result.stderr


@pytest.fixture
def unused_port() -> Iterator[int]:
    """A loopback port that is bound but never listened on: connections are refused."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        yield int(sock.getsockname()[1])


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


@pytest.mark.parametrize(
    "args",
    [
        ("inbox", "show", "--consumer", "billing", ""),
        ("inbox", "forget", "--consumer", "billing", "", "--yes"),
        ("inbox", "resolve", "--consumer", "billing", "", "--completed", "1", "--create"),
        ("inbox", "resolve", "--consumer", "billing", "", "--retry"),
    ],
)
def test_an_empty_key_is_a_usage_error(db: Path, args: tuple[str, ...]) -> None:
    """An empty KEY (a shell variable that was not set) is the operator's slip: exit 2,
    naming the argument. Before, show and forget said the key had no record (exit 1) and
    resolve --create stopped with "the dedup key is empty" as a store error (exit 5)."""
    before = rows(db, "SELECT consumer, key, status FROM oncely_inbox ORDER BY 1, 2")
    result = run(*args, "--store", url_of(db))
    assert result.exit_code == 2, result.stderr
    assert "KEY" in result.stderr and "empty" in result.stderr, result.stderr
    assert rows(db, "SELECT consumer, key, status FROM oncely_inbox ORDER BY 1, 2") == before


def test_a_redis_database_out_of_range_is_a_store_error_not_an_eviction_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``/99`` on a server with 16 databases: the server refuses the database, which is the
    error to show (exit 5), not a warning to check its eviction policy first."""
    require("Redis", REDIS_URL, 6379)
    server = REDIS_URL.rsplit("/", 1)[0]
    with caplog.at_level(logging.WARNING, logger="oncely.store"):
        result = run("inbox", "stats", "--store", f"{server}/99")
    assert result.exit_code == 5, result.stderr
    assert "DB index is out of range" in result.stderr
    assert not [r for r in caplog.records if "maxmemory-policy" in r.getMessage()]


def _postgres_with_a_password(table: str) -> str:
    """A PostgreSQL URL with a password in it (the test server trusts loopback, so any
    password connects) and an inbox ``table`` of the test's own."""
    require("PostgreSQL", POSTGRES_DSN, 5432)
    parts = urlsplit(POSTGRES_DSN)
    user = parts.username or "postgres"
    host = parts.netloc.rsplit("@", 1)[-1]
    return parts._replace(netloc=f"{user}:{SECRET}@{host}", query=f"table={table}").geturl()


def test_a_purge_s_line_names_the_store_as_typed(caplog: pytest.LogCaptureFixture) -> None:
    """``oncely inbox purge`` opens the store with ``migrate=false`` added: its run's line on
    the ``oncely.purge`` logger names the URL the user typed (password hidden), not that."""
    table = f"oncely_cli_{uuid.uuid4().hex[:10]}"
    url = _postgres_with_a_password(table)
    try:
        assert run("migrate", "--store", url).exit_code == 0
        with caplog.at_level(logging.INFO, logger="oncely.purge"):
            result = run("inbox", "purge", "--store", url)
        assert result.exit_code == 0, result.stderr
        [line] = [r.getMessage() for r in caplog.records if r.name == "oncely.purge"]
        assert f"store={oncely.redact(url)} deleted=0" in line, line
        assert "migrate=false" not in line and SECRET not in line
    finally:
        drop_postgres_tables(table)


def test_a_purge_service_s_warning_names_the_store_as_typed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A purge service whose run fails (its table is missing) warns and tries again: the
    warning names the store as typed (password hidden), never with ``migrate=false``."""
    table = f"oncely_cli_{uuid.uuid4().hex[:10]}"
    url = _postgres_with_a_password(table)
    with caplog.at_level(logging.WARNING, logger="oncely.purge"), opened(url) as store:
        service = oncely.PurgeService(store, every=timedelta(seconds=30))
        thread = threading.Thread(target=service.run, daemon=True)
        thread.start()
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not caplog.records:
                time.sleep(0.05)
        finally:
            service.stop()
            thread.join(30)
    [line] = [r.getMessage() for r in caplog.records if r.name == "oncely.purge"]
    assert f"store={oncely.redact(url)} failed, trying again" in line, line
    assert "migrate=false" not in line and SECRET not in line
