"""PostgreSQL store construction: URL options, libpq parameters, passwords never shown,
schema and table names checked and used as given, a caller's own pool.
"""

from __future__ import annotations

import uuid

import psycopg
import pytest
from psycopg_pool import ConnectionPool

import oncely
from oncely import Outcome
from oncely.stores.postgres.async_store import AsyncPostgresStore
from oncely.stores.postgres.sync_store import PostgresStore
from tests.services import POSTGRES_DSN
from tests.stores.postgres.helpers import _sql


def test_url_options_are_read_and_libpq_parameters_passed_on(table: str) -> None:
    url = (
        "postgres://postgres:s3cret@127.0.0.1:5432/test?schema=public&table="
        f"{table}&pool_min=0&pool_max=3&connect_timeout=4&migrate=false"
        "&application_name=oncely_url_test&sslmode=disable"
    )
    store = oncely.open(url)
    assert isinstance(store, PostgresStore)
    assert "s3cret" not in store.url and "***" in store.url and "s3cret" not in repr(store)
    assert store.table == f"public.{table}"
    with pytest.raises(oncely.SchemaMissing, match="oncely migrate"):
        store.get("c", "k")  # migrate=false was read
    assert store.migrate() == 1
    assert store.get("c", "k") is None
    names = _sql("SELECT application_name FROM pg_stat_activity")
    assert ("oncely_url_test",) in names  # a libpq parameter reached the server
    store.close()
    assert isinstance(oncely.open_async(url), AsyncPostgresStore)


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("postgresql://u@h/db?tabel=x", "unknown option 'tabel'"),
        ("postgresql://u@h/db?password=pw&tabel=x", "unknown option 'tabel'"),
        ("postgresql://u:pw@h/db?pool_max=0", "pool_max"),
        ("postgresql://u@h/db?pool_min=5&pool_max=2", "pool_min"),
        ("postgresql://u@h/db?connect_timeout=soon", "connect_timeout"),
        ("postgresql://u@h/db?migrate=perhaps", "migrate"),
        ("postgresql://u@h:99999/db", "not a valid URL"),
    ],
)
def test_bad_urls_are_refused_without_the_password(url: str, problem: str) -> None:
    with pytest.raises(oncely.ConfigurationError, match=problem) as raised:
        oncely.open(url)
    assert "pw" not in str(raised.value)


def test_passwords_never_show(table: str) -> None:
    shown = [
        PostgresStore(dsn, table=table).url
        for dsn in (
            "postgresql://postgres:topsecret@127.0.0.1/test",
            "postgresql://postgres@127.0.0.1/test?password=topsecret",
            "host=127.0.0.1 dbname=test user=postgres password=topsecret",
        )
    ]
    assert all("topsecret" not in url and "***" in url for url in shown), shown


@pytest.mark.parametrize("bad", ["inbox; DROP TABLE x", "a-b", "", "x" * 64, "1abc", '"q"'])
def test_schema_and_table_names_are_checked(bad: str) -> None:
    with pytest.raises(oncely.InvalidIdentifier):
        PostgresStore(POSTGRES_DSN, table=bad)
    with pytest.raises(oncely.InvalidIdentifier):
        PostgresStore(POSTGRES_DSN, schema=bad)


def test_a_schema_of_its_own_and_names_used_as_given() -> None:
    schema = f"oncely_s_{uuid.uuid4().hex[:8]}"
    try:
        store = PostgresStore(POSTGRES_DSN, schema=schema, table="Order")  # a keyword, mixed case
        inbox = oncely.Inbox(store, consumer="c")
        assert inbox.handle("k", 1, lambda p: p).outcome is Outcome.PROCESSED
        assert _sql(f'SELECT count(*) FROM "{schema}"."Order"') == [(1,)]
        meta = _sql(f'SELECT name, value FROM "{schema}"."Order_meta" ORDER BY name')
        assert meta == [("revision", "2"), ("schema_version", "1")]
        store.close()
    finally:
        _sql(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def test_a_caller_pool_is_used_as_it_is_and_left_open(table: str) -> None:
    """A pool of yours: autocommit off and dict rows by default; oncely switches autocommit
    on for its own statements only, reads tuples, and never closes the pool."""
    pool = ConnectionPool(
        POSTGRES_DSN,
        min_size=1,
        max_size=2,
        kwargs={"row_factory": psycopg.rows.dict_row},
        open=True,
    )
    try:
        store = PostgresStore(pool, table=table)
        inbox = oncely.Inbox(store, consumer="c")
        assert inbox.handle("k", 1, lambda p: "r").outcome is Outcome.PROCESSED
        assert inbox.handle("k", 1, lambda p: "r").value == "r"
        store.close()
        with pool.connection() as conn:
            assert conn.autocommit is False
            assert conn.execute(f"SELECT count(*) AS n FROM {table}").fetchone() == {"n": 1}
    finally:
        pool.close()
