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
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from datetime import timedelta
from typing import Any, Protocol

import pytest

from oncely._async.inbox import AsyncInbox
from oncely._async.protocols import AsyncStore, AsyncTransactionalStore
from oncely._core.clock import FakeClock
from oncely._core.context import current
from oncely._core.keys import CloudEventsKey, Envelope
from oncely._core.outcomes import Action, Handled, Outcome
from oncely._core.policy import Lease, Limits, Resolution, Retention, StaleClaim
from oncely._core.records import ClaimRequest, ClaimStatus, Status
from oncely.errors import (
    InFlight,
    KeyConflict,
    LeaseLost,
    Reject,
    Rejected,
    TransactionRequired,
    TransactionsUnsupported,
)

__all__ = ["AsyncBusiness", "AsyncStoreContract"]

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


class _Calls:
    """Counts handler runs."""

    def __init__(self, result: object = "done") -> None:
        self.count = 0
        self.result = result

    async def __call__(self, payload: object) -> object:
        self.count += 1
        return self.result


class AsyncStoreContract:
    """The suite. Subclasses provide ``make_store`` and ``business`` fixtures."""

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
        if business is None or not isinstance(store, AsyncTransactionalStore):
            pytest.skip("the store has no transactional mode")
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
    ) -> Any:
        return await store.claim(
            consumer,
            key,
            fingerprint=fp,
            token=token,
            lease_ms=LEASE_MS,
            keep_ms=KEEP_MS,
            takeover=takeover,
        )

    # ------------------------------------------------------------------ store: claims

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
        wrong = await store.takeover(
            "billing",
            "k",
            expected_token="other",
            fingerprint="f",
            token="t2",
            lease_ms=LEASE_MS,
            keep_ms=KEEP_MS,
        )
        assert wrong.status is ClaimStatus.EXISTING and wrong.record.token == "t1"
        right = await store.takeover(
            "billing",
            "k",
            expected_token="t1",
            fingerprint="f",
            token="t3",
            lease_ms=LEASE_MS,
            keep_ms=KEEP_MS,
        )
        assert right.status is ClaimStatus.TAKEN_OVER and right.record.token == "t3"
        gone = await store.takeover(
            "billing",
            "absent",
            expected_token="t1",
            fingerprint="f",
            token="t4",
            lease_ms=LEASE_MS,
            keep_ms=KEEP_MS,
        )
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

    # ------------------------------------------------------------ store: fenced writes

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

    # ------------------------------------------------------------------ store: retention

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

    async def test_r13_a_record_always_outlives_its_lease(self, store: AsyncStore) -> None:
        claim = await store.claim(
            "billing",
            "k",
            fingerprint=None,
            token="t",
            lease_ms=LEASE_MS,
            keep_ms=10,
            takeover=True,
        )
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

    # ------------------------------------------------------------------ store: operations

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

    # --------------------------------------------------------- inbox: two-phase mode (R10)

    async def test_r1_processed_then_duplicate_returns_the_first_result(
        self, inbox: AsyncInbox
    ) -> None:
        handler = _Calls({"charged": 42})
        first = await inbox.handle("order-1", {"amount": 42}, handler)
        assert first.outcome is Outcome.PROCESSED and first.value == {"charged": 42}
        assert first.action is Action.ACK and first.ok and first.attempt == 1
        second = await inbox.handle("order-1", {"amount": 42}, handler)
        assert second.outcome is Outcome.DUPLICATE and second.value == {"charged": 42}
        assert second.action is Action.ACK and handler.count == 1

    async def test_r20_identical_redelivery_is_duplicate_never_key_conflict(
        self, inbox: AsyncInbox
    ) -> None:
        handler = _Calls()
        await inbox.handle("o", {"a": 1, "b": [1, 2], "c": {"x": None}}, handler)
        reordered = {"c": {"x": None}, "b": (1, 2), "a": 1}
        assert (await inbox.handle("o", reordered, handler)).outcome is Outcome.DUPLICATE
        reserialised = b'{ "c": {"x": null}, "a": 1, "b": [1,2] }'
        raw = await inbox.handle("o2", b'{"a":1,"b":[1,2],"c":{"x":null}}', handler)
        assert raw.outcome is Outcome.PROCESSED
        assert (await inbox.handle("o2", reserialised, handler)).outcome is Outcome.DUPLICATE
        assert handler.count == 2

    async def test_r20_step6_reused_key_with_other_content_is_a_conflict(
        self, store: AsyncStore, caplog: pytest.LogCaptureFixture
    ) -> None:
        seen: list[Handled[object]] = []
        inbox = AsyncInbox(store, consumer="billing", lease=LEASE, hooks=[seen.append])
        handler = _Calls()
        await inbox.handle("order-7", {"amount": 10}, handler)
        conflict = await inbox.handle("order-7", {"amount": 99}, handler)
        assert conflict.outcome is Outcome.KEY_CONFLICT
        assert conflict.action is Action.DEAD_LETTER and not conflict.ok
        assert conflict.reason is not None and "different content" in conflict.reason
        assert handler.count == 1
        assert [h.outcome for h in seen] == [Outcome.PROCESSED, Outcome.KEY_CONFLICT]
        errors = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert any(getattr(r, "oncely_outcome", None) == "key_conflict" for r in errors)
        with pytest.raises(KeyConflict):
            conflict.unwrap()

    async def test_r10_failure_releases_the_claim_so_the_redelivery_retries(
        self, inbox: AsyncInbox
    ) -> None:
        runs: list[int] = []

        async def flaky(payload: object) -> str:
            runs.append(1)
            if len(runs) == 1:
                raise ConnectionResetError("provider hung up")
            return "ok"

        failed = await inbox.handle("k", {"x": 1}, flaky)
        assert failed.outcome is Outcome.FAILED and failed.action is Action.RETRY
        assert isinstance(failed.error, ConnectionResetError)
        assert await inbox.get("k") is None  # released: nothing turns the retry into a duplicate
        retried = await inbox.handle("k", {"x": 1}, flaky)
        assert retried.outcome is Outcome.PROCESSED and retried.value == "ok"
        assert len(runs) == 2
        with pytest.raises(ConnectionResetError):
            failed.unwrap()

    async def test_r20_poison_message_is_rejected_for_good(self, inbox: AsyncInbox) -> None:
        runs: list[int] = []

        async def strict(payload: object) -> None:
            runs.append(1)
            raise Reject("amount must be positive")

        first = await inbox.handle("k", {"amount": -1}, strict)
        assert first.outcome is Outcome.REJECTED and first.action is Action.DEAD_LETTER
        assert "amount must be positive" in (first.reason or "")
        record = await inbox.get("k")
        assert record is not None and record.status is Status.FAILED
        again = await inbox.handle("k", {"amount": -1}, strict)
        assert again.outcome is Outcome.REJECTED and "amount must be positive" in (
            again.reason or ""
        )
        assert len(runs) == 1
        with pytest.raises(Rejected):
            again.unwrap()

    async def test_r8_live_claim_elsewhere_is_in_flight_and_never_acked(
        self, store: AsyncStore, inbox: AsyncInbox
    ) -> None:
        await store.claim(
            "billing",
            "k",
            fingerprint=None,
            token="other",
            lease_ms=LEASE_MS,
            keep_ms=KEEP_MS,
            takeover=False,
        )
        handler = _Calls()
        busy = await inbox.handle("k", {"x": 1}, handler)
        assert busy.outcome is Outcome.IN_FLIGHT and busy.action is Action.REQUEUE_LATER
        assert handler.count == 0
        with pytest.raises(InFlight):
            busy.unwrap()

    async def test_r10_stale_claim_is_retried_by_default(
        self, store: AsyncStore, inbox: AsyncInbox, clock: FakeClock
    ) -> None:
        await store.claim(
            "billing",
            "k",
            fingerprint=None,
            token="dead",
            lease_ms=LEASE_MS,
            keep_ms=KEEP_MS,
            takeover=False,
        )
        clock.advance(timedelta(milliseconds=LEASE_MS + 1))
        handler = _Calls("again")
        handled = await inbox.handle("k", {"x": 1}, handler)
        assert handled.outcome is Outcome.STALE_RECLAIMED and handled.value == "again"
        assert handled.action is Action.ACK and handled.attempt == 2 and handler.count == 1

    async def test_r10_stale_claim_is_escalated_when_asked(
        self, store: AsyncStore, clock: FakeClock
    ) -> None:
        inbox = AsyncInbox(store, consumer="billing", lease=LEASE, on_stale="escalate")
        await store.claim(
            "billing",
            "k",
            fingerprint=None,
            token="dead",
            lease_ms=LEASE_MS,
            keep_ms=KEEP_MS,
            takeover=False,
        )
        clock.advance(timedelta(milliseconds=LEASE_MS + 1))
        handler = _Calls()
        handled = await inbox.handle("k", {"x": 1}, handler)
        assert handled.outcome is Outcome.ESCALATED and handled.action is Action.PARK
        assert handler.count == 0
        record = await store.get("billing", "k")
        assert record is not None and record.token == "dead"  # parked as it was

    async def test_r10_reconciler_decides_about_a_stale_claim(
        self, store: AsyncStore, clock: FakeClock
    ) -> None:
        asked: list[StaleClaim] = []
        answers = {
            "done": Resolution.completed({"provider": "paid"}),
            "redo": Resolution.retry(),
            "unsure": Resolution.escalate("provider shows a pending charge"),
        }

        async def reconcile(stale: StaleClaim) -> Resolution:
            asked.append(stale)
            return answers[stale.record.key]

        inbox = AsyncInbox(store, consumer="billing", lease=LEASE, on_stale=reconcile)
        for key in answers:
            await store.claim(
                "billing",
                key,
                fingerprint=None,
                token=f"dead-{key}",
                lease_ms=LEASE_MS,
                keep_ms=KEEP_MS,
                takeover=False,
            )
        clock.advance(timedelta(milliseconds=LEASE_MS + 1))
        handler = _Calls("ran")
        done = await inbox.handle("done", {"x": 1}, handler)
        assert done.outcome is Outcome.DUPLICATE and done.value == {"provider": "paid"}
        assert (await store.get("billing", "done")).status is Status.COMPLETED  # type: ignore[union-attr]
        redo = await inbox.handle("redo", {"x": 1}, handler)
        assert redo.outcome is Outcome.STALE_RECLAIMED and redo.value == "ran"
        unsure = await inbox.handle("unsure", {"x": 1}, handler)
        assert unsure.outcome is Outcome.ESCALATED
        assert unsure.reason == "provider shows a pending charge"
        assert handler.count == 1
        assert [s.record.key for s in asked] == ["done", "redo", "unsure"]
        assert asked[0].payload == {"x": 1} and asked[0].record.token == "dead-done"

    async def test_r10_zombie_result_never_overwrites_the_new_owner(
        self, store: AsyncStore, inbox: AsyncInbox, clock: FakeClock
    ) -> None:
        async def slow(payload: object) -> str:
            # While this attempt runs, its lease lapses and another worker takes the key over.
            clock.advance(timedelta(milliseconds=LEASE_MS + 1))
            await store.claim(
                "billing",
                "k",
                fingerprint=None,
                token="owner",
                lease_ms=LEASE_MS,
                keep_ms=KEEP_MS,
                takeover=True,
            )
            await store.complete("billing", "k", token="owner", result=b'"owner"', keep_ms=KEEP_MS)
            return "zombie"

        handled = await inbox.handle("k", {"x": 1}, slow)
        assert handled.outcome is Outcome.IN_FLIGHT and handled.action is Action.REQUEUE_LATER
        assert "lease lost" in (handled.reason or "")
        record = await store.get("billing", "k")
        assert record is not None and record.result == b'"owner"' and record.token == "owner"
        duplicate = await inbox.handle("k", {"x": 1}, slow)
        assert duplicate.outcome is Outcome.DUPLICATE and duplicate.value == "owner"

    async def test_r10_zombie_failure_never_releases_the_new_owners_claim(
        self, store: AsyncStore, inbox: AsyncInbox, clock: FakeClock
    ) -> None:
        async def crashes_late(payload: object) -> str:
            clock.advance(timedelta(milliseconds=LEASE_MS + 1))
            await store.claim(
                "billing",
                "k",
                fingerprint=None,
                token="owner",
                lease_ms=LEASE_MS,
                keep_ms=KEEP_MS,
                takeover=True,
            )
            raise TimeoutError("too slow")

        handled = await inbox.handle("k", {"x": 1}, crashes_late)
        assert handled.outcome is Outcome.FAILED
        record = await store.get("billing", "k")
        assert (
            record is not None and record.token == "owner" and record.status is Status.IN_PROGRESS
        )

    async def test_r1_batches_are_claimed_together_and_answered_per_item(
        self, inbox: AsyncInbox
    ) -> None:
        handler = _Calls("ok")
        await inbox.handle("seen", {"n": 0}, handler)
        handled = await inbox.handle_batch(
            [
                ("a", {"n": 1}),
                ("seen", {"n": 0}),
                ("", {"n": 2}),
                ("seen", {"n": 99}),
                ("b", {"n": 3}),
                ("a", {"n": 1}),
            ],
            handler,
        )
        assert [h.outcome for h in handled] == [
            Outcome.PROCESSED,
            Outcome.DUPLICATE,
            Outcome.REJECTED,
            Outcome.KEY_CONFLICT,
            Outcome.PROCESSED,
            Outcome.IN_FLIGHT,  # its first copy held the claim when the batch was claimed
        ]
        assert [h.key for h in handled] == ["a", "seen", None, "seen", "b", "a"]
        assert handler.count == 3
        again = await inbox.handle_batch([("a", {"n": 1}), ("b", {"n": 3})], handler)
        assert [h.outcome for h in again] == [Outcome.DUPLICATE, Outcome.DUPLICATE]

    async def test_r2_r4_messages_without_a_usable_key_are_rejected(
        self, store: AsyncStore
    ) -> None:
        inbox = AsyncInbox(store, consumer="billing", limits=Limits(max_key_bytes=32))
        handler = _Calls()
        for bad in (None, "", 42, "x" * 33, "nul\x00byte"):
            handled = await inbox.handle(bad, {"a": 1}, handler)  # type: ignore[arg-type]
            assert handled.outcome is Outcome.REJECTED and handled.action is Action.DEAD_LETTER
            assert handled.reason
        assert handler.count == 0
        hashing = AsyncInbox(
            store, consumer="billing", limits=Limits(max_key_bytes=32, hash_long_keys=True)
        )
        long_key = "y" * 100
        assert (await hashing.handle(long_key, {"a": 1}, handler)).outcome is Outcome.PROCESSED
        assert (await hashing.handle(long_key, {"a": 1}, handler)).outcome is Outcome.DUPLICATE
        assert handler.count == 1

    async def test_unfingerprintable_payload_is_rejected_not_crashed(
        self, inbox: AsyncInbox
    ) -> None:
        handler = _Calls()
        handled = await inbox.handle("k", {"obj": object()}, handler)
        assert handled.outcome is Outcome.REJECTED and "fingerprint" in (handled.reason or "")
        assert handler.count == 0

    async def test_result_too_large_is_not_stored_but_the_effect_is_recorded(
        self, store: AsyncStore
    ) -> None:
        inbox = AsyncInbox(store, consumer="billing", limits=Limits(max_result_bytes=100))
        handler = _Calls("x" * 500)
        first = await inbox.handle("k", {"a": 1}, handler)
        assert first.outcome is Outcome.PROCESSED and first.value == "x" * 500
        assert "result not stored" in (first.reason or "")
        second = await inbox.handle("k", {"a": 1}, handler)
        assert second.outcome is Outcome.DUPLICATE and second.value is None
        assert "result not stored" in (second.reason or "")
        assert handler.count == 1

    async def test_r17_handler_sees_its_message_and_a_downstream_key(
        self, inbox: AsyncInbox
    ) -> None:
        seen: list[tuple[str, str, int, str | None, str]] = []

        async def handler(payload: object) -> None:
            now = current()
            assert now is not None
            seen.append(
                (
                    now.consumer,
                    now.key,
                    now.attempt,
                    now.correlation_id,
                    now.downstream_key("charge"),
                )
            )

        await inbox.handle("k", {"a": 1}, handler, correlation_id="corr-1")
        assert current() is None
        (consumer, key, attempt, correlation, downstream) = seen[0]
        assert (consumer, key, attempt, correlation) == ("billing", "k", 1, "corr-1")
        other = AsyncInbox(inbox.store, consumer="billing")
        await other.forget("k")
        await other.handle("k", {"a": 1}, handler)
        assert seen[1][4] == downstream  # the same on every attempt and redelivery

    async def test_r16_every_outcome_is_logged_with_its_fields(
        self, inbox: AsyncInbox, caplog: pytest.LogCaptureFixture
    ) -> None:
        await inbox.handle("k", {"a": 1}, _Calls(), correlation_id="c-9")
        await inbox.handle("k", {"a": 1}, _Calls(), correlation_id="c-9")
        records = [r for r in caplog.records if r.name == "oncely"]
        assert [getattr(r, "oncely_outcome", None) for r in records] == ["processed", "duplicate"]
        for record in records:
            assert getattr(record, "oncely_consumer", None) == "billing"
            assert getattr(record, "oncely_key", None) == "k"
            assert getattr(record, "oncely_correlation_id", None) == "c-9"
            assert isinstance(getattr(record, "oncely_duration_ms", None), float)

    async def test_r16_keys_can_be_hashed_in_logs_and_hooks_never_break_the_flow(
        self, store: AsyncStore, caplog: pytest.LogCaptureFixture
    ) -> None:
        def broken_hook(handled: Handled[object]) -> None:
            raise RuntimeError("exporter down")

        inbox = AsyncInbox(store, consumer="billing", log_keys="hash", hooks=[broken_hook])
        handled = await inbox.handle("secret-card-4111", {"a": 1}, _Calls())
        assert handled.outcome is Outcome.PROCESSED
        logged = [getattr(r, "oncely_key", None) for r in caplog.records if r.name == "oncely"]
        assert "secret-card-4111" not in " ".join(caplog.text.split())
        assert any(isinstance(k, str) and k.startswith("h:") for k in logged)

    async def test_call_style_api_runs_once_and_raises_on_conflict(self, inbox: AsyncInbox) -> None:
        runs: list[int] = []

        @inbox.idempotent(key=lambda order_id, amount: f"charge:{order_id}")
        async def charge(order_id: str, amount: int) -> dict[str, object]:
            runs.append(amount)
            return {"order": order_id, "charged": amount}

        assert await charge("o-1", 5) == {"order": "o-1", "charged": 5}
        assert await charge("o-1", amount=5) == {"order": "o-1", "charged": 5}
        with pytest.raises(KeyConflict):
            await charge("o-1", 6)
        assert runs == [5]

    async def test_r3_messages_are_keyed_by_their_source(self, inbox: AsyncInbox) -> None:
        handler = _Calls()
        missing = await inbox.handle_message(Envelope(body={"a": 1}), handler)
        assert missing.outcome is Outcome.REJECTED and missing.key is None
        by_id = Envelope(body={"a": 1}, message_id="m-1", correlation_id="c")
        assert (await inbox.handle_message(by_id, handler)).outcome is Outcome.PROCESSED
        assert (await inbox.handle_message(by_id, handler)).outcome is Outcome.DUPLICATE
        event = Envelope(
            body={"specversion": "1.0", "source": "/shop", "id": "e-1", "data": {"a": 1}}
        )
        ce = await inbox.handle_message(event, handler, key=CloudEventsKey())
        assert ce.outcome is Outcome.PROCESSED and ce.key == "/shop e-1"
        assert handler.count == 2

    async def test_r7_memory_like_stores_refuse_the_transactional_mode(
        self, store: AsyncStore, inbox: AsyncInbox
    ) -> None:
        if isinstance(store, AsyncTransactionalStore):
            pytest.skip("the store has a transactional mode")

        async def book(tx: object, payload: object) -> None:
            raise AssertionError("must not run")

        with pytest.raises(TransactionsUnsupported):
            await inbox.handle_in_transaction("k", {"a": 1}, book)

    # ------------------------------------------------------ inbox: transactional mode (R7)

    async def test_r7_marker_and_business_writes_commit_together(
        self, store: AsyncStore, inbox: AsyncInbox, business: AsyncBusiness | None
    ) -> None:
        ledger = self._transactional(store, business)

        async def book(tx: Any, payload: dict[str, int]) -> dict[str, int]:
            await ledger.write(tx, "order-1", payload["amount"])
            return {"booked": payload["amount"]}

        first = await inbox.handle_in_transaction("order-1", {"amount": 30}, book)
        assert first.outcome is Outcome.PROCESSED and first.value == {"booked": 30}
        assert first.record is not None and first.record.status is Status.COMPLETED
        second = await inbox.handle_in_transaction("order-1", {"amount": 30}, book)
        assert second.outcome is Outcome.DUPLICATE and second.value == {"booked": 30}
        assert await ledger.count("order-1") == 1
        conflict = await inbox.handle_in_transaction("order-1", {"amount": 31}, book)
        assert conflict.outcome is Outcome.KEY_CONFLICT
        assert await ledger.count("order-1") == 1

    async def test_r7_handler_failure_rolls_back_writes_and_marker(
        self, store: AsyncStore, inbox: AsyncInbox, business: AsyncBusiness | None
    ) -> None:
        ledger = self._transactional(store, business)
        runs: list[int] = []

        async def book(tx: Any, payload: object) -> None:
            runs.append(1)
            await ledger.write(tx, "k", 1)
            if len(runs) == 1:
                raise RuntimeError("crash after the write, before the commit")

        failed = await inbox.handle_in_transaction("k", {"a": 1}, book)
        assert failed.outcome is Outcome.FAILED and isinstance(failed.error, RuntimeError)
        assert await ledger.count("k") == 0 and await inbox.get("k") is None
        retried = await inbox.handle_in_transaction("k", {"a": 1}, book)
        assert retried.outcome is Outcome.PROCESSED and await ledger.count("k") == 1

    async def test_r7_poison_in_a_transaction_is_recorded_without_its_writes(
        self, store: AsyncStore, inbox: AsyncInbox, business: AsyncBusiness | None
    ) -> None:
        ledger = self._transactional(store, business)

        async def book(tx: Any, payload: object) -> None:
            await ledger.write(tx, "k", 1)
            raise Reject("unknown currency")

        handled = await inbox.handle_in_transaction("k", {"a": 1}, book)
        assert handled.outcome is Outcome.REJECTED
        assert await ledger.count("k") == 0
        record = await inbox.get("k")
        assert record is not None and record.status is Status.FAILED
        again = await inbox.handle_in_transaction("k", {"a": 1}, book)
        assert again.outcome is Outcome.REJECTED and "unknown currency" in (again.reason or "")

    async def test_r7_unstorable_result_fails_the_whole_transaction(
        self, store: AsyncStore, business: AsyncBusiness | None
    ) -> None:
        ledger = self._transactional(store, business)
        inbox = AsyncInbox(store, consumer="billing", limits=Limits(max_result_bytes=10))

        async def book(tx: Any, payload: object) -> str:
            await ledger.write(tx, "k", 1)
            return "a result far over ten bytes"

        handled = await inbox.handle_in_transaction("k", {"a": 1}, book)
        assert handled.outcome is Outcome.FAILED and "over the limit" in (handled.reason or "")
        assert await ledger.count("k") == 0 and await inbox.get("k") is None

    async def test_r7_inside_a_transaction_the_caller_owns(
        self, store: AsyncStore, inbox: AsyncInbox, business: AsyncBusiness | None
    ) -> None:
        ledger = self._transactional(store, business)
        assert isinstance(store, AsyncTransactionalStore)

        async def book(tx: Any, payload: object) -> str:
            await ledger.write(tx, "k", 1)
            return "booked"

        async def fails(tx: Any, payload: object) -> str:
            await ledger.write(tx, "bad", 1)
            raise ValueError("no")

        class Abort(Exception):
            pass

        with pytest.raises(Abort):
            async with store.transaction() as tx:
                handled = await inbox.handle_in_transaction("k", {"a": 1}, book, tx=tx)
                assert handled.outcome is Outcome.PROCESSED
                raise Abort  # the caller rolls back: nothing was recorded
        assert await inbox.get("k") is None and await ledger.count("k") == 0
        async with store.transaction() as tx:
            await ledger.write(tx, "before", 1)
            failed = await inbox.handle_in_transaction("bad", {"a": 1}, fails, tx=tx)
            assert failed.outcome is Outcome.FAILED  # rolled back to the savepoint only
            handled = await inbox.handle_in_transaction("k", {"a": 1}, book, tx=tx)
            assert handled.outcome is Outcome.PROCESSED
        assert await ledger.count("before") == 1 and await ledger.count("k") == 1
        assert await ledger.count("bad") == 0 and await inbox.get("bad") is None
        assert (await inbox.handle_in_transaction("k", {"a": 1}, book)).outcome is Outcome.DUPLICATE

    async def test_r7_without_a_savepoint_handler_errors_reach_the_caller(
        self, store: AsyncStore, inbox: AsyncInbox, business: AsyncBusiness | None
    ) -> None:
        ledger = self._transactional(store, business)
        assert isinstance(store, AsyncTransactionalStore)

        async def fails(tx: Any, payload: object) -> None:
            await ledger.write(tx, "k", 1)
            raise ValueError("broken handler")

        async def book(tx: Any, payload: object) -> str:
            await ledger.write(tx, "k", 1)
            return "booked"

        with pytest.raises(ValueError, match="broken handler"):
            async with store.transaction() as tx:
                await inbox.handle_in_transaction("k", {"a": 1}, fails, tx=tx, savepoint=False)
        assert await inbox.get("k") is None and await ledger.count("k") == 0
        async with store.transaction() as tx:
            handled = await inbox.handle_in_transaction("k", {"a": 1}, book, tx=tx, savepoint=False)
            assert handled.outcome is Outcome.PROCESSED
        assert await ledger.count("k") == 1
        async with store.transaction() as tx:
            again = await inbox.handle_in_transaction("k", {"a": 1}, book, tx=tx, savepoint=False)
        assert again.outcome is Outcome.DUPLICATE and await ledger.count("k") == 1

    async def test_r7_joining_needs_an_open_transaction(
        self, store: AsyncStore, inbox: AsyncInbox, business: AsyncBusiness | None
    ) -> None:
        self._transactional(store, business)
        assert isinstance(store, AsyncTransactionalStore)

        async def book(tx: Any, payload: object) -> None:
            raise AssertionError("must not run")

        async with store.transaction() as tx:
            pass
        with pytest.raises(TransactionRequired):
            await inbox.handle_in_transaction("k", {"a": 1}, book, tx=tx)
