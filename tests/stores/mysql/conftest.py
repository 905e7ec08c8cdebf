"""Fixtures of the MariaDB / MySQL store tests: the server is required, and each test
gets an inbox table of its own in the ``test`` database, dropped afterwards.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from oncely.stores.mysql.sync_store import MySQLStore
from tests.backends.mysql import drop_tables, url
from tests.services import MYSQL_URL, require


@pytest.fixture
def server() -> None:
    require("MariaDB", MYSQL_URL, 3306)


@pytest.fixture
def table(server: None) -> Iterator[str]:
    name = f"oncely_m_{uuid.uuid4().hex[:12]}"
    try:
        yield name
    finally:
        drop_tables(name, f"{name}_ledger", f"{name}_scratch")


@pytest.fixture
def store(table: str) -> Iterator[MySQLStore]:
    made = MySQLStore.from_url(url(table))
    made.migrate()
    try:
        yield made
    finally:
        made.close()
