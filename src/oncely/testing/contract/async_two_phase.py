"""Contract, the inbox's two-phase mode (R1, R8, R10, R20): processed then duplicate, key
conflicts, failures released for a retry, poison messages failed for good, claims in flight,
stale claims retried, escalated or reconciled, and zombies that never overwrite the new owner."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest

from oncely._core.clock import FakeClock
from oncely._core.keys import Envelope
from oncely._core.outcomes import Action, Handled, Outcome
from oncely._core.policy import Resolution, StaleClaim
from oncely._core.records import Status
from oncely.errors import InFlight, KeyConflict, Reject, Rejected
from oncely.inbox.async_inbox import AsyncInbox
from oncely.stores.async_protocols import AsyncStore
from oncely.testing.contract.async_base import KEEP_MS, LEASE, LEASE_MS, Calls, ContractBase

__all__ = ["TwoPhaseContract"]


@dataclass(frozen=True)
class Charged:
    """A typed result: a repeat answers with it too, not with its stored JSON form."""

    amount: Decimal
    at: datetime


class TwoPhaseContract(ContractBase):
    """The inbox's two-phase mode on the store."""

    async def test_r1_processed_then_duplicate_returns_the_first_result(
        self, inbox: AsyncInbox
    ) -> None:
        handler = Calls({"charged": 42})
        first = await inbox.handle("order-1", {"amount": 42}, handler)
        assert first.outcome is Outcome.PROCESSED and first.value == {"charged": 42}
        assert first.action is Action.ACK and first.ok and first.attempt == 1
        second = await inbox.handle("order-1", {"amount": 42}, handler)
        assert second.outcome is Outcome.DUPLICATE and second.value == {"charged": 42}
        assert second.action is Action.ACK and handler.count == 1

    async def test_r1_a_duplicate_returns_the_first_result_as_the_handlers_type(
        self, inbox: AsyncInbox
    ) -> None:
        """The first call's value is what the handler returned; a repeat's was its stored
        JSON form (a dict of strings), so code reading ``value.amount`` worked until the
        first duplicate. It is now brought back to the return annotation (``returns=None``:
        as stored), as ``@idempotent`` does."""
        calls: list[object] = []

        async def charge(payment: dict[str, int]) -> Charged:
            calls.append(payment)
            return Charged(Decimal("42.10"), datetime(2026, 1, 2, 3, 4, 5, 600, tzinfo=UTC))

        first = await inbox.handle("order-1", {"amount": 42}, charge)
        second = await inbox.handle("order-1", {"amount": 42}, charge)
        assert second.outcome is Outcome.DUPLICATE and len(calls) == 1
        assert type(second.value) is Charged and second.value == first.value
        stored = await inbox.handle("order-1", {"amount": 42}, charge, returns=None)
        as_stored: object = stored.value  # returns=None: the stored form, whatever R says
        assert stored.outcome is Outcome.DUPLICATE and isinstance(as_stored, dict)
        again = await inbox.handle("order-1", {"amount": 42}, Calls(), returns=Charged)
        assert again.value == first.value

    async def test_r1_a_messages_duplicate_is_never_converted(self, inbox: AsyncInbox) -> None:
        """A broker message's duplicate is acknowledged and its value read by no one: a stored
        result the handler's annotation refuses must not raise there (the consumer would give
        the message back for ever)."""

        async def charge(payment: object) -> Charged:
            return {"not": "a Charged"}  # type: ignore[return-value]

        envelope = Envelope(body={"amount": 1}, message_id="m-1")
        assert (await inbox.handle_message(envelope, charge)).outcome is Outcome.PROCESSED
        again = await inbox.handle_message(envelope, charge)
        stored: object = again.value  # the stored form, whatever the annotation says
        assert again.outcome is Outcome.DUPLICATE and stored == {"not": "a Charged"}

    async def test_r20_identical_redelivery_is_duplicate_never_key_conflict(
        self, inbox: AsyncInbox
    ) -> None:
        handler = Calls()
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
        handler = Calls()
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
        await self._claim(store, token="other", fp=None, takeover=False)
        handler = Calls()
        busy = await inbox.handle("k", {"x": 1}, handler)
        assert busy.outcome is Outcome.IN_FLIGHT and busy.action is Action.REQUEUE_LATER
        assert handler.count == 0
        with pytest.raises(InFlight):
            busy.unwrap()

    async def test_r10_stale_claim_is_retried_by_default(
        self, store: AsyncStore, inbox: AsyncInbox, clock: FakeClock
    ) -> None:
        await self._claim(store, token="dead", fp=None, takeover=False)
        clock.advance(timedelta(milliseconds=LEASE_MS + 1))
        handler = Calls("again")
        handled = await inbox.handle("k", {"x": 1}, handler)
        assert handled.outcome is Outcome.STALE_RECLAIMED and handled.value == "again"
        assert handled.action is Action.ACK and handled.attempt == 2 and handler.count == 1

    async def test_r10_stale_claim_is_escalated_when_asked(
        self, store: AsyncStore, clock: FakeClock
    ) -> None:
        inbox = AsyncInbox(store, consumer="billing", lease=LEASE, on_stale="escalate")
        await self._claim(store, token="dead", fp=None, takeover=False)
        clock.advance(timedelta(milliseconds=LEASE_MS + 1))
        handler = Calls()
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
            await self._claim(store, key, token=f"dead-{key}", fp=None, takeover=False)
        clock.advance(timedelta(milliseconds=LEASE_MS + 1))
        handler = Calls("ran")
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
            await self._claim(store, token="owner", fp=None)
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
            await self._claim(store, token="owner", fp=None)
            raise TimeoutError("too slow")

        handled = await inbox.handle("k", {"x": 1}, crashes_late)
        assert handled.outcome is Outcome.FAILED
        record = await store.get("billing", "k")
        assert (
            record is not None and record.token == "owner" and record.status is Status.IN_PROGRESS
        )
