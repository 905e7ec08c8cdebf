"""Contract, the rest of the inbox's surface (R2-R4, R16, R17): batches, keys and payloads it
refuses, results over the limit, the handler's context, logs and hooks, the decorator, and broker
messages keyed by their source."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest

from oncely._core.clock import FakeClock
from oncely._core.context import current, handling
from oncely._core.keys import CloudEventsKey, Envelope
from oncely._core.outcomes import Action, Handled, Outcome
from oncely._core.policy import Limits, Resolution, StaleClaim
from oncely.errors import ClaimEnded, KeyConflict, LeaseLost, Reject
from oncely.inbox.async_inbox import AsyncInbox
from oncely.stores.async_protocols import AsyncStore
from oncely.testing.contract.async_base import LEASE, LEASE_MS, RETENTION, Calls, ContractBase

__all__ = ["InboxContract"]


@dataclass(frozen=True)
class Line:
    sku: str
    count: int


@dataclass(frozen=True)
class Invoice:
    order: str
    total: Decimal
    at: datetime
    lines: list[Line]
    note: str | None


class InboxContract(ContractBase):
    """The inbox's entry points and observability on the store."""

    async def test_r1_batches_are_claimed_together_and_answered_per_item(
        self, inbox: AsyncInbox
    ) -> None:
        handler = Calls("ok")
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
            Outcome.DUPLICATE,  # a copy of the first item: its duplicate once it completed
        ]
        assert [h.key for h in handled] == ["a", "seen", None, "seen", "b", "a"]
        assert handled[5].value == handled[0].value == "ok"
        assert handler.count == 3
        again = await inbox.handle_batch([("a", {"n": 1}), ("b", {"n": 3})], handler)
        assert [h.outcome for h in again] == [Outcome.DUPLICATE, Outcome.DUPLICATE]

    async def test_r1_r8_copies_within_a_batch_follow_their_first_copy(
        self, inbox: AsyncInbox, store: AsyncStore
    ) -> None:
        # A producer's retry often lands in the same poll as the original: the copy is the
        # duplicate of its first copy once that completed, never run twice, never given back.
        async def handler(payload: dict[str, str]) -> str:
            if payload["id"] == "down":
                raise RuntimeError("down")
            return payload["id"].upper()

        items = [
            ("k1", {"id": "one"}),
            ("k2", {"id": "down"}),
            ("k1", {"id": "one"}),  # a copy of the first item
            ("k2", {"id": "down"}),  # a copy of one that failed
            ("k1", {"id": "other"}),  # the key reused for other content
        ]
        handled = await inbox.handle_batch(items, handler, groups=["p", "q", "p", "q", "p"])
        assert [h.outcome for h in handled] == [
            Outcome.PROCESSED,
            Outcome.FAILED,
            Outcome.DUPLICATE,
            Outcome.IN_FLIGHT,  # its first copy did not finish: delivered again later
            Outcome.KEY_CONFLICT,
        ]
        assert handled[2].value == "ONE" and handled[2].action is Action.ACK
        assert handled[3].action is Action.REQUEUE_LATER
        assert await store.get("billing", "k2") is None  # released: a redelivery retries
        done = await store.get("billing", "k1")
        assert done is not None and done.attempt == 1  # run once for the three copies

    async def test_r1_a_batch_keeps_each_groups_order_and_holds_back_after_a_failure(
        self, inbox: AsyncInbox, store: AsyncStore
    ) -> None:
        ran: list[str] = []

        async def handler(payload: dict[str, str]) -> str:
            ran.append(payload["id"])
            if payload["id"] == "a2":
                raise RuntimeError("a2 is down")
            if payload["id"] == "b3":
                raise Reject("b3 is poison")
            return payload["id"].upper()

        ids = ["a1", "b1", "a2", "a3", "b2", "b3", "b4"]
        handled = await inbox.handle_batch(
            [(i, {"id": i}) for i in ids], handler, groups=[i[0] for i in ids], concurrency=2
        )
        assert [h.outcome for h in handled] == [
            Outcome.PROCESSED,
            Outcome.PROCESSED,
            Outcome.FAILED,
            Outcome.IN_FLIGHT,  # held back behind a2: the group's order is kept
            Outcome.PROCESSED,
            Outcome.REJECTED,  # a poison message is settled: its group goes on
            Outcome.PROCESSED,
        ]
        assert [h.value for h in handled if h.outcome is Outcome.PROCESSED] == [
            "A1", "B1", "B2", "B4"
        ]  # fmt: skip
        assert "a2" in (handled[3].reason or "") and handled[3].action is Action.REQUEUE_LATER
        assert [i for i in ran if i[0] == "a"] == ["a1", "a2"]
        assert [i for i in ran if i[0] == "b"] == ["b1", "b2", "b3", "b4"]
        assert await store.get("billing", "a2") is None  # released: a redelivery retries
        assert await store.get("billing", "a3") is None  # released, never run
        done = await store.get("billing", "a1")
        assert done is not None and done.status.value == "completed"
        again = await inbox.handle_batch(
            [(i, {"id": i}) for i in ("a1", "a3")], Calls("later"), groups=["a", "a"]
        )
        assert [h.outcome for h in again] == [Outcome.DUPLICATE, Outcome.PROCESSED]
        assert again[0].value == "A1" and again[1].value == "later"

    async def test_r10_r15_a_batch_message_given_back_while_it_runs_holds_back_its_group(
        self, store: AsyncStore, clock: FakeClock
    ) -> None:
        """A message can be given back (``in_flight``) after the batch's claim, not only at it:
        its claim had lapsed, and while the reconciler (``on_stale``) looks the work up, another
        worker takes the key over; or its handler rejects it after losing its lease. Either
        way it comes again, so the later messages of its group must wait behind it (a FIFO
        group, a partition: R15). Before, in a batch only a failure held them back: ``a2`` ran
        ahead of ``a1``, and ``c2`` ahead of ``c1``."""

        async def reconcile(stale: StaleClaim) -> Resolution:
            # Meanwhile, another worker with the same stale copy took the key over.
            taken = await store.takeover(
                "billing",
                stale.record.key,
                expected_token=stale.record.token,
                fingerprint=None,
                token="other",
                lease_ms=LEASE_MS,
                keep_ms=RETENTION.keep_ms,
            )
            assert taken.won
            return Resolution.retry()

        ran: list[str] = []

        async def handler(payload: dict[str, str]) -> str:
            ran.append(payload["id"])
            if payload["id"] == "c1":
                # Its lease lapses meanwhile and another worker takes the key over.
                clock.advance(timedelta(milliseconds=LEASE_MS + 1))
                await self._claim(store, "c1", token="owner", fp=None)
                raise Reject("c1 is poison")
            return payload["id"].upper()

        inbox = AsyncInbox(
            store, consumer="billing", lease=LEASE, retention=RETENTION, on_stale=reconcile
        )
        await self._claim(store, "a1", token="dead", fp=None, takeover=False)
        clock.advance(timedelta(milliseconds=LEASE_MS + 1))  # a1's worker died
        ids = ["a1", "a2", "b1", "c1", "c2"]
        handled = await inbox.handle_batch(
            [(i, {"id": i}) for i in ids], handler, groups=[i[0] for i in ids]
        )
        assert [h.outcome for h in handled] == [
            Outcome.IN_FLIGHT,  # held by the worker that took it over
            Outcome.IN_FLIGHT,  # held back behind a1: the group's order is kept
            Outcome.PROCESSED,
            Outcome.IN_FLIGHT,  # its lease lost: the new owner's outcome wins
            Outcome.IN_FLIGHT,  # held back behind c1
        ], handled
        assert [i for i in ran if i[0] != "b"] == ["c1"]  # neither a2 nor c2 ran
        assert "a1" in (handled[1].reason or "") and "c1" in (handled[4].reason or "")
        assert handled[1].action is Action.REQUEUE_LATER
        assert await store.get("billing", "a2") is None  # released: it comes again, after a1
        assert await store.get("billing", "c2") is None

    async def test_r2_messages_of_a_batch_are_keyed_by_their_own_ids(
        self, inbox: AsyncInbox
    ) -> None:
        handler = Calls("ok")
        batch = [
            Envelope(body={"n": 1}, message_id="m-1", correlation_id="c-1"),
            Envelope(body={"n": 2}, message_id=None),
            Envelope(body={"n": 1}, message_id="m-1"),
            Envelope(body={"n": 3}, message_id="m-3"),
        ]
        handled = await inbox.handle_messages(batch, handler)
        assert [h.outcome for h in handled] == [
            Outcome.PROCESSED,
            Outcome.REJECTED,  # no key: dead-lettered, never processed unprotected (R4)
            Outcome.DUPLICATE,  # the producer's retry in the same batch, settled at once
            Outcome.PROCESSED,
        ]
        assert handled[0].correlation_id == "c-1" and handler.count == 2
        assert [h.outcome for h in await inbox.handle_messages(batch[3:], handler)] == [
            Outcome.DUPLICATE
        ]

    async def test_r2_r4_messages_without_a_usable_key_are_rejected(
        self, store: AsyncStore
    ) -> None:
        inbox = AsyncInbox(store, consumer="billing", limits=Limits(max_key_bytes=32))
        handler = Calls()
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
        handler = Calls()
        handled = await inbox.handle("k", {"obj": object()}, handler)
        assert handled.outcome is Outcome.REJECTED and "fingerprint" in (handled.reason or "")
        assert handler.count == 0

    async def test_result_too_large_is_not_stored_but_the_effect_is_recorded(
        self, store: AsyncStore
    ) -> None:
        inbox = AsyncInbox(store, consumer="billing", limits=Limits(max_result_bytes=100))
        handler = Calls("x" * 500)
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

    async def test_r17_a_manual_claim_passes_on_the_handlers_downstream_key(
        self, inbox: AsyncInbox
    ) -> None:
        """Work done under :meth:`AsyncInbox.claim` (no handler, so no ``handling()``) passes
        on the key a handler of the same key would, on every attempt, and a reconciler of a
        claim that lapsed finds it (R17)."""
        keys: list[str] = []

        async def handler(payload: object) -> None:
            keys.append(handling().downstream_key("charge"))

        await inbox.handle("by-handler", {"a": 1}, handler)
        claimed = await inbox.claim("by-handler-2", {"a": 1})
        first = claimed.downstream_key("charge")
        await claimed.release()
        again = await inbox.claim("by-handler-2", {"a": 1})
        assert again.downstream_key("charge") == first
        assert first != again.downstream_key("email")
        await again.complete(None)
        copy = await inbox.claim("by-handler-2", {"a": 1})
        assert not copy.won and copy.downstream_key("charge") == first
        await inbox.forget("by-handler")
        manual = await inbox.claim("by-handler", {"a": 1})
        assert manual.downstream_key("charge") == keys[0]
        assert manual.downstream_key("charge") != first
        await manual.release()

    async def test_r16_every_outcome_is_logged_with_its_fields(
        self, inbox: AsyncInbox, caplog: pytest.LogCaptureFixture
    ) -> None:
        caplog.set_level(logging.INFO, logger="oncely")  # outcomes log at INFO
        await inbox.handle("k", {"a": 1}, Calls(), correlation_id="c-9")
        await inbox.handle("k", {"a": 1}, Calls(), correlation_id="c-9")
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

        caplog.set_level(logging.INFO, logger="oncely")
        inbox = AsyncInbox(store, consumer="billing", log_keys="hash", hooks=[broken_hook])
        handled = await inbox.handle("secret-card-4111", {"a": 1}, Calls())
        assert handled.outcome is Outcome.PROCESSED
        logged = [getattr(r, "oncely_key", None) for r in caplog.records if r.name == "oncely"]
        assert "secret-card-4111" not in " ".join(caplog.text.split())
        assert any(isinstance(k, str) and k.startswith("h:") for k in logged)

    async def test_r16_a_call_inside_a_handler_keeps_its_messages_correlation_id(
        self, inbox: AsyncInbox, caplog: pytest.LogCaptureFixture
    ) -> None:
        """An ``@idempotent`` function a handler calls (and a nested ``handle``) has no
        correlation id of its own: its outcome is logged, and handed to hooks, with the one of
        the message being handled, so the message can be followed through it. One given
        explicitly wins; outside a handler there is none."""
        caplog.set_level(logging.INFO, logger="oncely")

        @inbox.idempotent(key=lambda order_id: f"refund:{order_id}")
        async def refund(order_id: str) -> str:
            return order_id

        async def handler(payload: dict[str, str]) -> None:
            await refund(payload["order"])
            await inbox.handle("mail:" + payload["order"], {}, Calls(), correlation_id="own")

        await inbox.handle("msg-1", {"order": "o-1"}, handler, correlation_id="corr-1")
        await refund("o-2")
        logged = {
            getattr(r, "oncely_key", None): getattr(r, "oncely_correlation_id", None)
            for r in caplog.records
            if r.name == "oncely"
        }
        assert logged == {
            "refund:o-1": "corr-1",
            "mail:o-1": "own",
            "msg-1": "corr-1",
            "refund:o-2": None,
        }

    async def test_r16_hashed_keys_stay_hashed_in_the_reasons_of_held_back_messages(
        self, store: AsyncStore, caplog: pytest.LogCaptureFixture
    ) -> None:
        """A batch's message held back behind an earlier one of its group (held elsewhere,
        or failed) is ``in_flight`` with a reason that names that earlier key: with
        ``log_keys="hash"`` as the log lines show it, never the key itself."""

        async def handler(payload: dict[str, str]) -> None:
            if payload["k"] == "secret-card-2":
                raise RuntimeError("declined")

        caplog.set_level(logging.INFO, logger="oncely")
        inbox = AsyncInbox(store, consumer="billing", log_keys="hash")
        other = AsyncInbox(store, consumer="billing")
        held = await other.claim("secret-card-1", {"k": "secret-card-1"})
        assert held.won
        items = [(k, {"k": k}) for k in ("secret-card-1", "later-1", "secret-card-2", "later-2")]
        done = await inbox.handle_batch(items, handler, groups=["a", "a", "b", "b"])
        assert [d.outcome for d in done] == [
            Outcome.IN_FLIGHT,
            Outcome.IN_FLIGHT,
            Outcome.FAILED,
            Outcome.IN_FLIGHT,
        ]
        assert all("secret-card" not in (d.reason or "") for d in done), done
        assert "secret-card" not in caplog.text
        await held.release()

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

    async def test_r1_a_repeat_of_the_call_style_api_returns_the_first_results_type(
        self, inbox: AsyncInbox
    ) -> None:
        runs: list[str] = []

        @inbox.idempotent(key=lambda order_id: f"invoice:{order_id}")
        async def invoice(order_id: str) -> Invoice:
            runs.append(order_id)
            return Invoice(
                order_id,
                Decimal("12.30"),
                datetime(2026, 12, 1, 9, 30, tzinfo=UTC),
                [Line("book", 2)],
                None,
            )

        first = await invoice("o-9")
        again = await invoice("o-9")
        assert type(again) is Invoice and again == first  # not the stored dict
        assert isinstance(again.lines[0], Line) and isinstance(again.total, Decimal)
        assert runs == ["o-9"]

        @inbox.idempotent(key=lambda n: f"raw:{n}", returns=None)
        async def raw(n: int) -> Line:
            return Line("pen", n)

        await raw(1)
        stored: object = await raw(1)
        assert stored == {"sku": "pen", "count": 1}  # returns=None: as stored

    async def test_r3_messages_are_keyed_by_their_source(self, inbox: AsyncInbox) -> None:
        handler = Calls()
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

    # ------------------------------------------------------------------ the manual claim (R10)

    async def test_r10_a_manual_claim_is_won_once_and_its_result_answers_every_copy(
        self, inbox: AsyncInbox
    ) -> None:
        first = await inbox.claim("order-1", {"amount": 5})
        assert first.won and first.attempt == 1 and not first.reclaimed
        meanwhile = await inbox.claim("order-1", {"amount": 5})
        assert not meanwhile.won and meanwhile.handled is not None
        assert meanwhile.handled.outcome is Outcome.IN_FLIGHT
        done = await first.complete({"charged": 5})
        assert done.outcome is Outcome.PROCESSED and first.handled is done
        with pytest.raises(ClaimEnded, match="processed"):
            await first.complete({"charged": 6})
        again = await inbox.claim("order-1", {"amount": 5})
        assert not again.won and again.handled is not None
        assert again.handled.outcome is Outcome.DUPLICATE
        assert again.handled.value == {"charged": 5}
        with pytest.raises(ClaimEnded, match="duplicate"):
            await again.release()
        other = await inbox.claim("order-1", {"amount": 6})
        assert other.handled is not None and other.handled.outcome is Outcome.KEY_CONFLICT
        refused = await inbox.claim("", {"amount": 5})
        assert refused.handled is not None and refused.handled.outcome is Outcome.REJECTED

    async def test_r10_a_released_claim_runs_again_and_a_rejected_one_never(
        self, inbox: AsyncInbox
    ) -> None:
        first = await inbox.claim("k", {"n": 1})
        released = await first.release("the upstream call timed out")
        assert released.outcome is Outcome.FAILED and "timed out" in (released.reason or "")
        second = await inbox.claim("k", {"n": 1})
        assert second.won  # given back: this caller runs it
        rejected = await second.reject("no such account")
        assert rejected.outcome is Outcome.REJECTED
        third = await inbox.claim("k", {"n": 1})
        assert third.handled is not None and third.handled.outcome is Outcome.REJECTED

    async def test_r10_a_manual_claim_as_a_block_gives_back_what_it_did_not_finish(
        self, inbox: AsyncInbox
    ) -> None:
        with pytest.raises(RuntimeError):
            async with await inbox.claim("a", {"n": 1}) as claimed:
                assert claimed.won
                raise RuntimeError("the work broke")
        assert claimed.handled is not None and claimed.handled.outcome is Outcome.FAILED
        async with await inbox.claim("a", {"n": 1}) as retried:
            assert retried.won
            await retried.complete("ok")
        assert retried.handled is not None and retried.handled.outcome is Outcome.PROCESSED
        async with await inbox.claim("b", {"n": 1}) as idle:
            pass  # ended without completing: released
        assert idle.handled is not None and idle.handled.outcome is Outcome.FAILED
        with pytest.raises(Reject):
            async with await inbox.claim("c", {"n": 1}):
                raise Reject("poison")
        poisoned = await inbox.claim("c", {"n": 1})
        assert poisoned.handled is not None and poisoned.handled.outcome is Outcome.REJECTED

    async def test_r10_a_manual_claim_whose_lease_lapsed_is_fenced_after_a_takeover(
        self, inbox: AsyncInbox, clock: FakeClock
    ) -> None:
        zombie = await inbox.claim("k", {"n": 1})
        assert zombie.won
        clock.advance(timedelta(milliseconds=LEASE_MS + 1))
        owner = await inbox.claim("k", {"n": 1})
        assert owner.won and owner.reclaimed and owner.attempt == 2
        with pytest.raises(LeaseLost):
            await zombie.renew()
        lost = await zombie.complete("zombie's")
        assert lost.outcome is Outcome.IN_FLIGHT  # the new owner's result wins
        await owner.renew()
        done = await owner.complete("owner's")
        assert done.outcome is Outcome.STALE_RECLAIMED
        after = await inbox.claim("k", {"n": 1})
        assert after.handled is not None and after.handled.value == "owner's"
