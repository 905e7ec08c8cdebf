"""Contract, the inbox's transactional mode (R7): marker and business writes commit together or
not at all, in oncely's transaction or the caller's, with or without a savepoint; stores without
transactions refuse the mode."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import pytest

from oncely._core.outcomes import Outcome
from oncely._core.policy import Limits
from oncely._core.records import Status
from oncely.errors import Reject, TransactionRequired, TransactionsUnsupported
from oncely.inbox.async_inbox import AsyncInbox
from oncely.stores.async_protocols import AsyncKeepsOffsets, AsyncStore, AsyncTransactionalStore
from oncely.testing.contract.async_base import AsyncBusiness, ContractBase
from oncely.testing.contract.async_two_phase import Charged

__all__ = ["TransactionalContract"]


class TransactionalContract(ContractBase):
    """The inbox's transactional mode on the store."""

    async def test_r7_memory_like_stores_refuse_the_transactional_mode(
        self, store: AsyncStore, inbox: AsyncInbox
    ) -> None:
        if isinstance(store, AsyncTransactionalStore):
            pytest.skip("the store has a transactional mode")

        async def book(tx: object, payload: object) -> None:
            raise AssertionError("must not run")

        with pytest.raises(TransactionsUnsupported):
            await inbox.handle_in_transaction("k", {"a": 1}, book)

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

    async def test_r1_r7_a_duplicate_returns_the_first_result_as_the_handlers_type(
        self, store: AsyncStore, inbox: AsyncInbox, business: AsyncBusiness | None
    ) -> None:
        ledger = self._transactional(store, business)

        async def book(tx: Any, payload: dict[str, int]) -> Charged:
            await ledger.write(tx, "order-1", payload["amount"])
            return Charged(Decimal("30.00"), datetime(2026, 1, 2, tzinfo=UTC))

        first = await inbox.handle_in_transaction("order-1", {"amount": 30}, book)
        second = await inbox.handle_in_transaction("order-1", {"amount": 30}, book)
        assert second.outcome is Outcome.DUPLICATE and await ledger.count("order-1") == 1
        assert type(second.value) is Charged and second.value == first.value
        stored = await inbox.handle_in_transaction("order-1", {"amount": 30}, book, returns=None)
        assert isinstance(stored.value, dict)

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

    async def test_r7_offsets_kept_in_the_transaction_commit_with_it_and_only_move_forward(
        self, store: AsyncStore, inbox: AsyncInbox, business: AsyncBusiness | None
    ) -> None:
        """A stream's offsets (a Kafka consumer's ``store_offsets``) are written in the
        handler's transaction: rolled back with it, kept per consumer, stream and partition,
        never moved back by a lower one."""
        ledger = self._transactional(store, business)
        assert isinstance(store, AsyncTransactionalStore)
        if not isinstance(store, AsyncKeepsOffsets):
            pytest.skip("the store keeps no offsets")
        assert await store.offsets("billing", "orders") == {}

        async def book(tx: Any, payload: dict[str, int]) -> None:
            await store.save_offset_in(tx, "billing", "orders", payload["part"], payload["next"])
            await ledger.write(tx, f"p{payload['part']}-{payload['next']}", 1)
            if payload.get("fail"):
                raise RuntimeError("after the writes, before the commit")

        for key, payload in (
            ("a", {"part": 0, "next": 5}),
            ("b", {"part": 1, "next": 3}),
            ("c", {"part": 0, "next": 2}),  # lower: kept at 5
            ("d", {"part": 1, "next": 9, "fail": 1}),  # rolled back
        ):
            await inbox.handle_in_transaction(key, payload, book)
        assert await store.offsets("billing", "orders") == {0: 5, 1: 3}
        assert await store.offsets("billing", "payments") == {}
        assert await store.offsets("shipping", "orders") == {}
        assert await ledger.count("p1-9") == 0
