"""A store for oncely that oncely does not ship: what a separate package would publish.

``shelf:///path/to/file`` keeps every record in one pickled file, rewritten (atomically) after
each change, behind a lock: not a store for production, but one whose records live where
oncely knows nothing about them. It uses only what oncely offers store authors
(``oncely.stores``, ``oncely.stores.rules``) and registers through its distribution's entry
point (``oncely_shelf-0.1.dist-info/entry_points.txt``, group ``oncely.stores``), so
``oncely.open("shelf:///...")`` finds it with no change to oncely. ``tests/backends/shelf.py``
runs the whole contract suite on it, sync and async, through ``oncely.open``.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from oncely import Clock, ConfigurationError, SystemClock
from oncely.stores import Backend, Claim, ClaimRequest, Record, Status, StoreStats, redact
from oncely.stores.rules import (
    CompleteEvent,
    FailEvent,
    RecordTable,
    ReleaseEvent,
    RenewEvent,
    TakeoverEvent,
    claim_event,
)

T = TypeVar("T")

backend = Backend(
    name="shelf",
    sync="oncely_shelf:ShelfStore",
    async_="oncely_shelf:AsyncShelfStore",
)


def _path(url: str) -> Path:
    if not url.startswith("shelf:///") or "?" in url:
        raise ConfigurationError(f"{redact(url)}: write shelf:///absolute/path (no options)")
    return Path(url.removeprefix("shelf://"))


class ShelfStore:
    """Records in one file; each operation loads the table, runs the rules and saves it."""

    def __init__(self, path: Path, *, clock: Clock | None = None) -> None:
        self._path = path
        self._clock = clock if clock is not None else SystemClock()
        self._lock = threading.Lock()

    @classmethod
    def from_url(cls, url: str, *, clock: Clock | None = None) -> ShelfStore:
        return cls(_path(url), clock=clock)

    @property
    def url(self) -> str:
        return f"shelf://{self._path}"

    def _load(self) -> RecordTable:
        try:
            with self._path.open("rb") as file:
                table: RecordTable = pickle.load(file)  # our own file
        except FileNotFoundError:
            table = RecordTable()
        return table

    def _save(self, table: RecordTable) -> None:
        spare = self._path.with_suffix(".tmp")
        with spare.open("wb") as file:
            pickle.dump(table, file)
        os.replace(spare, self._path)

    def _run(self, op: Callable[[RecordTable, int], T], *, writes: bool = True) -> T:
        with self._lock:
            table = self._load()
            answer = op(table, self._clock.now_ms())  # LeaseLost: nothing changed, nothing saved
            if writes:
                self._save(table)
            return answer

    def claim(
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
        return self._run(lambda table, now: table.claim(event, now))

    def claim_many(
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
        return self._run(lambda table, now: table.claim_many(events, now))

    def takeover(
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
        return self._run(
            lambda table, now: table.takeover(TakeoverEvent(claim, expected_token), now)
        )

    def complete(
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
        return self._run(lambda table, now: table.complete(consumer, key, event, now))

    def fail(self, consumer: str, key: str, *, token: str, error: str, keep_ms: int) -> Record:
        event = FailEvent(token, error, keep_ms)
        return self._run(lambda table, now: table.fail(consumer, key, event, now))

    def renew(self, consumer: str, key: str, *, token: str, lease_ms: int, keep_ms: int) -> Record:
        event = RenewEvent(token, lease_ms, keep_ms)
        return self._run(lambda table, now: table.renew(consumer, key, event, now))

    def release(self, consumer: str, key: str, *, token: str) -> bool:
        event = ReleaseEvent(token)
        return self._run(lambda table, now: table.release(consumer, key, event, now))

    def get(self, consumer: str, key: str) -> Record | None:
        return self._run(lambda table, now: table.get(consumer, key, now), writes=False)

    def purge_expired(self, *, batch_size: int = 1000, max_batches: int | None = None) -> int:
        limit = None if max_batches is None else batch_size * max_batches
        return self._run(lambda table, now: table.purge_expired(now, limit))

    def stats(self) -> StoreStats:
        return self._run(lambda table, now: table.stats(now), writes=False)

    def scan(
        self,
        *,
        consumer: str | None = None,
        status: Status | None = None,
        after: tuple[str, str] | None = None,
        limit: int = 100,
    ) -> list[Record]:
        return self._run(
            lambda table, now: table.scan(now, consumer, status, after, limit), writes=False
        )

    def forget(self, consumer: str, key: str) -> bool:
        return self._run(lambda table, _now: table.forget(consumer, key))

    def migrate(self) -> int:
        return 1

    def close(self) -> None:
        """Nothing held open between operations."""


class AsyncShelfStore:
    """The asyncio face of :class:`ShelfStore`: each operation in a worker thread."""

    def __init__(self, path: Path, *, clock: Clock | None = None) -> None:
        self._store = ShelfStore(path, clock=clock)

    @classmethod
    def from_url(cls, url: str, *, clock: Clock | None = None) -> AsyncShelfStore:
        return cls(_path(url), clock=clock)

    @property
    def url(self) -> str:
        return self._store.url

    def __getattr__(self, name: str) -> Any:
        operation = getattr(self._store, name)

        async def in_thread(*args: Any, **kwargs: Any) -> Any:
            return await asyncio.to_thread(operation, *args, **kwargs)

        return in_thread

    async def aclose(self) -> None:
        self._store.close()
