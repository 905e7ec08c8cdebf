"""The shared parts of ``bench/run.py``'s measurements: the workload (an order to book, fresh
keys, a trivial handler), resources closed at the end, checked outcomes, timed batches and the
interleaving of variants in chunks.

The sections live in ``twophase_case.py``, ``tx_case.py`` and ``core_case.py``, the SQL traces
in ``sql_trace.py``, the profiles in ``profiles.py`` and the servers section in ``servers.py``.
Every batch checks its outcomes, and the transactional section checks the ledger, balances and
markers at the end, so a broken path fails the run instead of reporting a fast number.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import oncely

TARGET_TX_RATIO = 1.3
TARGET_CORE_US = 20.0
ACCOUNTS = 100
AMOUNT_CENTS = 1250

# --------------------------------------------------------------------------- workload


def order(i: int) -> dict[str, Any]:
    """A realistic small message body (about 300 bytes of JSON): an order to book."""
    return {
        "order_id": f"ord-{i:08d}",
        "account": i % ACCOUNTS + 1,
        "amount_cents": AMOUNT_CENTS,
        "currency": "EUR",
        "customer": {"id": f"cus-{i % 977:05d}", "email": "a.user@example.com", "tier": "gold"},
        "items": [
            {"sku": "SKU-1001", "qty": 2, "price": "4.00"},
            {"sku": "SKU-2002", "qty": 1, "price": "4.50"},
        ],
        "created_at": "2026-01-01T12:00:00Z",
        "note": None,
    }


def trivial(_payload: object) -> None:
    return None


async def trivial_async(_payload: object) -> None:
    return None


class Keys:
    """Fresh dedup keys: every batch of new messages uses keys never seen before."""

    def __init__(self) -> None:
        self._next = 0
        self._run = os.urandom(3).hex()

    def batch(self, n: int) -> list[tuple[str, dict[str, Any]]]:
        start = self._next
        self._next += n
        return [(f"bench-{self._run}-{i:08d}", order(i)) for i in range(start, start + n)]


class Resources:
    """Closes what the sections opened, even when a measurement fails: an unclosed aiosqlite
    connection keeps a non-daemon thread alive, and the interpreter would never exit."""

    def __init__(self, runner: asyncio.Runner) -> None:
        self.runner = runner
        self._closers: list[Callable[[], object]] = []

    def add(self, close: Callable[[], object]) -> None:
        self._closers.append(close)

    def add_async(self, thing: Any) -> None:
        """Close ``thing`` (an async store, inbox or aiosqlite connection) at the end."""
        close = getattr(thing, "aclose", None) or thing.close
        self._closers.append(lambda: self.runner.run(close()))

    def close(self) -> None:
        while self._closers:
            with contextlib.suppress(Exception):
                self._closers.pop()()


class BenchError(RuntimeError):
    """A measured path did not do what it should (wrong outcome, missing rows)."""


def expect(handled: oncely.Handled[Any], outcome: oncely.Outcome) -> None:
    if handled.outcome is not outcome:
        raise BenchError(
            f"key {handled.key!r}: expected {outcome.value}, got {handled.outcome.value} "
            f"({handled.reason})"
        )


def timed(run: Callable[[], None]) -> float:
    """Seconds taken by ``run``; the collector runs before, not during, the batch."""
    gc.collect()
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def timed_async(runner: asyncio.Runner, make: Callable[[], Awaitable[None]]) -> float:
    gc.collect()

    async def go() -> float:
        started = time.perf_counter()
        await make()
        return time.perf_counter() - started

    return runner.run(go())


T = TypeVar("T")
CHUNK = 100
"""Messages per interleaving step: a round runs its variants A/B/C, A/B/C, ... in chunks this
size, so a burst of load from elsewhere hits every variant of the round nearly alike."""


def chunks(n: int, size: int = CHUNK) -> list[int]:
    """``n`` messages as chunk sizes of at most ``size``."""
    return [min(size, n - start) for start in range(0, n, size)]


def rotated(items: Sequence[T], by: int) -> list[T]:
    """``items`` rotated left by ``by``, so no variant always runs first after a switch."""
    k = by % len(items)
    return [*items[k:], *items[:k]]


def us_per(seconds: float, n: int) -> float:
    return seconds / n * 1e6


def med(values: Sequence[float]) -> float:
    return statistics.median(values)
