"""The store contract suite: every promise of a store and an inbox, as pytest tests.

oncely runs it against each of its stores, sync and async; a user certifies a store of their
own the same way. Subclass it and give two fixtures::

    from oncely.testing.contract import AsyncStoreContract

    class TestMyStore(AsyncStoreContract):
        @pytest.fixture
        def make_store(self):
            return lambda clock: MyStore(clock=clock)   # a fresh, empty store on that clock

        @pytest.fixture
        def business(self):
            return None   # or a Business helper when the store is transactional

Time comes from a :class:`~oncely.FakeClock` the store must read instead of its own clock, so
leases and retention move by hand and nothing sleeps. Test names cite the requirement each one
proves (R-numbers of the pattern).

The tests live in one module per group of :mod:`oncely.testing.contract`, composed here:
store claims (``async_claims``), fenced writes (``async_fencing``), retention and operations
(``async_retention``), the inbox's two-phase mode (``async_two_phase``), the rest of its surface
(``async_inbox``) and its transactional mode (``async_transactional``); their fixtures and
helpers are in ``async_base``.
"""

from __future__ import annotations

from oncely.testing.contract.async_base import AsyncBusiness
from oncely.testing.contract.async_claims import ClaimContract
from oncely.testing.contract.async_fencing import FencingContract
from oncely.testing.contract.async_inbox import InboxContract
from oncely.testing.contract.async_retention import RetentionContract
from oncely.testing.contract.async_transactional import TransactionalContract
from oncely.testing.contract.async_two_phase import TwoPhaseContract

__all__ = ["AsyncBusiness", "AsyncStoreContract"]


class AsyncStoreContract(
    ClaimContract,
    FencingContract,
    RetentionContract,
    TwoPhaseContract,
    InboxContract,
    TransactionalContract,
):
    """The suite. Subclasses provide ``make_store`` and ``business`` fixtures."""
