"""MariaDB / MySQL store construction: URL options, the password never shown, the
database named, both URL schemes, table names validated.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest

import oncely
from oncely.errors import (
    ConfigurationError,
    InvalidIdentifier,
)
from oncely.stores import ClaimStatus
from oncely.stores.mysql.async_store import AsyncMySQLStore
from oncely.stores.mysql.errors import parse_url
from oncely.stores.mysql.sync_store import MySQLStore
from tests.backends.mysql import drop_tables, sql, url
from tests.stores.mysql.helpers import _claim


def test_url_options_are_read_and_the_password_is_never_shown() -> None:
    secret = "s3cr%40t"
    text = (
        f"mysql://app:{secret}@db.example:3307/shop?table=inbox_1&pool_size=2"
        "&connect_timeout=3&lock_timeout=7&migrate=false&unix_socket=/run/mysqld.sock"
    )
    options = parse_url(text)
    s = options.settings
    assert (s.host, s.port, s.user, s.password, s.database) == (
        "db.example", 3307, "app", "s3cr@t", "shop",
    )  # fmt: skip
    assert (options.table, options.pool_size, options.migrate) == ("inbox_1", 2, False)
    assert (s.connect_timeout.total_seconds(), s.unix_socket) == (3, "/run/mysqld.sock")
    assert s.lock_timeout is not None and s.lock_timeout.total_seconds() == 7
    assert "innodb_lock_wait_timeout = 7" in s.init_command()
    store = MySQLStore.from_url(text)  # connects lazily: nothing is resolved yet
    for shown in (store.url, repr(store), repr(s)):
        assert "s3cr" not in shown
    assert store.url.startswith("mysql://app:***@db.example:3307/shop?table=inbox_1")
    store.close()


@pytest.mark.parametrize(
    ("query", "named"),
    [
        ("?colour=blue", "'colour'"),
        ("?pool_size=many", "pool_size"),
        ("?pool_size=0", "pool_size"),
        ("?migrate=perhaps", "migrate"),
        ("?connect_timeout=soon", "connect_timeout"),
    ],
)
def test_bad_url_options_are_refused_by_name(query: str, named: str) -> None:
    with pytest.raises(ConfigurationError, match=named) as refused:
        MySQLStore.from_url(f"mysql://app:hunter2@db.example/shop{query}")
    assert "hunter2" not in str(refused.value)


@pytest.mark.parametrize("text", ["mysql://app@db.example", "mysql://app@db.example/", "mysql:///"])
def test_the_url_must_name_a_database(text: str) -> None:
    with pytest.raises(ConfigurationError, match="name the database"):
        MySQLStore.from_url(text)


@pytest.mark.parametrize("store", [MySQLStore, AsyncMySQLStore])
def test_a_url_given_as_the_database_name_is_refused_without_its_password(store: type) -> None:
    # Before, it was taken for the name of a database, and the error that said no such
    # database exists showed the URL, password and all.
    with pytest.raises(ConfigurationError, match=r"oncely\.open") as refused:
        store("mysql://root:hunter2@127.0.0.1:3306/shop")
    assert "hunter2" not in str(refused.value)


def test_mysql_and_mariadb_urls_open_both_twins() -> None:
    sync = oncely.open("mariadb://app@db.example/shop")
    assert isinstance(sync, MySQLStore) and sync.table == "oncely_inbox"
    sync.close()
    made = oncely.open_async("mysql://app@db.example/shop?table=t2")
    assert isinstance(made, AsyncMySQLStore) and made.table == "t2"
    asyncio.run(made.aclose())


@pytest.mark.parametrize("name", ["bad-name", "inbox; DROP TABLE x", "", "9lives", "a" * 63])
def test_table_names_are_validated(name: str) -> None:
    with pytest.raises(InvalidIdentifier):
        MySQLStore("test", table=name)


def test_a_reserved_word_is_a_usable_table_name(server: None) -> None:
    name = f"select_{uuid.uuid4().hex[:8]}"
    store = MySQLStore.from_url(url(name))
    try:
        assert _claim(store, "k", "t1").status is ClaimStatus.NEW
        assert sql(f"SELECT count(*) FROM `{name}`") == [(1,)]
    finally:
        store.close()
        drop_tables(name)
