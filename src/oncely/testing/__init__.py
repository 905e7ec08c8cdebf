"""What users need to test their own consumers: a fake clock, an in-memory store, and a helper
that delivers every message twice. The store contract suite is in
:mod:`oncely.testing.contract` (it needs pytest).
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

__all__ = [
    "AsyncMemoryStore",
    "FakeClock",
    "MemoryStore",
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
