"""Clocks. Stores read lease and retention times from a clock; the core never reads one itself.

Time is an integer count of milliseconds since the Unix epoch everywhere inside oncely: it is
what every store can hold exactly, and it is cheap to compare on the hot path.
"""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime, timedelta
from typing import Protocol, runtime_checkable

__all__ = ["Clock", "FakeClock", "SystemClock", "ms_to_datetime", "to_ms"]


@runtime_checkable
class Clock(Protocol):
    """Anything that tells the time in epoch milliseconds."""

    def now_ms(self) -> int:
        """Milliseconds since the Unix epoch."""
        ...


class SystemClock:
    """The host's wall clock. Shared stores prefer their own server's clock to this one."""

    __slots__ = ()

    def now_ms(self) -> int:
        return time.time_ns() // 1_000_000

    def __repr__(self) -> str:
        return "SystemClock()"


class FakeClock:
    """A clock that moves only when told to. Thread-safe; for tests.

    >>> clock = FakeClock()
    >>> clock.advance(timedelta(seconds=30))
    """

    __slots__ = ("_lock", "_now")

    def __init__(self, start: datetime | int | None = None) -> None:
        if start is None:
            start = datetime(2026, 1, 1, tzinfo=UTC)
        self._now = start if isinstance(start, int) else int(start.timestamp() * 1000)
        self._lock = threading.Lock()

    def now_ms(self) -> int:
        return self._now

    def advance(self, by: timedelta) -> None:
        """Move the clock forward by ``by`` (never backwards)."""
        step = to_ms(by)
        if step < 0:
            raise ValueError("a FakeClock only moves forward")
        with self._lock:
            self._now += step

    def set(self, when: datetime | int) -> None:
        """Jump to ``when``."""
        with self._lock:
            self._now = when if isinstance(when, int) else int(when.timestamp() * 1000)

    def __repr__(self) -> str:
        return f"FakeClock({ms_to_datetime(self._now).isoformat()})"


def to_ms(delta: timedelta) -> int:
    """A ``timedelta`` as whole milliseconds (rounded down)."""
    return (delta.days * 86_400_000) + (delta.seconds * 1000) + (delta.microseconds // 1000)


def ms_to_datetime(ms: int) -> datetime:
    """Epoch milliseconds as an aware UTC ``datetime``."""
    return datetime.fromtimestamp(ms / 1000, tz=UTC)
