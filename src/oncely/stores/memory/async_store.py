"""The in-memory reference store: the state machine behind a lock. Thread- and asyncio-safe.

For tests and single-process tools. Records live as long as the process; nothing is shared
between processes. It has no transactional mode (there is no database to share a transaction
with): use the two-phase mode, or a SQL store.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Self

from oncely._core.clock import Clock, SystemClock
from oncely._core.records import Claim, ClaimRequest, Completion, Record, Status, StoreStats
from oncely._core.state import (
    CompleteEvent,
    FailEvent,
    ReleaseEvent,
    RenewEvent,
    TakeoverEvent,
    claim_event,
)
from oncely._core.table import RecordTable
from oncely._urls import redact, split
from oncely.errors import ConfigurationError, LeaseLost
from oncely.stores.async_protocols import complete_each

__all__ = ["AsyncMemoryStore"]


class AsyncMemoryStore:
    """Records in a dict, changed only through :mod:`oncely._core.state`.

    ``clock`` defaults to the system clock; pass a :class:`~oncely.testing.FakeClock` to move
    leases and retention by hand in tests.
    """

    __slots__ = ("_clock", "_lock", "_table")

    def __init__(self, *, clock: Clock | None = None) -> None:
        self._clock: Clock = clock if clock is not None else SystemClock()
        self._lock = threading.Lock()
        self._table = RecordTable()

    @classmethod
    def from_url(cls, url: str, *, clock: Clock | None = None) -> Self:
        """A store for ``memory://`` (no options)."""
        if split(url).netloc or split(url).path.strip("/") or split(url).query:
            raise ConfigurationError(f"{redact(url)}: memory:// takes no host, path or options")
        return cls(clock=clock)

    @property
    def url(self) -> str:
        return "memory://"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self._table.records)} records)"

    async def claim(
        self,
        consumer: str,
        key: str,
        *,
        fingerprint: str | None,
        token: str,
        lease_ms: int,
        keep_ms: int,
        takeover: bool,
    ) -> Claim:
        event = claim_event(consumer, key, fingerprint, token, lease_ms, keep_ms, takeover)
        with self._lock:
            return self._table.claim(event, self._clock.now_ms())

    async def claim_many(
        self,
        consumer: str,
        requests: Sequence[ClaimRequest],
        *,
        lease_ms: int,
        keep_ms: int,
        takeover: bool,
    ) -> list[Claim]:
        events = [
            claim_event(consumer, r.key, r.fingerprint, r.token, lease_ms, keep_ms, takeover)
            for r in requests
        ]
        with self._lock:
            return self._table.claim_many(events, self._clock.now_ms())

    async def takeover(
        self,
        consumer: str,
        key: str,
        *,
        expected_token: str,
        fingerprint: str | None,
        token: str,
        lease_ms: int,
        keep_ms: int,
    ) -> Claim:
        claim = claim_event(consumer, key, fingerprint, token, lease_ms, keep_ms, True)
        with self._lock:
            return self._table.takeover(TakeoverEvent(claim, expected_token), self._clock.now_ms())

    async def complete(
        self,
        consumer: str,
        key: str,
        *,
        token: str,
        result: bytes | None,
        keep_ms: int,
        note: str | None = None,
    ) -> Record:
        event = CompleteEvent(token, result, keep_ms, note)
        with self._lock:
            return self._table.complete(consumer, key, event, self._clock.now_ms())

    async def complete_many(
        self, consumer: str, completions: Sequence[Completion], *, keep_ms: int
    ) -> list[Record | LeaseLost]:
        """One completion after the other (each is a dictionary update)."""
        return await complete_each(self, consumer, completions, keep_ms=keep_ms)

    async def fail(
        self, consumer: str, key: str, *, token: str, error: str, keep_ms: int
    ) -> Record:
        with self._lock:
            return self._table.fail(
                consumer, key, FailEvent(token, error, keep_ms), self._clock.now_ms()
            )

    async def renew(
        self, consumer: str, key: str, *, token: str, lease_ms: int, keep_ms: int
    ) -> Record:
        with self._lock:
            return self._table.renew(
                consumer, key, RenewEvent(token, lease_ms, keep_ms), self._clock.now_ms()
            )

    async def release(self, consumer: str, key: str, *, token: str) -> bool:
        with self._lock:
            return self._table.release(consumer, key, ReleaseEvent(token), self._clock.now_ms())

    async def get(self, consumer: str, key: str) -> Record | None:
        with self._lock:
            return self._table.get(consumer, key, self._clock.now_ms())

    async def purge_expired(self, *, batch_size: int = 1000, max_batches: int | None = None) -> int:
        limit = None if max_batches is None else batch_size * max_batches
        with self._lock:
            return self._table.purge_expired(self._clock.now_ms(), limit)

    async def stats(self, *, exact: bool = True) -> StoreStats:
        # Counting is cheap here: always exact (``exact`` is True in the answer).
        with self._lock:
            return self._table.stats(self._clock.now_ms())

    async def scan(
        self,
        *,
        consumer: str | None = None,
        status: Status | None = None,
        after: tuple[str, str] | None = None,
        limit: int = 100,
    ) -> list[Record]:
        with self._lock:
            return self._table.scan(self._clock.now_ms(), consumer, status, after, limit)

    async def forget(self, consumer: str, key: str) -> bool:
        with self._lock:
            return self._table.forget(consumer, key)

    async def forget_by_token(self, consumer: str, key: str, *, token: str) -> bool:
        with self._lock:
            return self._table.forget_by_token(
                consumer, key, ReleaseEvent(token), self._clock.now_ms()
            )

    async def migrate(self) -> int:
        return 1

    async def prepare(self) -> None:
        """Nothing to connect to or check."""

    async def aclose(self) -> None:
        """Nothing to release; records stay readable."""
