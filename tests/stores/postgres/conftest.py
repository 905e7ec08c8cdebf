"""Fixtures of the PostgreSQL store tests: the server is required, and each test gets
an inbox table of its own (``oncely_t_<unique>``), dropped afterwards.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from oncely.stores.postgres.sync_store import PostgresStore
from tests.backends.postgres import drop_tables
from tests.services import POSTGRES_DSN, require


@pytest.fixture(autouse=True)
def _server() -> None:
    require("PostgreSQL", POSTGRES_DSN, 5432)


@pytest.fixture
def table() -> Iterator[str]:
    """A unique inbox table name; the table, its meta twin and its ledger are dropped after."""
    name = f"oncely_t_{uuid.uuid4().hex[:12]}"
    try:
        yield name
    finally:
        drop_tables(name, f"{name}_ledger")


@pytest.fixture
def store(table: str) -> Iterator[PostgresStore]:
    made = PostgresStore(POSTGRES_DSN, table=table, pool_max=4)
    try:
        yield made
    finally:
        made.close()
