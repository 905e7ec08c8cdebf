"""What the parts of the store contract suite share: the lease and retention every test uses,
the :class:`AsyncBusiness` helper of the transactional tests, a counting handler, and the
``clock`` / ``store`` / ``inbox`` fixtures with the claim helpers (:class:`ContractBase`).

The suite itself is :class:`~oncely.testing.contract.async_contract.AsyncStoreContract`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from datetime import timedelta
from typing import Any, Protocol

import pytest

from oncely._core.clock import FakeClock
from oncely._core.policy import Lease, Retention
from oncely._core.records import Claim
from oncely.inbox.async_inbox import AsyncInbox
from oncely.stores.async_protocols import AsyncStore, AsyncTransactionalStore

__all__ = [
    "KEEP_MS",
    "LEASE",
    "LEASE_MS",
    "RETENTION",
    "AsyncBusiness",
    "Calls",
    "ContractBase",
]

LEASE_MS = 30_000
KEEP_MS = 7 * 86_400_000
LEASE = Lease(duration=timedelta(milliseconds=LEASE_MS), heartbeat=False)
RETENTION = Retention(keep=timedelta(milliseconds=KEEP_MS))


class AsyncBusiness(Protocol):
    """Business writes for the transactional tests: a ledger table without unique keys, so a
    double application shows up as two rows."""

    async def write(self, tx: Any, key: str, amount: int) -> None:
        """Insert one ledger row on ``tx``."""
        ...

    async def count(self, key: str) -> int:
        """Committed ledger rows for ``key``."""
        ...


class Calls:
    """Counts handler runs."""

    def __init__(self, result: object = "done") -> None:
        self.count = 0
        self.result = result

    async def __call__(self, payload: object) -> object:
        self.count += 1
        return self.result


class ContractBase:
    """The fixtures and helpers of the suite. Subclasses provide ``make_store`` and
    ``business`` fixtures."""

    @pytest.fixture
    def clock(self) -> FakeClock:
        return FakeClock()

    @pytest.fixture
    async def store(
        self, make_store: Callable[[FakeClock], AsyncStore], clock: FakeClock
    ) -> AsyncIterator[AsyncStore]:
        made = make_store(clock)
        try:
            yield made
        finally:
            await made.aclose()

    @pytest.fixture
    def inbox(self, store: AsyncStore) -> AsyncInbox:
        return AsyncInbox(store, consumer="billing", lease=LEASE, retention=RETENTION)

    def _transactional(self, store: AsyncStore, business: AsyncBusiness | None) -> AsyncBusiness:
        if not isinstance(store, AsyncTransactionalStore):
            pytest.skip("the store has no transactional mode")
        if business is None:
            pytest.skip(
                "the business fixture gave None: return the table the transactional tests "
                "write in (see AsyncBusiness) to run them on this transactional store"
            )
        return business

    async def _claim(
        self,
        store: AsyncStore,
        key: str = "k",
        *,
        token: str = "t1",
        fp: str | None = "f",
        takeover: bool = True,
        consumer: str = "billing",
        keep_ms: int = KEEP_MS,
    ) -> Claim:
        return await store.claim(
            consumer,
            key,
            fingerprint=fp,
            token=token,
            lease_ms=LEASE_MS,
            keep_ms=keep_ms,
            takeover=takeover,
        )

    async def _takeover(
        self, store: AsyncStore, key: str, *, expected_token: str, token: str
    ) -> Claim:
        """The reconciler's takeover of ``billing``'s ``key`` (fingerprint ``f``)."""
        return await store.takeover(
            "billing",
            key,
            expected_token=expected_token,
            fingerprint="f",
            token=token,
            lease_ms=LEASE_MS,
            keep_ms=KEEP_MS,
        )
