"""Fixtures every broker's end-to-end tests share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.brokers.common import Ledger, require_postgres


@pytest.fixture
def ledger() -> Iterator[Ledger]:
    """A fresh PostgreSQL ledger of effects, dropped after the test."""
    require_postgres()
    book = Ledger()
    book.create()
    yield book
    book.drop()
