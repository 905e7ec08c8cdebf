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

The tests live in one module per group, composed here: store claims
(:mod:`~oncely._async.contract_claims`), fenced writes (:mod:`~oncely._async.contract_fencing`),
retention and operations (:mod:`~oncely._async.contract_retention`), the inbox's two-phase mode
(:mod:`~oncely._async.contract_two_phase`), the rest of its surface
(:mod:`~oncely._async.contract_inbox`) and its transactional mode
(:mod:`~oncely._async.contract_transactional`); their fixtures and helpers are in
:mod:`~oncely._async.contract_base`.
"""

from __future__ import annotations

from oncely._async.contract_base import AsyncBusiness
from oncely._async.contract_claims import ClaimContract
from oncely._async.contract_fencing import FencingContract
from oncely._async.contract_inbox import InboxContract
from oncely._async.contract_retention import RetentionContract
from oncely._async.contract_transactional import TransactionalContract
from oncely._async.contract_two_phase import TwoPhaseContract

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
