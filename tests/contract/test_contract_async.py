"""The whole store contract against every backend in tests/backends, through the asyncio API."""

from __future__ import annotations

from collections.abc import Callable

import pytest

import oncely
from oncely import FakeClock
from oncely.testing.contract import AsyncStoreContract
from tests.backends import AsyncLedger, Backend, Scope


class TestAsyncStoreContract(AsyncStoreContract):
    @pytest.fixture
    def make_store(
        self, backend: Backend, scope: Scope
    ) -> Callable[[FakeClock], oncely.AsyncStore]:
        return lambda clock: backend.make_async(scope, clock)

    @pytest.fixture
    async def business(
        self, backend: Backend, scope: Scope, store: oncely.AsyncStore
    ) -> AsyncLedger | None:
        if backend.async_ledger is None:
            return None
        await store.migrate()
        return backend.async_ledger(scope, store)
