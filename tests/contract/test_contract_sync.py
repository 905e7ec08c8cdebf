"""The whole store contract against every backend in tests/backends, through the sync API."""

from __future__ import annotations

from collections.abc import Callable

import pytest

import oncely
from oncely import FakeClock
from oncely.testing.contract import StoreContract
from tests.backends import Backend, Scope, SyncLedger


class TestStoreContract(StoreContract):
    @pytest.fixture
    def make_store(self, backend: Backend, scope: Scope) -> Callable[[FakeClock], oncely.Store]:
        return lambda clock: backend.make_sync(scope, clock)

    @pytest.fixture
    def business(self, backend: Backend, scope: Scope, store: oncely.Store) -> SyncLedger | None:
        if backend.sync_ledger is None:
            return None
        store.migrate()
        return backend.sync_ledger(scope, store)
