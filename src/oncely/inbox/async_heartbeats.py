"""Hand-written: the asyncio half of the few places where sync and async truly differ.

Its twin is ``sync_heartbeats.py``; both expose the same names (``sleep``,
``AsyncHeartbeats``/``Heartbeats``), so the generated code reads the same on both sides.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

__all__ = ["AsyncHeartbeats", "AsyncTicket", "sleep"]


async def sleep(seconds: float) -> None:
    await asyncio.sleep(seconds)


class AsyncTicket:
    """One claim's heartbeat: calls ``renew`` every ``every`` seconds until stopped."""

    __slots__ = ("_every", "_handle", "_loop", "_renew", "_stopped", "_task")

    def __init__(
        self, loop: asyncio.AbstractEventLoop, renew: Callable[[], Awaitable[None]], every: float
    ) -> None:
        self._loop = loop
        self._renew = renew
        self._every = every
        self._stopped = False
        self._task: asyncio.Task[None] | None = None
        self._handle: asyncio.TimerHandle | None = loop.call_later(every, self._fire)

    def _fire(self) -> None:
        self._handle = None
        if not self._stopped:
            self._task = self._loop.create_task(self._beat())

    async def _beat(self) -> None:
        await self._renew()
        if not self._stopped:
            self._handle = self._loop.call_later(self._every, self._fire)

    async def stop(self) -> None:
        """Stop renewing; wait for a renewal already under way so none lands afterwards."""
        self._stopped = True
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        task = self._task
        if task is not None and not task.done():
            with contextlib.suppress(Exception):
                await asyncio.shield(task)


class AsyncHeartbeats:
    """Starts heartbeats on the running event loop (a timer per claim, no task until due)."""

    __slots__ = ()

    def start(self, renew: Callable[[], Awaitable[None]], every: float) -> AsyncTicket:
        return AsyncTicket(asyncio.get_running_loop(), renew, every)

    def close(self) -> None:
        """Nothing to stop: timers die with their tickets."""
