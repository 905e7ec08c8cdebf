"""The purge service: expired records deleted every so often by one process per table.

Expired records already count as absent everywhere, so purging is housekeeping: it keeps the
table the size of what is retained. :class:`AsyncPurgeService` (and the generated
:class:`~oncely.stores.sync_purging.PurgeService`) runs ``purge_expired`` every ``every``, but
only while it holds the store's purge lead (:meth:`purge_leader`: a PostgreSQL advisory lock,
a MariaDB ``GET_LOCK``, a lock file beside a SQLite database), so a fleet of consumers that all
run it purges each table once at a time. Each run is reported to ``on_run`` and logged on the
``oncely`` logger: rows deleted, rows per second, and whether this process led.

``oncely inbox purge --every 1m`` runs one from the command line; ``BrokerConsumer`` and
``oncely consume`` run one beside the consumer with ``purge_every``.
"""

from __future__ import annotations

from oncely._twin import ASYNC

if ASYNC:
    from asyncio import Event, wait_for
else:
    from threading import Event

import contextlib
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import timedelta
from time import perf_counter
from typing import Any

from oncely.errors import ConfigurationError, StoreError
from oncely.stores._purging import (
    LOGGER,
    PURGE_BATCH,
    PURGE_PAUSE,
    PurgeRun,
    _Stopped,
    check_pause,
    purge_options,
)

__all__ = ["AsyncPurgeService", "PurgeRun"]  # noqa: RUF022, RUF100 - its sync twin sorts otherwise


class AsyncPurgeService:
    """Purges ``store`` every ``every`` while this process leads its purge.

    ``batch_size`` rows per batch (each a short transaction of its own), resting ``pause``
    times each batch's time after it (see ``purge_expired``); ``on_run`` receives each
    :class:`PurgeRun`; ``on_batch(taken, deleted)`` each batch (a progress display).
    """

    def __init__(
        self,
        store: Any,
        *,
        every: timedelta,
        batch_size: int = PURGE_BATCH,
        pause: float = PURGE_PAUSE,
        on_run: Callable[[PurgeRun], None] | None = None,
        on_batch: Callable[[int, int], None] | None = None,
    ) -> None:
        if every <= timedelta(0):
            raise ConfigurationError("a purge service needs a positive interval (every)")
        if not 1 <= batch_size <= 10_000:
            raise ConfigurationError("batch_size must be between 1 and 10000")
        self.store = store
        self.every = every
        check_pause(pause)
        self.batch_size = batch_size
        self.pause = pause
        self.on_run = on_run
        self.on_batch = on_batch
        self._stop = Event()
        self._batches = 0
        self._deleted = 0

    def stop(self) -> None:
        """End :meth:`run` after the current batch (from another task or thread)."""
        self._stop.set()

    @asynccontextmanager
    async def _lead(self) -> AsyncIterator[bool]:
        leader = getattr(self.store, "purge_leader", None)
        if leader is None:  # a store without a lock of its own: one process is assumed
            yield True
            return
        async with leader() as held:
            yield held

    def _batch(self, taken: int, deleted: int) -> None:
        self._batches += 1
        self._deleted += deleted
        if self.on_batch is not None:
            self.on_batch(taken, deleted)
        if self._stop.is_set():
            raise _Stopped

    async def run_once(self) -> PurgeRun:
        """One run: purge everything expired if this process leads, else nothing."""
        started = perf_counter()
        self._batches = 0
        self._deleted = 0
        deleted = 0
        async with self._lead() as leader:
            if leader:
                options = purge_options(
                    self.store, batch_size=self.batch_size, on_batch=self._batch, pause=self.pause
                )
                try:
                    deleted = await self.store.purge_expired(**options)
                except _Stopped:  # stopped between batches: what they deleted is reported
                    deleted = self._deleted
        run = PurgeRun(leader, deleted, self._batches, perf_counter() - started)
        if leader:
            LOGGER.info(
                "oncely purge store=%s deleted=%d batches=%d seconds=%.3f rows_per_s=%.0f",
                self.store.url, run.deleted, run.batches, run.seconds, run.rows_per_s,
            )  # fmt: skip
        else:
            LOGGER.debug(
                "oncely purge store=%s skipped: another process leads its purge", self.store.url
            )
        if self.on_run is not None:
            try:
                self.on_run(run)
            except Exception:  # a report's bug is not the purge's: it goes on
                LOGGER.exception("oncely purge store=%s: its on_run raised", self.store.url)
        return run

    async def run(self, *, first_after: timedelta | None = None) -> None:
        """Run every ``every`` until :meth:`stop`, the first run at once (or after
        ``first_after``). A store failure is logged and the next run tries again (any other
        error too, with its traceback): the purge is never the reason a consumer stops, and
        never stops without a word beside one."""
        if first_after is not None:
            await self._pause(first_after)
        while not self._stop.is_set():
            try:
                await self.run_once()
            except StoreError as exc:
                LOGGER.warning(
                    "oncely purge store=%s failed, trying again in %s: %s",
                    self.store.url, self.every, exc,
                )  # fmt: skip
            except Exception:
                LOGGER.exception(
                    "oncely purge store=%s failed unexpectedly, trying again in %s",
                    self.store.url, self.every,
                )  # fmt: skip
            await self._pause(self.every)

    async def _pause(self, pause: timedelta) -> None:
        if ASYNC:
            with contextlib.suppress(TimeoutError):
                await wait_for(self._stop.wait(), pause.total_seconds())
        else:
            self._stop.wait(pause.total_seconds())
