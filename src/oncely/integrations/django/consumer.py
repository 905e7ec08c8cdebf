"""A broker consumer whose handler is a plain Django function: each message's claim, the
handler's ORM writes and the result commit in one ``transaction.atomic()`` on Django's own
connection (:func:`~oncely.integrations.django.handle_message_in_atomic`), in worker threads
so the broker loop never waits on the database. ``python manage.py oncely consume`` runs it.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

from django.db import close_old_connections

from oncely._core.handlers import called_misfit
from oncely._core.keys import Envelope, KeySource
from oncely._core.outcomes import Handled
from oncely.errors import ConfigurationError
from oncely.inbox.sync_inbox import Inbox
from oncely.integrations.django.atomic import handle_message_in_atomic

__all__ = ["AtomicProcessor"]


def atomic_misfit(handler: object, caller: str) -> str | None:
    """Why ``caller`` cannot run ``handler`` as ``handler(payload)`` in its
    ``transaction.atomic()``, as the end of a sentence naming it (``takes (tx, payload),
    but ...``); None when it can, or when that cannot be told for sure. The transaction is
    Django's own connection's: the handler takes no ``tx`` (its ORM writes join it)."""
    return called_misfit(handler, "(payload)", caller, define="def")


class AtomicProcessor:
    """A :class:`oncely.brokers.Processor` running ``handler(payload)`` through a sync
    ``inbox`` in Django's transaction (``using``: the database alias), ``threads`` messages at
    once. A store or database failure raises, so the broker gives the message back.

    The consumer's redelivery horizon is checked against ``inbox``'s retention at start, as
    with an :class:`~oncely.AsyncInbox`.

    Django's connections are per thread: each worker thread has its own, checked (and
    replaced when broken or older than ``CONN_MAX_AGE``) before and after each message, as
    Django does around a request."""

    def __init__(
        self,
        inbox: Inbox,
        handler: Callable[[Any], object],
        *,
        key: KeySource | None = None,
        using: str | None = None,
        threads: int = 1,
    ) -> None:
        if not isinstance(inbox, Inbox):
            raise TypeError(f"AtomicProcessor takes an oncely.Inbox, not {type(inbox).__name__}")
        if threads < 1:
            raise ValueError("threads must be at least 1")
        wrong = atomic_misfit(handler, "AtomicProcessor")
        if wrong is not None:
            # Else every message would fail with the TypeError and be dead-lettered.
            name = getattr(handler, "__qualname__", None) or repr(handler)
            raise ConfigurationError(f"the handler {name} {wrong}")
        self.inbox = inbox
        self._handler = handler
        self._key = key
        self._using = using
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="oncely-django")

    @property
    def consumer(self) -> str:
        return self.inbox.consumer

    @property
    def log_keys(self) -> Literal["plain", "hash"]:
        """How the inbox shows keys in its log lines; the consumer's lines follow it."""
        return self.inbox.log_keys

    async def prepare(self) -> None:
        """Check the store on a worker thread, with that thread's Django connection, before
        the first message (the consumer calls it at start)."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._pool, self._prepare)

    def _prepare(self) -> None:
        close_old_connections()
        try:
            self.inbox.prepare()
        finally:
            close_old_connections()

    async def process(self, envelope: Envelope) -> Handled[Any]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(self._one, envelope))

    def _one(self, envelope: Envelope) -> Handled[Any]:
        close_old_connections()
        try:
            return handle_message_in_atomic(
                self.inbox, envelope, self._handler, key=self._key, using=self._using
            )
        finally:
            close_old_connections()

    def refuse(
        self, reason: str, *, key: str | None = None, correlation_id: str | None = None
    ) -> Handled[Any]:
        return self.inbox.refuse(reason, key=key, correlation_id=correlation_id)

    def close(self) -> None:
        """Wait for the running messages and stop the threads."""
        self._pool.shutdown(wait=True)
