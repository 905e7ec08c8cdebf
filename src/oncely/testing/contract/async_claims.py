"""Contract, store claims (R5, R8-R10, R20): the first claim wins and later ones see the
winner; a lapsed lease is taken over with a new token and attempt, a live one never; a batch of
claims answers as the same claims made one by one."""

from __future__ import annotations

from datetime import timedelta

from oncely._core.clock import FakeClock
from oncely._core.records import ClaimRequest, ClaimStatus, Status
from oncely.stores.async_protocols import AsyncStore
from oncely.testing.contract.async_base import KEEP_MS, LEASE_MS, ContractBase

__all__ = ["ClaimContract"]


class ClaimContract(ContractBase):
    """How a store arbitrates claims."""

    async def test_r8_r9_first_claim_wins_and_later_claims_see_the_winner(
        self, store: AsyncStore, clock: FakeClock
    ) -> None:
        now = clock.now_ms()
        first = await self._claim(store, token="t1")
        assert first.status is ClaimStatus.NEW and first.won
        record = first.record
        assert (record.consumer, record.key, record.token) == ("billing", "k", "t1")
        assert record.status is Status.IN_PROGRESS and record.attempt == 1
        assert record.fingerprint == "f"
        assert record.lease_until_ms == now + LEASE_MS
        assert record.expires_ms == now + KEEP_MS
        assert record.created_ms == record.updated_ms == now
        second = await self._claim(store, token="t2")
        assert second.status is ClaimStatus.EXISTING and not second.won
        assert second.record == record
        assert await store.get("billing", "k") == record

    async def test_r5_records_are_scoped_by_consumer(self, store: AsyncStore) -> None:
        a = await self._claim(store, consumer="billing", token="a")
        b = await self._claim(store, consumer="shipping", token="b")
        assert a.status is ClaimStatus.NEW and b.status is ClaimStatus.NEW
        assert (await store.get("shipping", "k")) == b.record

    async def test_r10_live_claim_is_never_taken_over(
        self, store: AsyncStore, clock: FakeClock
    ) -> None:
        await self._claim(store, token="t1")
        clock.advance(timedelta(milliseconds=LEASE_MS - 1))
        again = await self._claim(store, token="t2", takeover=True)
        assert again.status is ClaimStatus.EXISTING and again.record.token == "t1"

    async def test_r10_stale_claim_is_taken_over_with_a_new_token(
        self, store: AsyncStore, clock: FakeClock
    ) -> None:
        await self._claim(store, token="t1")
        clock.advance(timedelta(milliseconds=LEASE_MS))
        taken = await self._claim(store, token="t2", takeover=True)
        assert taken.status is ClaimStatus.TAKEN_OVER
        assert taken.record.token == "t2" and taken.record.attempt == 2
        assert taken.record.lease_until_ms == clock.now_ms() + LEASE_MS

    async def test_r10_stale_claim_stays_when_takeover_is_not_allowed(
        self, store: AsyncStore, clock: FakeClock
    ) -> None:
        await self._claim(store, token="t1")
        clock.advance(timedelta(milliseconds=LEASE_MS + 1))
        seen = await self._claim(store, token="t2", takeover=False)
        assert seen.status is ClaimStatus.EXISTING and seen.record.token == "t1"
        assert seen.record.is_stale(seen.now_ms)

    async def test_r20_stale_claim_with_other_content_is_not_taken_over(
        self, store: AsyncStore, clock: FakeClock
    ) -> None:
        await self._claim(store, token="t1", fp="f1")
        clock.advance(timedelta(milliseconds=LEASE_MS + 1))
        seen = await self._claim(store, token="t2", fp="f2", takeover=True)
        assert seen.status is ClaimStatus.EXISTING and seen.record.fingerprint == "f1"

    async def test_r10_takeover_needs_the_token_the_reconciler_saw(
        self, store: AsyncStore, clock: FakeClock
    ) -> None:
        await self._claim(store, token="t1")
        clock.advance(timedelta(milliseconds=LEASE_MS + 1))
        wrong = await self._takeover(store, "k", expected_token="other", token="t2")
        assert wrong.status is ClaimStatus.EXISTING and wrong.record.token == "t1"
        right = await self._takeover(store, "k", expected_token="t1", token="t3")
        assert right.status is ClaimStatus.TAKEN_OVER and right.record.token == "t3"
        gone = await self._takeover(store, "absent", expected_token="t1", token="t4")
        assert gone.status is ClaimStatus.NEW and gone.record.token == "t4"

    async def test_r8_batch_claims_answer_like_claims_made_one_by_one(
        self, store: AsyncStore, clock: FakeClock
    ) -> None:
        await self._claim(store, "done", token="d")
        await store.complete("billing", "done", token="d", result=b"r", keep_ms=KEEP_MS)
        await self._claim(store, "stale", token="s")
        clock.advance(timedelta(milliseconds=LEASE_MS + 1))
        await self._claim(store, "live", token="l")
        requests = [
            ClaimRequest("new-1", "f", "n1"),
            ClaimRequest("done", "f", "x1"),
            ClaimRequest("stale", "f", "x2"),
            ClaimRequest("live", "f", "x3"),
            ClaimRequest("new-2", None, "n2"),
            ClaimRequest("new-1", "f", "x4"),  # repeated within the batch: won once
        ]
        claims = await store.claim_many(
            "billing", requests, lease_ms=LEASE_MS, keep_ms=KEEP_MS, takeover=True
        )
        assert [c.status for c in claims] == [
            ClaimStatus.NEW,
            ClaimStatus.EXISTING,
            ClaimStatus.TAKEN_OVER,
            ClaimStatus.EXISTING,
            ClaimStatus.NEW,
            ClaimStatus.EXISTING,
        ]
        assert [c.record.token for c in claims] == ["n1", "d", "x2", "l", "n2", "n1"]
        assert claims[1].record.result == b"r" and claims[2].record.attempt == 2
        assert (
            await store.claim_many("billing", [], lease_ms=LEASE_MS, keep_ms=KEEP_MS, takeover=True)
            == []
        )
        many = [ClaimRequest(f"bulk-{i}", None, f"b{i}") for i in range(250)]
        bulk = await store.claim_many(
            "billing", many, lease_ms=LEASE_MS, keep_ms=KEEP_MS, takeover=False
        )
        assert all(c.status is ClaimStatus.NEW for c in bulk)
        assert (await store.get("billing", "bulk-249")).token == "b249"  # type: ignore[union-attr]
