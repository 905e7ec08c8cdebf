"""A handler of the wrong kind for its inbox. A sync ``Inbox`` cannot run an ``async def``:
before, it got a coroutine back, recorded the key as done and the message was acknowledged,
the body never run. Now that is refused before the claim (or, for an awaitable that comes
back from a plain function, with the claim released and nothing recorded). An ``AsyncInbox``
given a plain function runs it once and keeps its value, where before each delivery ran its
effects and then failed on ``await`` (R1, R2)."""

from __future__ import annotations

import asyncio
import functools
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import oncely
from oncely import AsyncHandlerRefused


@pytest.fixture
def inbox(tmp_path: Path) -> Iterator[oncely.Inbox]:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "coroutine ... was never awaited"
        store = oncely.open(f"sqlite:///{tmp_path / 'inbox.db'}")
        yield oncely.Inbox(store, consumer="billing")
        store.close()


ran: list[object] = []


async def charge(payload: object) -> str:
    ran.append(payload)
    return "charged"


class Charger:
    async def __call__(self, payload: object) -> str:
        ran.append(payload)
        return "charged"


@pytest.mark.parametrize(
    "handler",
    [charge, functools.partial(charge), Charger()],
    ids=["async-def", "partial", "async-call"],
)
def test_a_sync_inbox_refuses_an_async_handler_before_claiming(
    inbox: oncely.Inbox, handler: Any
) -> None:
    with pytest.raises(AsyncHandlerRefused, match=r"oncely\.AsyncInbox"):
        inbox.handle("o-1", {"amount": 1}, handler)
    with pytest.raises(AsyncHandlerRefused):
        inbox.handle_batch([("o-2", {"amount": 1})], handler)
    with pytest.raises(AsyncHandlerRefused):
        inbox.handle_in_transaction("o-3", {"amount": 1}, handler)
    assert [inbox.get(k) for k in ("o-1", "o-2", "o-3")] == [None, None, None]
    assert inbox.handle("o-1", {"amount": 1}, lambda p: "done").outcome is oncely.Outcome.PROCESSED
    assert ran == []


def test_an_awaitable_returned_to_a_sync_inbox_is_refused_and_nothing_recorded(
    inbox: oncely.Inbox,
) -> None:
    with pytest.raises(AsyncHandlerRefused, match="returned an awaitable"):
        inbox.handle("o-1", {"amount": 1}, lambda p: charge(p))  # noqa: PLW0108 - a wrapper
    with pytest.raises(AsyncHandlerRefused):
        inbox.handle_in_transaction("o-2", {"amount": 1}, lambda tx, p: charge(p))
    assert ran == []
    # The claim was given back, not completed: the key runs when a plain function comes.
    for key in ("o-1", "o-2"):
        again = inbox.handle(key, {"amount": 1}, lambda p: "done")
        assert again.outcome is oncely.Outcome.PROCESSED and again.value == "done"


def test_a_sync_inbox_refuses_to_decorate_an_async_function(inbox: oncely.Inbox) -> None:
    with pytest.raises(AsyncHandlerRefused):

        @inbox.idempotent(key=lambda order: order)
        async def book(order: str) -> str:
            return order


async def test_an_async_inbox_runs_a_plain_function_once_and_keeps_its_value(
    tmp_path: Path,
) -> None:
    store = oncely.open_async(f"sqlite:///{tmp_path / 'inbox.db'}")
    inbox = oncely.AsyncInbox(store, consumer="billing")
    effects: list[object] = []

    def book(payload: object) -> dict[str, int]:
        effects.append(payload)
        return {"booked": len(effects)}

    def book_in(tx: Any, payload: object) -> dict[str, int]:
        effects.append(payload)
        return {"booked": len(effects)}

    try:
        first = await inbox.handle("o-1", {"n": 1}, book)  # type: ignore[arg-type]
        again = await inbox.handle("o-1", {"n": 1}, book)  # type: ignore[arg-type]
        assert (first.outcome, again.outcome) == (
            oncely.Outcome.PROCESSED,
            oncely.Outcome.DUPLICATE,
        )
        assert first.value == again.value == {"booked": 1}
        done = await inbox.handle_in_transaction("o-2", {"n": 2}, book_in)  # type: ignore[arg-type]
        assert done.outcome is oncely.Outcome.PROCESSED and done.value == {"booked": 2}
        batch = await inbox.handle_batch([("o-3", {"n": 3}), ("o-1", {"n": 1})], book)  # type: ignore[arg-type]
        assert [h.outcome for h in batch] == [oncely.Outcome.PROCESSED, oncely.Outcome.DUPLICATE]
        assert effects == [{"n": 1}, {"n": 2}, {"n": 3}]
        with pytest.raises(TypeError, match="async def"):

            @inbox.idempotent(key=lambda order: order)
            def plain(order: str) -> str:
                return order

    finally:
        await inbox.aclose()
        await store.aclose()


def test_the_asyncio_inbox_still_awaits_coroutines() -> None:
    async def main() -> object:
        inbox = oncely.AsyncInbox(oncely.open_async("memory://"), consumer="c")
        return (await inbox.handle("k", {}, charge)).value

    assert asyncio.run(main()) == "charged"


