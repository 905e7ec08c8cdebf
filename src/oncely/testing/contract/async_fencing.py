"""Contract, fenced writes (R10, R20): complete, fail, renew and release carry the claim's token
and raise :class:`~oncely.LeaseLost` once another worker has taken the record over; an
operator's ``forget_by_token`` deletes only the record it read, never a live claim."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest

from oncely._core.clock import FakeClock
from oncely._core.records import ClaimStatus, Completion, Record, Status
from oncely.errors import LeaseLost
from oncely.stores.async_protocols import (
    AsyncCompletesMany,
    AsyncForgetsByToken,
    AsyncStore,
    complete_each,
)
from oncely.testing.contract.async_base import KEEP_MS, LEASE_MS, ContractBase

__all__ = ["FencingContract"]


class FencingContract(ContractBase):
    """How a store fences writes by the claim's token."""

    async def test_r10_complete_stores_the_result_and_is_fenced_by_token(
        self, store: AsyncStore, clock: FakeClock
    ) -> None:
        await self._claim(store, token="t1")
        with pytest.raises(LeaseLost) as lost:
            await store.complete("billing", "k", token="t9", result=b"x", keep_ms=KEEP_MS)
        assert lost.value.current is not None and lost.value.current.token == "t1"
        assert (await store.get("billing", "k")).status is Status.IN_PROGRESS  # type: ignore[union-attr]
        clock.advance(timedelta(seconds=1))
        done = await store.complete("billing", "k", token="t1", result=b"\x00r\xff", keep_ms=1000)
        assert done.status is Status.COMPLETED and done.result == b"\x00r\xff"
        assert done.expires_ms == clock.now_ms() + 1000
        assert await store.get("billing", "k") == done
        again = await store.complete("billing", "k", token="t1", result=b"\x00r\xff", keep_ms=1000)
        assert again == done  # the same completion twice (a retry) changes nothing

    async def test_r10_a_batch_completes_each_claim_it_owns_and_reports_each_lost_one(
        self, store: AsyncStore, clock: FakeClock
    ) -> None:
        for key, token in (("a", "ta"), ("b", "tb"), ("c", "tc"), ("d", "td")):
            await self._claim(store, key, token=token)
        await store.complete("billing", "d", token="td", result=b"first", keep_ms=KEEP_MS)
        clock.advance(timedelta(seconds=1))
        batch = [
            Completion("a", "ta", b"\x00ra\xff", None),
            Completion("b", "t-other", b"rb", None),  # not this claim's token: lost
            Completion("c", "tc", None, "result too large"),
            Completion("d", "td", b"first", None),  # landed before: the same record
            Completion("never-claimed", "tx", b"r", None),
        ]
        if isinstance(store, AsyncCompletesMany):
            done = await store.complete_many("billing", batch, keep_ms=1000)
        else:  # a store of its own without batches: the inbox completes key by key
            done = await complete_each(store, "billing", batch, keep_ms=1000)
        assert len(done) == 5
        a, b, c, d, never = done
        assert isinstance(a, Record) and a.status is Status.COMPLETED and a.result == b"\x00ra\xff"
        assert a.expires_ms == clock.now_ms() + 1000 and await store.get("billing", "a") == a
        assert isinstance(b, LeaseLost) and b.current is not None and b.current.token == "tb"
        assert (await store.get("billing", "b")).status is Status.IN_PROGRESS  # type: ignore[union-attr]
        assert isinstance(c, Record) and c.result is None and c.error == "result too large"
        assert isinstance(d, Record) and d.result == b"first"
        assert isinstance(never, LeaseLost) and never.current is None
        if isinstance(store, AsyncCompletesMany):
            assert await store.complete_many("billing", [], keep_ms=1000) == []
            again = await store.complete_many("billing", batch[:1], keep_ms=1000)
            assert again == [a]  # the same completion twice (a retry) changes nothing

    async def test_r10_owner_of_a_lapsed_lease_can_complete_until_taken_over(
        self, store: AsyncStore, clock: FakeClock
    ) -> None:
        await self._claim(store, token="t1")
        clock.advance(timedelta(milliseconds=LEASE_MS * 3))
        done = await store.complete("billing", "k", token="t1", result=None, keep_ms=KEEP_MS)
        assert done.status is Status.COMPLETED and done.result is None

    async def test_r10_zombie_cannot_touch_the_new_owners_record(
        self, store: AsyncStore, clock: FakeClock
    ) -> None:
        await self._claim(store, token="zombie")
        clock.advance(timedelta(milliseconds=LEASE_MS + 1))
        await self._claim(store, token="owner")
        zombie_writes: list[Callable[[], Any]] = [
            lambda: store.complete("billing", "k", token="zombie", result=b"z", keep_ms=KEEP_MS),
            lambda: store.fail("billing", "k", token="zombie", error="z", keep_ms=KEEP_MS),
            lambda: store.renew("billing", "k", token="zombie", lease_ms=LEASE_MS, keep_ms=KEEP_MS),
            lambda: store.release("billing", "k", token="zombie"),
        ]
        for write in zombie_writes:
            with pytest.raises(LeaseLost):
                await write()
        owner = await store.complete("billing", "k", token="owner", result=b"o", keep_ms=KEEP_MS)
        assert owner.result == b"o" and owner.attempt == 2
        with pytest.raises(LeaseLost):
            await store.complete("billing", "k", token="zombie", result=b"z", keep_ms=KEEP_MS)
        assert (await store.get("billing", "k")).result == b"o"  # type: ignore[union-attr]

    async def test_r10_renew_extends_the_lease(self, store: AsyncStore, clock: FakeClock) -> None:
        await self._claim(store, token="t1")
        clock.advance(timedelta(milliseconds=LEASE_MS - 10))
        renewed = await store.renew("billing", "k", token="t1", lease_ms=LEASE_MS, keep_ms=KEEP_MS)
        assert renewed.lease_until_ms == clock.now_ms() + LEASE_MS
        clock.advance(timedelta(milliseconds=LEASE_MS - 10))
        still = await self._claim(store, token="t2", takeover=True)
        assert still.status is ClaimStatus.EXISTING and still.record.token == "t1"

    async def test_renew_of_a_completed_record_is_lost(self, store: AsyncStore) -> None:
        await self._claim(store, token="t1")
        await store.complete("billing", "k", token="t1", result=None, keep_ms=KEEP_MS)
        with pytest.raises(LeaseLost):
            await store.renew("billing", "k", token="t1", lease_ms=LEASE_MS, keep_ms=KEEP_MS)

    async def test_r10_release_deletes_the_claim_so_a_redelivery_starts_afresh(
        self, store: AsyncStore
    ) -> None:
        await self._claim(store, token="t1")
        assert await store.release("billing", "k", token="t1") is True
        assert await store.get("billing", "k") is None
        assert await store.release("billing", "k", token="t1") is False
        again = await self._claim(store, token="t2")
        assert again.status is ClaimStatus.NEW and again.record.attempt == 1

    async def test_release_never_deletes_a_completed_record(self, store: AsyncStore) -> None:
        await self._claim(store, token="t1")
        await store.complete("billing", "k", token="t1", result=b"r", keep_ms=KEEP_MS)
        with pytest.raises(LeaseLost):
            await store.release("billing", "k", token="t1")
        assert (await store.get("billing", "k")).status is Status.COMPLETED  # type: ignore[union-attr]

    async def test_r20_fail_records_a_poison_message_for_good(self, store: AsyncStore) -> None:
        await self._claim(store, token="t1")
        failed = await store.fail("billing", "k", token="t1", error="bad amount", keep_ms=KEEP_MS)
        assert failed.status is Status.FAILED and failed.error == "bad amount"
        assert await store.fail("billing", "k", token="t1", error="bad", keep_ms=KEEP_MS) == failed
        with pytest.raises(LeaseLost):
            await store.complete("billing", "k", token="t1", result=None, keep_ms=KEEP_MS)
        seen = await self._claim(store, token="t2")
        assert seen.status is ClaimStatus.EXISTING and seen.record.status is Status.FAILED

    async def test_r10_forget_by_token_deletes_only_the_record_read_and_no_live_claim(
        self, store: AsyncStore, clock: FakeClock
    ) -> None:
        if not isinstance(store, AsyncForgetsByToken):
            pytest.skip("this store forgets unfenced only")
        await self._claim(store, token="t1")
        await store.fail("billing", "k", token="t1", error="poison", keep_ms=KEEP_MS)
        with pytest.raises(LeaseLost):  # not the record read
            await store.forget_by_token("billing", "k", token="t9")
        assert (await store.get("billing", "k")).status is Status.FAILED  # type: ignore[union-attr]
        # Forgotten by another meanwhile, and claimed afresh by a delivery: that claim stays.
        await store.forget("billing", "k")
        await self._claim(store, token="t2")
        with pytest.raises(LeaseLost) as lost:
            await store.forget_by_token("billing", "k", token="t1")
        assert lost.value.current is not None and lost.value.current.token == "t2"
        with pytest.raises(LeaseLost):  # a live claim, even by its own token
            await store.forget_by_token("billing", "k", token="t2")
        assert (await store.get("billing", "k")).token == "t2"  # type: ignore[union-attr]
        clock.advance(timedelta(milliseconds=LEASE_MS + 1))  # its lease lapsed: stale
        assert await store.forget_by_token("billing", "k", token="t2") is True
        assert await store.get("billing", "k") is None
        assert await store.forget_by_token("billing", "k", token="t2") is False
        await self._claim(store, "done", token="t3")
        await store.complete("billing", "done", token="t3", result=b"r", keep_ms=KEEP_MS)
        assert await store.forget_by_token("billing", "done", token="t3") is True
        assert await store.get("billing", "done") is None
