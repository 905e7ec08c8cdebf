"""Fixtures of the MariaDB / MySQL store tests: the server is required, and each test
gets an inbox table of its own in the ``test`` database, dropped afterwards.
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from oncely.stores.mysql.sync_store import MySQLStore
from tests.backends.mysql import drop_tables, url
from tests.services import MYSQL_URL, require
from tests.stores.mysql.helpers import PrivateServer


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


@pytest.fixture
def private_server(tmp_path: Path, server: None) -> Iterator[PrivateServer]:
    if not (shutil.which("mariadbd") and shutil.which("mariadb-install-db")):
        pytest.skip("mariadbd is not installed here")
    made = PrivateServer(tmp_path)
    made.start()
    try:
        yield made
    finally:
        made.kill()
