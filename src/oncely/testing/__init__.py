"""What users need to test their own consumers: a fake clock, an in-memory store, a helper
that delivers every message twice, and two at-least-once brokers that need no server:
:class:`MemoryBroker` (a :class:`~oncely.brokers.Transport` in one process, for a
``BrokerConsumer``'s tests in milliseconds) and :class:`FileBroker` (a peek-lock queue in a
SQLite file that a fleet of worker processes shares, SIGKILLs included, with lost
acknowledgements and twin deliveries injected on demand; oncely's demo and crash tests run on
it). The store contract suite is in :mod:`oncely.testing.contract` (it needs pytest).
"""

from __future__ import annotations

from typing import TypeVar

from oncely._core.clock import FakeClock
from oncely._core.outcomes import Handled
from oncely.inbox.async_inbox import AsyncInbox
from oncely.inbox.async_types import AsyncHandler
from oncely.inbox.sync_inbox import Inbox
from oncely.inbox.sync_types import Handler
from oncely.stores.memory.async_store import AsyncMemoryStore
from oncely.stores.memory.sync_store import MemoryStore
from oncely.testing.broker import DeadMessage, MemoryBroker
from oncely.testing.file_broker import FileBroker, Leased, Published

__all__ = [
    "AsyncMemoryStore",
    "DeadMessage",
    "FakeClock",
    "FileBroker",
    "Leased",
    "MemoryBroker",
    "MemoryStore",
    "Published",
    "deliver_twice",
    "deliver_twice_async",
]

P = TypeVar("P")
R = TypeVar("R")


def deliver_twice(
    inbox: Inbox, key: str, payload: P, handler: Handler[P, R]
) -> tuple[Handled[R], Handled[R]]:
    """Deliver one message twice, as an at-least-once broker may; return both outcomes.

    A consumer that is effectively once gives ``processed`` then ``duplicate``, and the
    handler's effect exists once. Assert exactly that in your tests.
    """
    return inbox.handle(key, payload, handler), inbox.handle(key, payload, handler)


async def deliver_twice_async(
    inbox: AsyncInbox, key: str, payload: P, handler: AsyncHandler[P, R]
) -> tuple[Handled[R], Handled[R]]:
    """:func:`deliver_twice` for an :class:`~oncely.AsyncInbox`."""
    return await inbox.handle(key, payload, handler), await inbox.handle(key, payload, handler)
