"""The whole store contract against every store, through the asyncio API."""

from __future__ import annotations

from pathlib import Path

import pytest

import oncely
from oncely.testing.contract import AsyncStoreContract

from .stores import LEDGERS, STORES, AsyncSQLiteLedger


@pytest.fixture(params=sorted(STORES))
def store_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


class TestAsyncStoreContract(AsyncStoreContract):
    @pytest.fixture
    def make_store(self, store_kind: str, tmp_path: Path):  # type: ignore[no-untyped-def]
        factory = STORES[store_kind][1]
        return lambda clock: factory(tmp_path, clock)

    @pytest.fixture
    async def business(
        self, store_kind: str, tmp_path: Path, store: oncely.AsyncStore
    ) -> AsyncSQLiteLedger | None:
        ledgers = LEDGERS[store_kind]
        if ledgers is None:
            return None
        await store.migrate()
        return ledgers[1](tmp_path / "oncely.db")
