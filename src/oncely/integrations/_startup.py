"""A worker's check of its inboxes' stores before it takes a message (Celery, Dramatiq,
taskiq, FastStream).

Without it a worker whose store is down, or whose tables were never made, starts, looks
healthy, and hands every message back to the broker (each time a delivery closer to the
dead-letter queue) until someone reads its log. With it the worker process stops at start
with one line naming the store, and the exit code ``oncely consume`` uses for the same
cause: 3 for a store that cannot be reached, 4 for a schema this oncely cannot use.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from typing import Final, NoReturn, TypeVar

from oncely.errors import SchemaError, StoreError, StoreUnavailable
from oncely.inbox.async_inbox import AsyncInbox
from oncely.inbox.sync_inbox import Inbox

__all__ = [
    "EXIT_SCHEMA",
    "EXIT_STORE_UNAVAILABLE",
    "EXIT_USAGE",
    "check_stores",
    "check_stores_async",
    "stopping",
]

LOGGER = logging.getLogger("oncely.worker")
_I = TypeVar("_I", Inbox, AsyncInbox)

EXIT_USAGE: Final = 2
EXIT_STORE_UNAVAILABLE: Final = 3
EXIT_SCHEMA: Final = 4


def check_stores(inboxes: Iterable[Inbox], framework: str) -> None:
    """Connect each distinct store of ``inboxes`` and check its schema; on a store that
    cannot be reached or a schema that cannot be used, log why and exit the process."""
    for inbox in _distinct(inboxes):
        try:
            inbox.prepare()
        except (StoreUnavailable, SchemaError) as exc:
            _stop(framework, inbox.consumer, exc)


async def check_stores_async(inboxes: Iterable[AsyncInbox], framework: str) -> None:
    """:func:`check_stores` for asyncio inboxes."""
    for inbox in _distinct(inboxes):
        try:
            await inbox.prepare()
        except (StoreUnavailable, SchemaError) as exc:
            _stop(framework, inbox.consumer, exc)


def _distinct(inboxes: Iterable[_I]) -> list[_I]:
    """One inbox per store (several inboxes often share one store)."""
    seen: set[int] = set()
    found = []
    for inbox in inboxes:
        if id(inbox.store) not in seen:
            seen.add(id(inbox.store))
            found.append(inbox)
    return found


def _stop(framework: str, consumer: str, exc: StoreError) -> NoReturn:
    raise SystemExit(stopping(framework, consumer, exc)) from exc


def stopping(framework: str, consumer: str, exc: StoreError) -> int:
    """Log the one line that says why the worker stops (the store of ``consumer`` failed
    with ``exc``), and return the exit code for it."""
    code = EXIT_SCHEMA if isinstance(exc, SchemaError) else EXIT_STORE_UNAVAILABLE
    what = "its tables cannot be used" if code == EXIT_SCHEMA else "it cannot be reached"
    LOGGER.error(
        "oncely %s: the worker stops before taking a message: the store of consumer %r: %s "
        "(%s) [exit %d]",
        framework,
        consumer,
        what,
        re.sub(r"\s*\n\s*", " ", str(exc)).strip(),
        code,
    )
    return code
