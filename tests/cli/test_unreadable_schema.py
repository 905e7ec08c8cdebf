"""A schema marker that holds no version (edited by hand, or written by something other than
oncely) is a schema problem on every store: ``SchemaError`` in code, exit 4 with one line on
the command line, never a ``ValueError`` or the "unexpected error" of a bug."""

from __future__ import annotations

import sqlite3
from urllib.parse import parse_qs, urlsplit

import psycopg
import pytest
import redis

import oncely
from tests.backends.mysql import sql
from tests.cli.conftest import StoreUrl
from tests.cli.helpers import run
from tests.services import POSTGRES_DSN, REDIS_URL


def _mark(store: oncely.Store, url: str, kind: str, name: str, value: str) -> None:
    """Write ``value`` as the store's ``name`` marker (schema_version, revision) by hand."""
    table = parse_qs(urlsplit(url).query).get("table", ["oncely_inbox"])[0]
    update = f"UPDATE {table}_meta SET value = %s WHERE name = %s"
    if kind == "sqlite":
        with sqlite3.connect(urlsplit(url).path) as conn:
            conn.execute(update.replace("%s", "?"), (value, name))
    elif kind == "postgres":
        with psycopg.connect(POSTGRES_DSN, autocommit=True) as conn:
            conn.execute(update, (value, name))  # type: ignore[call-overload]
    elif kind == "mysql":
        sql(update, (value, name))
    else:
        client = redis.Redis.from_url(REDIS_URL)
        try:
            client.hset(store._keys.meta, name, value)  # type: ignore[attr-defined]
        finally:
            client.close()


@pytest.mark.parametrize("value", ["abc", "", "2x"])
def test_an_unreadable_schema_version_is_a_schema_error(each_store: StoreUrl, value: str) -> None:
    made, url, kind = each_store
    _mark(made, url, kind, "schema_version", value)
    opened = oncely.open(url)
    try:
        with pytest.raises(oncely.SchemaError, match="no oncely version"):
            opened.stats()
    finally:
        opened.close()
    for command in (["inbox", "stats"], ["migrate"]):
        result = run(*command, "--store", url)
        assert result.exit_code == 4, (command, result.stderr)
        assert f"reads {value!r}, which is no oncely version" in result.stderr
        assert "unexpected error" not in result.stderr


def test_an_unreadable_revision_is_a_schema_error(each_store: StoreUrl) -> None:
    made, url, kind = each_store
    if kind == "redis":
        pytest.skip("a Redis store has no revision")
    _mark(made, url, kind, "revision", "three")
    result = run("inbox", "stats", "--store", url)
    assert result.exit_code == 4, result.stderr
    assert "schema revision" in result.stderr and "'three'" in result.stderr


def _unmark(url: str, kind: str, drop: bool) -> None:
    """Delete the store's schema_version row by hand (or, ``drop``, its whole meta table)."""
    table = parse_qs(urlsplit(url).query).get("table", ["oncely_inbox"])[0]
    statement = (
        f"DROP TABLE {table}_meta" if drop
        else f"DELETE FROM {table}_meta WHERE name = 'schema_version'"
    )  # fmt: skip
    if kind == "sqlite":
        with sqlite3.connect(urlsplit(url).path) as conn:
            conn.execute(statement)
    elif kind == "postgres":
        with psycopg.connect(POSTGRES_DSN, autocommit=True) as conn:
            conn.execute(statement)  # type: ignore[call-overload]
    else:
        sql(statement)


@pytest.mark.parametrize("drop", [False, True], ids=["row-deleted", "meta-table-dropped"])
def test_a_table_whose_schema_marker_is_missing_is_a_schema_error_not_a_missing_table(
    each_store: StoreUrl, drop: bool
) -> None:
    """Before, the CLI said there was no oncely table (and `oncely migrate` answered "schema
    version N ready", writing this oncely's version over a table whose own nobody knew)."""
    made, url, kind = each_store
    if kind == "redis":
        pytest.skip("a SQL store's marker")
    assert oncely.Inbox(made, consumer="c").handle("k", 1, lambda p: p).outcome is (
        oncely.Outcome.PROCESSED
    )
    _unmark(url, kind, drop)
    opened = oncely.open(url)
    try:
        with pytest.raises(oncely.SchemaError, match="schema marker is missing"):
            opened.get("c", "k")
    finally:
        opened.close()
    for command in (["inbox", "stats"], ["inbox", "show", "--consumer", "c", "k"], ["migrate"]):
        result = run(*command, "--store", url)
        assert result.exit_code == 4, (command, result.stdout, result.stderr)
        assert "exists, but its schema marker is missing" in result.stderr
        assert "no oncely table" not in result.stderr
        assert "'schema_version'" in result.stderr and "oncely migrate" in result.stderr
    again = run("migrate", "--store", url)  # nothing was written: still refused
    assert again.exit_code == 4 and "ready" not in again.stdout
