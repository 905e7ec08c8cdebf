"""A step run a short wait after it is first asked for, so that what is asked meanwhile goes
with it (a batch's groups that end close together complete in one round trip)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

GATHER_WAIT = 0.05
"""Seconds a step waits after it is asked for, gathering what else ends meanwhile."""


class Gather:
    """Runs ``step`` a short wait after :meth:`soon`, one step at a time; once a step failed,
    no other starts and :meth:`settle` raises its error."""

    def __init__(self, step: Callable[[], Awaitable[None]], wait: float = GATHER_WAIT) -> None:
        self._step = step
        self._wait = wait
        self._due = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stepping = False
        self._closing = False

    def soon(self) -> None:
        """Ask for a step (one already asked for and not started yet covers this ask too)."""
        self._due.set()
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def _loop(self) -> None:
        while not self._closing:
            await self._due.wait()
            await asyncio.sleep(self._wait)
            self._due.clear()
            self._stepping = True
            try:
                await self._step()
            finally:
                self._stepping = False

    async def settle(self) -> None:
        """Stop: a step under way is waited for (never cut short), one only asked for is
        dropped (the caller does what is left itself). Raises a step's error."""
        self._closing = True
        task, self._task = self._task, None
        if task is None:
            return
        if not task.done() and not self._stepping:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return
        await task

    async def close(self) -> None:
        """:meth:`settle`, its error not raised (the batch is failing or cancelled anyway)."""
        with contextlib.suppress(Exception):
            await self.settle()
