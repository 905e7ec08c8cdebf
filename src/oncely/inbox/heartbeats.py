"""Heartbeats: what keeps a claim's lease alive while its handler runs (R10).

One concept, two runtimes, so two implementations side by side (neither is generated from the
other): :class:`AsyncHeartbeats` puts a timer per claim on the running event loop (a task
only when a renewal is due); :class:`Heartbeats` shares one daemon thread per inbox instead of
a thread per claim, since starting a thread costs more than a whole SQLite transaction. The
generated sync inbox uses the second where the async source names the first.

A forked child (a prefork server's worker, made after the inbox) starts with thread heartbeats
of its own, in a fork hook: the parent's thread does not exist there, its lock may have been
held at the moment of the fork, and its tickets renew the parent's claims.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable

from oncely._core.forking import forget_parent_in_children

__all__ = ["AsyncHeartbeats", "AsyncTicket", "Heartbeats", "Ticket"]

_IDLE_EXIT_S = 2.0
_LOGGER = logging.getLogger("oncely")


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

    def abandon(self) -> None:
        """Renew no more, from anywhere (a claim collected without an ending): the timer
        already set fires once and does nothing."""
        self._stopped = True

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


# ---------------------------------------------------------------- one thread per inbox


class Ticket:
    """One claim's heartbeat, renewed by the shared thread until stopped."""

    __slots__ = ("_every", "_owner", "_renew", "_running", "due", "stopped")

    def __init__(self, owner: Heartbeats, renew: Callable[[], None], every: float) -> None:
        self._owner = owner
        self._renew = renew
        self._every = every
        self.due = time.monotonic() + every
        self.stopped = False
        self._running = threading.Lock()

    def beat(self) -> None:
        try:
            with self._running:
                if not self.stopped:
                    self._renew()
        finally:
            self.due = time.monotonic() + self._every

    def abandon(self) -> None:
        """Renew no more, from anywhere (a claim collected without an ending): no lock is
        taken; the thread drops the ticket at its next pass."""
        self.stopped = True

    def stop(self) -> None:
        """Stop renewing; wait for a renewal already under way so none lands afterwards."""
        self.stopped = True
        self._owner.discard(self)
        with self._running:
            pass

    def _forget_parent(self) -> None:
        # In a forked child: the claim is the parent's to renew, and the parent's thread may
        # have held this lock, mid-renewal, at the fork.
        self.stopped = True
        self._running = threading.Lock()


class Heartbeats:
    """One daemon thread renews every registered claim when it falls due; it exits when idle
    and starts again with the next claim."""

    __slots__ = ("__weakref__", "_cond", "_thread", "_tickets", "_wake_at")

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._tickets: dict[int, Ticket] = {}
        self._thread: threading.Thread | None = None
        self._wake_at = 0.0  # monotonic time the thread plans to wake (under the lock)
        forget_parent_in_children(self)

    def _forget_parent(self) -> None:
        # In a forked child: without this the child would wait forever for a lock the
        # parent's thread held at the fork, or never start a thread (the parent's looks
        # alive), and its leases would lapse while its handlers run.
        for ticket in self._tickets.values():
            ticket._forget_parent()
        self._cond = threading.Condition(threading.Lock())
        self._tickets = {}
        self._thread = None
        self._wake_at = 0.0

    def start(self, renew: Callable[[], None], every: float) -> Ticket:
        ticket = Ticket(self, renew, every)
        with self._cond:
            self._tickets[id(ticket)] = ticket
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="oncely-heartbeat", daemon=True
                )
                self._thread.start()
            elif ticket.due < self._wake_at:
                # Only when the thread sleeps past this ticket's first renewal: waking it for
                # every claim would cost more than the claim.
                self._cond.notify()
        return ticket

    def discard(self, ticket: Ticket) -> None:
        with self._cond:
            self._tickets.pop(id(ticket), None)

    def close(self) -> None:
        with self._cond:
            self._tickets.clear()
            self._cond.notify()

    def _run(self) -> None:
        idle_since: float | None = None
        while True:
            with self._cond:
                now = time.monotonic()
                if not self._tickets:
                    idle_since = idle_since if idle_since is not None else now
                    if now - idle_since >= _IDLE_EXIT_S:
                        self._thread = None
                        return
                    self._wake_at = now + _IDLE_EXIT_S
                    self._cond.wait(_IDLE_EXIT_S)
                    continue
                idle_since = None
                for gone in [k for k, t in self._tickets.items() if t.stopped]:
                    del self._tickets[gone]  # abandoned: nothing left to renew
                if not self._tickets:
                    continue
                due = [t for t in self._tickets.values() if t.due <= now]
                if not due:
                    wait = min(t.due for t in self._tickets.values()) - now
                    self._wake_at = now + wait
                    self._cond.wait(wait)
                    continue
                self._wake_at = now  # renewing: a new ticket is seen on the next pass
            for ticket in due:
                try:
                    ticket.beat()
                except Exception:  # a renewal must never kill the shared thread
                    _LOGGER.exception("oncely heartbeat failed; the lease may lapse")
