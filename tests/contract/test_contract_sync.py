"""The whole store contract against every store, through the synchronous API."""

from __future__ import annotations

from pathlib import Path

import pytest

import oncely
from oncely import FakeClock
from oncely.testing.contract import StoreContract

from .stores import LEDGERS, STORES, SyncSQLiteLedger


@pytest.fixture(params=sorted(STORES))
def store_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


class TestStoreContract(StoreContract):
    @pytest.fixture
    def make_store(self, store_kind: str, tmp_path: Path):  # type: ignore[no-untyped-def]
        factory = STORES[store_kind][0]
        return lambda clock: factory(tmp_path, clock)

    @pytest.fixture
    def business(
        self, store_kind: str, tmp_path: Path, store: oncely.Store
    ) -> SyncSQLiteLedger | None:
        ledgers = LEDGERS[store_kind]
        if ledgers is None:
            return None
        store.migrate()
        return ledgers[0](tmp_path / "oncely.db")


def test_contract_covers_every_store() -> None:
    assert set(STORES) >= {"memory", "sqlite"}
    assert FakeClock().now_ms() > 0
