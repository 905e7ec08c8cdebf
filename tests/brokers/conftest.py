"""Fixtures the broker end-to-end tests share. Each broker's own state lives on its subclass of
the shared suite (``suite.py``), set up by the suite's autouse fixture."""

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
