"""A server of the test's own, SIGKILLed and restarted: the store recovers."""

from __future__ import annotations

import asyncio

import pytest

from oncely.errors import (
    StoreUnavailable,
)
from oncely.stores import ClaimStatus
from oncely.stores.mysql.async_store import AsyncMySQLStore
from oncely.stores.mysql.sync_store import MySQLStore
from tests.stores.mysql.helpers import PrivateServer, _claim, _claim_in


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_store_recovers_after_its_server_crashes_and_restarts(
    private_server: PrivateServer,
) -> None:
    store = MySQLStore.from_url(private_server.url)
    try:
        _claim(store, "committed", "t1")
        pending = store.transaction()
        tx = pending.__enter__()
        _claim_in(store, tx, "in-flight", "t2")
        private_server.kill()
        with pytest.raises(StoreUnavailable):
            pending.__exit__(None, None, None)  # the COMMIT never reached a server
        with pytest.raises(StoreUnavailable):
            store.get("billing", "committed")  # nobody listens: refused at once
        private_server.start()
        record = store.get("billing", "committed")  # dead connections dropped, new ones made
        assert record is not None and record.token == "t1"  # InnoDB recovered the commit
        assert store.get("billing", "in-flight") is None  # and rolled back the open one
        assert _claim(store, "after", "t3").status is ClaimStatus.NEW
    finally:
        store.close()

    async def async_side() -> None:
        made = AsyncMySQLStore.from_url(private_server.url)
        try:
            assert await made.get("billing", "after") is not None
            private_server.kill()
            private_server.start()
            await asyncio.sleep(0.05)  # let the event loop read the end of file
            record = await made.get("billing", "committed")
            assert record is not None and record.token == "t1"
        finally:
            await made.aclose()

    asyncio.run(async_side())
