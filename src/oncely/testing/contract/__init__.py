"""The store contract suite (needs pytest and pytest-asyncio for the async half).

Subclass :class:`StoreContract` (sync stores) or :class:`AsyncStoreContract` (asyncio stores)
and provide the ``make_store`` and ``business`` fixtures; see
:mod:`oncely.testing.contract.async_contract`.
"""

from oncely.testing.contract.async_contract import AsyncBusiness, AsyncStoreContract
from oncely.testing.contract.sync_contract import Business, StoreContract

__all__ = ["AsyncBusiness", "AsyncStoreContract", "Business", "StoreContract"]