# ------------------------------------------------------------------ generators


def charges(payload: object) -> Iterator[str]:
    ran.append(payload)
    yield "charged"


async def charges_async(payload: object) -> Any:
    ran.append(payload)
    yield "charged"


def test_a_generator_function_is_refused_before_claiming_by_either_inbox(
    inbox: oncely.Inbox,
) -> None:
    """Calling a generator function runs none of its body: before, the key was recorded as
    done (the generator not stored, a warning) and the message acknowledged, the effect
    never applied (R1)."""
    ran.clear()
    with pytest.raises(oncely.HandlerRefused, match="generator function"):
        inbox.handle("o-1", {"amount": 1}, charges)
    with pytest.raises(oncely.HandlerRefused):
        inbox.handle_in_transaction("o-2", {"amount": 1}, lambda tx, p: charges(p))
    with pytest.raises(oncely.HandlerRefused, match="returned a generator"):
        inbox.handle("o-3", {"amount": 1}, lambda p: charges(p))  # noqa: PLW0108 - a wrapper
    with pytest.raises(oncely.HandlerRefused):
        inbox.idempotent(key=lambda order: order)(charges)
    assert [inbox.get(k) for k in ("o-1", "o-2", "o-3")] == [None, None, None]
    assert inbox.handle("o-3", {"amount": 1}, lambda p: "done").outcome is oncely.Outcome.PROCESSED

    async def run_async() -> None:
        store = oncely.open_async("memory://")
        async_inbox = oncely.AsyncInbox(store, consumer="billing")
        for handler in (charges, charges_async):
            with pytest.raises(oncely.HandlerRefused):
                await async_inbox.handle("a-1", {"amount": 1}, handler)
        with pytest.raises(oncely.HandlerRefused, match="returned a generator"):
            await async_inbox.handle("a-1", {"amount": 1}, lambda p: charges(p))  # noqa: PLW0108
        assert await async_inbox.get("a-1") is None
        await store.aclose()

    asyncio.run(run_async())
    assert ran == []


def test_complete_refuses_a_coroutine_or_a_generator_and_keeps_the_claim(
    inbox: oncely.Inbox,
) -> None:
    """A coroutine given to ``complete()`` (not awaited) stands for work that never ran:
    before, the key was recorded as done; now the call is refused and the claim is still
    held, to complete with the value or release."""
    claimed = inbox.claim("o-1", {"amount": 1})
    assert isinstance(claimed, oncely.Claimed)
    pending = charge({"amount": 1})
    with pytest.raises(oncely.HandlerRefused, match="coroutine"):
        claimed.complete(pending)  # type: ignore[arg-type]
    pending.close()
    with pytest.raises(oncely.HandlerRefused, match="generator"):
        claimed.complete(charges({"amount": 1}))  # type: ignore[arg-type]
    assert inbox.get("o-1") is not None and inbox.get("o-1").status.value == "in_progress"  # type: ignore[union-attr]
    assert claimed.complete("charged").outcome is oncely.Outcome.PROCESSED
    assert inbox.handle("o-1", {"amount": 1}, lambda p: "again").value == "charged"


# ------------------------------------------------------------- a store of the other kind


@pytest.mark.parametrize("url", ["memory://", "sqlite:///{dir}/inbox.db"])
def test_an_inbox_refuses_a_store_of_the_other_kind_when_made(tmp_path: Path, url: str) -> None:
    # Before, each was made: the sync inbox got coroutines back from the asyncio store's calls
    # (an AttributeError on the first message, "coroutine never awaited"), and the asyncio
    # inbox awaited a sync store's records (a TypeError inside the consumer loop).
    url = url.format(dir=tmp_path)
    sync_store, async_store = oncely.open(url), oncely.open_async(url)
    sync_name, async_name = type(sync_store).__name__, type(async_store).__name__
    try:
        with pytest.raises(oncely.ConfigurationError, match=rf"use {async_name} \("):
            oncely.AsyncInbox(sync_store, consumer="billing")  # type: ignore[arg-type]
        with pytest.raises(oncely.ConfigurationError, match=rf"use {sync_name} \("):
            oncely.Inbox(async_store, consumer="billing")  # type: ignore[arg-type]
        oncely.Inbox(sync_store, consumer="billing")
        oncely.AsyncInbox(async_store, consumer="billing")
    finally:
        sync_store.close()
        asyncio.run(async_store.aclose())


def test_a_broker_consumer_refuses_a_sync_inbox() -> None:
    # Before: "a Processor runs its own handler", as if a sync Inbox were a Processor.
    from oncely.brokers import BrokerConsumer
    from oncely.testing import MemoryBroker, MemoryStore

    inbox = oncely.Inbox(MemoryStore(), consumer="billing")
    with pytest.raises(oncely.ConfigurationError, match="give it an AsyncInbox"):
        BrokerConsumer(MemoryBroker(), inbox, lambda body: None)  # type: ignore[arg-type]
