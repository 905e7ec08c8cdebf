"""A MariaDB that may lose the commits it confirmed when it crashes
(``innodb_flush_log_at_trx_commit`` 0 or 2: the log is written or flushed about once a
second, not at each commit): a completion lost so is its message processed again when
redelivered, and an effect outside the transaction repeated (R8, R10). The store reads the
setting when it is set up and says so at WARNING; a durable server is not mentioned. The
setting is global, so the lax server is one of the test's own."""

from __future__ import annotations

import logging

import pymysql
import pytest

from oncely.stores.mysql.sync_store import MySQLStore
from tests.backends.mysql import url
from tests.stores.durability import claim, said, said_while_set_up
from tests.stores.mysql.helpers import PrivateServer


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_r8_a_server_that_may_lose_confirmed_commits_is_named_at_warning(
    private_server: PrivateServer, caplog: pytest.LogCaptureFixture
) -> None:
    conn = pymysql.connect(host="127.0.0.1", port=private_server.port, user="root")
    with conn.cursor() as cursor:
        cursor.execute("SET GLOBAL innodb_flush_log_at_trx_commit = 2")
    conn.close()
    store = MySQLStore.from_url(private_server.url)
    try:
        with caplog.at_level(logging.WARNING, logger="oncely.store"):
            assert claim(store, "order-1").won
    finally:
        store.close()
    (warning,) = said(caplog)
    assert "innodb_flush_log_at_trx_commit=2" in warning
    assert "innodb_flush_log_at_trx_commit=1" in warning and "repeated" in warning


def test_r8_a_durable_server_is_not_mentioned(table: str, caplog: pytest.LogCaptureFixture) -> None:
    assert said_while_set_up(MySQLStore.from_url(url(table)), caplog) == []
