"""The racers of the chaos race tests (R8): processes that handle the same keys at once.

Each racer handles every key in its own shuffled order, through the sync or the async API, in
transactional mode (R7) or two-phase mode (R10), and writes what it saw to a JSON file.
"""

from __future__ import annotations

import asyncio
import random
import sqlite3
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import aiosqlite

import oncely
from tests.chaos.workers import CONSUMER, INSERT_EFFECT, Orphan, connect, route_logs, write_json


@dataclass(frozen=True)
class RaceJob:
    """One racer: handle every one of ``keys`` keys, in an order shuffled by ``seed``.

    ``effects_db`` None: transactional mode, the effect is written in the store's own file
    inside the marker's transaction (R7). Otherwise two-phase mode (R10), the effect goes to
    that separate file, an external system the marker's transaction cannot include.
    """

    db: str
    effects_db: str | None
    keys: int
    seed: int
    worker: str
    api: str  # "sync" or "async"
    out: str
    parent_pid: int
    # Between deliveries a consumer receives and acknowledges messages. Without that pause
    # SQLite's busy handler (it polls with growing sleeps) lets the process that just
    # committed take the write lock again and again: one racer then does every key while
    # the others wait on their first one, and the race proves nothing.
    pause_s: float = 0.001


def race_key(i: int) -> str:
    return f"order-{i:05d}"


@dataclass
class RaceTally:
    """What one racer saw; written to ``RaceJob.out`` as JSON."""

    worker: str
    api: str
    deliveries: Counter[str] = field(default_factory=Counter)  # every handle() call's outcome
    processed: list[str] = field(default_factory=list)
    duplicate_of: dict[str, str] = field(default_factory=dict)  # key -> worker in stored result
    unexpected: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    redelivery_rounds: int = 0
    started: float = 0.0
    ended: float = 0.0

    def to_json(self) -> dict[str, Any]:
        # Not dataclasses.asdict: it rebuilds a Counter from (key, value) pairs, counting them.
        data = dict(vars(self))
        data["deliveries"] = dict(self.deliveries)
        return data

    def settle(self, key: str, handled: oncely.Handled[Any]) -> bool:
        """Count one delivery; True when the key is settled for this racer (acknowledged)."""
        outcome = handled.outcome
        self.deliveries[str(outcome)] += 1
        if outcome is oncely.Outcome.PROCESSED:
            self.processed.append(key)
            return True
        if outcome is oncely.Outcome.DUPLICATE:
            value = handled.value
            self.duplicate_of[key] = value.get("worker", "?") if isinstance(value, dict) else "?"
            return True
        if outcome is oncely.Outcome.IN_FLIGHT:
            return False  # the broker requeues it: redeliver later
        self.unexpected.append(f"{key}: {outcome} ({handled.reason})")
        return True


def race_worker(job: RaceJob, start_line: Any) -> None:
    """Race the other workers over the same keys, started together behind ``start_line``."""
    route_logs(f"{job.out}.log")
    if job.api == "async":
        asyncio.run(_race_async(job, start_line))
    else:
        _race_sync(job, start_line)


def _race_sync(job: RaceJob, start_line: Any) -> None:
    orphan = Orphan(job.parent_pid)
    tally = RaceTally(job.worker, job.api)
    order = list(range(job.keys))
    random.Random(job.seed).shuffle(order)
    store = oncely.SQLiteStore(job.db)
    inbox = oncely.Inbox(store, consumer=CONSUMER)
    ext = connect(job.effects_db) if job.effects_db is not None else None

    def book(conn: sqlite3.Connection, payload: dict[str, Any]) -> dict[str, str]:
        conn.execute(INSERT_EFFECT, (payload["key"], job.worker))
        return {"worker": job.worker}

    def charge(payload: dict[str, Any]) -> dict[str, str]:
        assert ext is not None
        ext.execute(INSERT_EFFECT, (payload["key"], job.worker))
        return {"worker": job.worker}

    def deliver(i: int) -> bool:
        key = race_key(i)
        payload = {"key": key, "amount": i}
        try:
            if ext is None:
                handled = inbox.handle_in_transaction(key, payload, book)
            else:
                handled = inbox.handle(key, payload, charge)
        except Exception as exc:
            tally.errors.append(f"{key}: {exc!r}")
            return True
        time.sleep(job.pause_s)
        return tally.settle(key, handled)

    try:
        inbox.get("warm-up")  # open a connection now, so the race starts at the first claim
        start_line.wait(timeout=60)
        tally.started = time.time()
        later = [i for i in order if not deliver(i)]
        while later:  # the broker redelivers what was in flight, a little later
            orphan.check()
            tally.redelivery_rounds += 1
            time.sleep(0.005)
            later = [i for i in later if not deliver(i)]
        tally.ended = time.time()
    finally:
        inbox.close()
        store.close()
        if ext is not None:
            ext.close()
        write_json(job.out, tally.to_json())


async def _race_async(job: RaceJob, start_line: Any) -> None:
    orphan = Orphan(job.parent_pid)
    tally = RaceTally(job.worker, job.api)
    order = list(range(job.keys))
    random.Random(job.seed).shuffle(order)
    store = oncely.AsyncSQLiteStore(job.db)
    inbox = oncely.AsyncInbox(store, consumer=CONSUMER)
    ext = (
        await aiosqlite.connect(job.effects_db, isolation_level=None, timeout=30)
        if job.effects_db is not None
        else None
    )

    async def book(conn: aiosqlite.Connection, payload: dict[str, Any]) -> dict[str, str]:
        cursor = await conn.execute(INSERT_EFFECT, (payload["key"], job.worker))
        await cursor.close()
        return {"worker": job.worker}

    async def charge(payload: dict[str, Any]) -> dict[str, str]:
        assert ext is not None
        cursor = await ext.execute(INSERT_EFFECT, (payload["key"], job.worker))
        await cursor.close()
        return {"worker": job.worker}

    async def deliver(i: int) -> bool:
        key = race_key(i)
        payload = {"key": key, "amount": i}
        try:
            if ext is None:
                handled = await inbox.handle_in_transaction(key, payload, book)
            else:
                handled = await inbox.handle(key, payload, charge)
        except Exception as exc:
            tally.errors.append(f"{key}: {exc!r}")
            return True
        await asyncio.sleep(job.pause_s)
        return tally.settle(key, handled)

    try:
        await inbox.get("warm-up")
        start_line.wait(timeout=60)  # blocking on purpose: nothing else runs before the start
        tally.started = time.time()
        later = [i for i in order if not await deliver(i)]
        while later:
            orphan.check()
            tally.redelivery_rounds += 1
            await asyncio.sleep(0.005)
            later = [i for i in later if not await deliver(i)]
        tally.ended = time.time()
    finally:
        await inbox.aclose()
        await store.aclose()
        if ext is not None:
            await ext.close()
        write_json(job.out, tally.to_json())
