"""Contract, retention and operations (R12, R13): expired records count as absent and are purged
in batches; stats, scan and forget show and remove records; keys and results keep every byte;
migrate is repeatable."""

from __future__ import annotations

from datetime import timedelta

import pytest

from oncely._core.clock import FakeClock
from oncely._core.records import ClaimStatus, Status
from oncely.errors import LeaseLost
from oncely.stores.async_protocols import AsyncStore
from oncely.testing.contract.async_base import KEEP_MS, LEASE_MS, ContractBase

__all__ = ["RetentionContract"]


class RetentionContract(ContractBase):
    """How a store keeps, purges and shows its records."""

    async def test_r13_expired_records_count_as_absent(
        self, store: AsyncStore, clock: FakeClock
    ) -> None:
        await self._claim(store, token="t1")
        await store.complete("billing", "k", token="t1", result=b"r", keep_ms=60_000)
        clock.advance(timedelta(seconds=59))
        assert await store.get("billing", "k") is not None
        clock.advance(timedelta(seconds=1))
        assert await store.get("billing", "k") is None
        with pytest.raises(LeaseLost):
            await store.renew("billing", "k", token="t1", lease_ms=LEASE_MS, keep_ms=KEEP_MS)
        fresh = await self._claim(store, token="t2")
        assert fresh.status is ClaimStatus.NEW and fresh.record.attempt == 1
        assert fresh.record.created_ms == clock.now_ms() and fresh.record.result is None

    async def test_r10_r13_the_edges_of_the_contract(
        self, store: AsyncStore, clock: FakeClock
    ) -> None:
        """Where a store could differ from another and still look right, oncely's answer:
        times are whole milliseconds; a lease ends when ``deadline <= now`` (at its deadline
        the claim is stale); a repeated ``complete`` by the owner keeps the first result and
        retention; every record expires, one left in progress included (R10, R13)."""
        first = await self._claim(store, "edge", token="t1")
        record = first.record
        for ms in (record.created_ms, record.lease_until_ms, record.expires_ms):
            assert type(ms) is int
        assert record.lease_until_ms == clock.now_ms() + LEASE_MS
        clock.advance(timedelta(milliseconds=LEASE_MS - 1))
        assert (await self._claim(store, "edge", token="t2")).status is ClaimStatus.EXISTING
        clock.advance(timedelta(milliseconds=1))  # now == the lease's deadline
        taken = await self._claim(store, "edge", token="t3")
        assert taken.status is ClaimStatus.TAKEN_OVER
        done = await store.complete("billing", "edge", token="t3", result=b"first", keep_ms=60_000)
        again = await store.complete(
            "billing", "edge", token="t3", result=b"second", keep_ms=KEEP_MS
        )
        assert again.result == b"first" and again.expires_ms == done.expires_ms
        assert (await store.get("billing", "edge")) == again

        stuck = (await self._claim(store, "stuck", token="s1", keep_ms=120_000)).record
        assert stuck.status is Status.IN_PROGRESS
        clock.advance(timedelta(milliseconds=stuck.expires_ms - clock.now_ms() - 1))
        assert await store.get("billing", "stuck") is not None
        clock.advance(timedelta(milliseconds=1))  # now == its retention's deadline
        assert await store.get("billing", "stuck") is None
        assert (await self._claim(store, "stuck", token="s2")).status is ClaimStatus.NEW

    async def test_r13_a_record_always_outlives_its_lease(self, store: AsyncStore) -> None:
        claim = await self._claim(store, token="t", fp=None, keep_ms=10)
        assert claim.record.expires_ms >= claim.record.lease_until_ms

    async def test_r12_r13_purge_deletes_expired_records_in_batches(
        self, store: AsyncStore, clock: FakeClock
    ) -> None:
        for i in range(25):
            await self._claim(store, f"old-{i}", token=f"t{i}")
            await store.complete("billing", f"old-{i}", token=f"t{i}", result=None, keep_ms=1000)
        await self._claim(store, "young", token="y")
        clock.advance(timedelta(seconds=2))
        assert (await store.stats()).expired == 25
        assert await store.purge_expired(batch_size=10, max_batches=1) == 10
        assert await store.purge_expired(batch_size=10) == 15
        assert await store.purge_expired(batch_size=10) == 0
        stats = await store.stats()
        assert stats.expired == 0 and stats.total == 1
        assert await store.get("billing", "young") is not None

    async def test_stats_scan_and_forget(self, store: AsyncStore) -> None:
        for consumer in ("a", "b"):
            for i in range(3):
                await self._claim(store, f"k{i}", consumer=consumer, token=f"{consumer}{i}")
        await store.complete("a", "k0", token="a0", result=None, keep_ms=KEEP_MS)
        stats = await store.stats()
        assert stats.counts == {
            "a": {Status.COMPLETED: 1, Status.IN_PROGRESS: 2},
            "b": {Status.IN_PROGRESS: 3},
        }
        page = await store.scan(limit=4)
        assert [(r.consumer, r.key) for r in page] == [
            ("a", "k0"),
            ("a", "k1"),
            ("a", "k2"),
            ("b", "k0"),
        ]
        rest = await store.scan(after=("b", "k0"), limit=10)
        assert [(r.consumer, r.key) for r in rest] == [("b", "k1"), ("b", "k2")]
        done = await store.scan(status=Status.COMPLETED)
        assert [(r.consumer, r.key) for r in done] == [("a", "k0")]
        assert [r.key for r in await store.scan(consumer="b", limit=1)] == ["k0"]
        assert await store.forget("a", "k0") is True
        assert await store.forget("a", "k0") is False
        assert await store.get("a", "k0") is None

    async def test_keys_and_results_keep_every_byte(self, store: AsyncStore) -> None:
        key = "ordre-42 \u00e9\u4e2d\U0001f600 'quoted' \"double\" ; DROP TABLE x; --"
        blob = bytes(range(256)) * 300
        await self._claim(store, key, token="t1")
        done = await store.complete("billing", key, token="t1", result=blob, keep_ms=KEEP_MS)
        assert done.key == key and done.result == blob
        assert (await store.get("billing", key)).result == blob  # type: ignore[union-attr]

    async def test_migrate_is_repeatable(self, store: AsyncStore) -> None:
        first = await store.migrate()
        assert await store.migrate() == first >= 1
        await self._claim(store, token="t1")
        assert await store.migrate() == first
        assert await store.get("billing", "k") is not None
