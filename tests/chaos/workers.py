"""The child-process side of the chaos tests (R7, R8, R10): real consumers in real processes.

Every function whose name ends in ``_worker`` is the target of a process started with the
multiprocessing "spawn" context: a fresh interpreter that imports oncely like a deployed
consumer would, and shares nothing with its siblings but SQLite files. Results travel back
through files, never pipes or queues: a worker may be SIGKILLed at any instruction, and a
``multiprocessing.Queue`` whose writer dies in the middle of a ``put`` can stay locked, while
one ``os.write`` to an ``O_APPEND`` file lands whole or not at all.

The effects the handlers apply go to an ``effects`` table with *no* unique constraint, on
purpose: a message applied twice leaves two rows, so "exactly once" is something the tests
count rather than something a constraint quietly enforces.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import signal
import sqlite3
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import aiosqlite

import oncely

CONSUMER = "chaos"

EFFECTS_DDL = "CREATE TABLE IF NOT EXISTS effects (key TEXT NOT NULL, worker TEXT NOT NULL)"
INSERT_EFFECT = "INSERT INTO effects (key, worker) VALUES (?, ?)"

# Every worker gives up after this long: a hang must end as a failure, never block CI.
WORKER_DEADLINE_S = 90.0


# --------------------------------------------------------------------------- shared helpers


def connect(path: str) -> sqlite3.Connection:
    """An autocommit connection that waits for SQLite's single-writer lock like oncely does."""
    return sqlite3.connect(path, isolation_level=None, timeout=30)


def create_effects(path: str) -> None:
    """The effects table in ``path`` (WAL, so readers never block the racing writers)."""
    conn = connect(path)
    try:
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute(EFFECTS_DDL)
    finally:
        conn.close()


def effect_counts(path: str) -> Counter[str]:
    """How many times each key's effect was applied."""
    conn = connect(path)
    try:
        return Counter(dict(conn.execute("SELECT key, count(*) FROM effects GROUP BY key")))
    finally:
        conn.close()


def write_json(path: str, data: object) -> None:
    """Write ``data`` so a reader sees the whole file or none of it."""
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def handled_dict(handled: oncely.Handled[Any]) -> dict[str, Any]:
    """The parts of a ``Handled`` a test asserts on, as JSON."""
    record = handled.record
    return {
        "outcome": str(handled.outcome),
        "reason": handled.reason,
        "attempt": handled.attempt,
        "value": handled.value,
        "record": None
        if record is None
        else {
            "status": str(record.status),
            "token": record.token,
            "attempt": record.attempt,
            "result": None if record.result is None else json.loads(record.result),
        },
    }


def route_logs(path: str) -> None:
    """Send oncely's warnings (stale reclaims, lost leases) to ``path``: left on stderr, four
    processes' lines would interleave with the test's own report."""
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(process)d %(levelname)s %(message)s"))
    logger = logging.getLogger("oncely")
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)


class Orphan:
    """Ends the process when the test process that started it is gone (no child outlives CI)."""

    def __init__(self, parent_pid: int) -> None:
        self._parent = parent_pid
        self._deadline = time.monotonic() + WORKER_DEADLINE_S

    def check(self) -> None:
        if os.getppid() != self._parent:
            os._exit(4)
        if time.monotonic() > self._deadline:
            raise TimeoutError(f"worker still running after {WORKER_DEADLINE_S}s")


# --------------------------------------------------------------------------- races (R8)


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


# --------------------------------------------------------------------------- the broker


class Broker:
    """A small at-least-once queue in its own SQLite file, shaped like a peek-lock broker.

    ``receive`` hides a message for ``visibility_s`` (the lock); a consumer that dies without
    acknowledging it gets it redelivered when the lock lapses. ``requeue`` makes it visible
    again after a delay (in_flight: "requeue later"; failed: retry). Each logical message is
    published ``copies`` times, as a producer that retried after a lost acknowledgement would.
    """

    DDL = """CREATE TABLE IF NOT EXISTS queue (
        id INTEGER PRIMARY KEY,
        key TEXT NOT NULL,
        acked INTEGER NOT NULL DEFAULT 0,
        visible_at REAL NOT NULL DEFAULT 0,
        deliveries INTEGER NOT NULL DEFAULT 0)"""

    def __init__(self, path: str, *, visibility_s: float) -> None:
        self._conn = connect(path)
        self._visibility = visibility_s

    @classmethod
    def create(cls, path: str, keys: list[str], *, copies: int) -> None:
        conn = connect(path)
        try:
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute(cls.DDL)
            conn.executemany(
                "INSERT INTO queue (key) VALUES (?)", [(k,) for k in keys for _ in range(copies)]
            )
        finally:
            conn.close()

    def receive(self) -> tuple[int, str] | None:
        """The next visible message, now locked for this consumer; None if none is visible."""
        conn = self._conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            now = time.time()
            row = conn.execute(
                "SELECT id, key FROM queue WHERE acked = 0 AND visible_at <= ? "
                "ORDER BY random() LIMIT 1",
                (now,),
            ).fetchone()
            if row is not None:
                conn.execute(
                    "UPDATE queue SET visible_at = ?, deliveries = deliveries + 1 WHERE id = ?",
                    (now + self._visibility, row[0]),
                )
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        return None if row is None else (row[0], row[1])

    def ack(self, message_id: int) -> None:
        self._conn.execute("UPDATE queue SET acked = 1 WHERE id = ?", (message_id,))

    def requeue(self, message_id: int, *, delay_s: float) -> None:
        self._conn.execute(
            "UPDATE queue SET visible_at = ? WHERE id = ?", (time.time() + delay_s, message_id)
        )

    def unfinished(self) -> int:
        return int(self._conn.execute("SELECT count(*) FROM queue WHERE acked = 0").fetchone()[0])

    def deliveries(self) -> int:
        return int(self._conn.execute("SELECT sum(deliveries) FROM queue").fetchone()[0] or 0)

    def close(self) -> None:
        self._conn.close()


# --------------------------------------------------------------------------- crashes (R7, R10)

# Where a worker may be told to SIGKILL itself, in the order a delivery reaches them.
CLAIMED = "claimed"  # the handler started: the key is claimed, no effect yet
EFFECT_WRITTEN = "effect_written"  # the effect is written, the marker not completed/committed
COMPLETED = "completed"  # the marker is completed/committed, the broker not acknowledged
KILL_POINTS = (CLAIMED, EFFECT_WRITTEN, COMPLETED)


@dataclass(frozen=True)
class CrashJob:
    """One incarnation of a consumer that drains the broker until every message is acked.

    ``mode`` is "transactional" (effect in the store's file, same transaction as the marker)
    or "two_phase" (effect in ``effects_db``, outside). ``on_stale`` is "retry" or
    "reconcile" (a reconciler that looks the effect up in ``effects_db``). With
    ``kill_point``, the worker SIGKILLs itself the ``kill_after``-th time it reaches it.
    """

    db: str
    broker: str
    effects_db: str
    mode: str
    on_stale: str
    lease_ms: int
    renew_ms: int
    visibility_s: float
    worker: str
    log: str
    parent_pid: int
    kill_point: str | None = None
    kill_after: int = 1


class Log:
    """Append-only event lines (``EVENT key detail``); each line is one ``os.write``, so a
    SIGKILL leaves whole lines only."""

    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, event: str, key: str, detail: str = "") -> None:
        line = f"{event} {key} {detail}".replace("\n", " | ").rstrip() + "\n"
        os.write(self._fd, line.encode())


class Tripwire:
    """SIGKILLs this process the ``after``-th time it reaches ``point`` (a crash on cue)."""

    def __init__(self, point: str | None, after: int, log: Log) -> None:
        self._point = point
        self._after = after
        self._seen = 0
        self._log = log

    def reached(self, point: str, key: str) -> None:
        if point != self._point:
            return
        self._seen += 1
        if self._seen == self._after:
            self._log.write("KILL", key, point)
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)  # pragma: no cover - SIGKILL cannot be caught; never reached


def crash_worker(job: CrashJob) -> None:
    """Consume the broker until it is drained; any surprise is logged and exits with 3."""
    log = Log(job.log)
    route_logs(f"{job.log}.oncely")
    try:
        _consume(job, log)
    except BaseException:
        log.write("ERROR", "-", traceback.format_exc())
        os._exit(3)


def _consume(job: CrashJob, log: Log) -> None:
    orphan = Orphan(job.parent_pid)
    trip = Tripwire(job.kill_point, job.kill_after, log)
    broker = Broker(job.broker, visibility_s=job.visibility_s)
    store = oncely.SQLiteStore(job.db)
    external = connect(job.effects_db)
    transactional = job.mode == "transactional"

    def book(conn: sqlite3.Connection, payload: dict[str, Any]) -> dict[str, str]:
        key = payload["key"]
        trip.reached(CLAIMED, key)
        conn.execute(INSERT_EFFECT, (key, job.worker))
        trip.reached(EFFECT_WRITTEN, key)
        return {"worker": job.worker}

    def charge(payload: dict[str, Any]) -> dict[str, str]:
        key = payload["key"]
        trip.reached(CLAIMED, key)
        external.execute(INSERT_EFFECT, (key, job.worker))  # autocommit: one atomic write
        trip.reached(EFFECT_WRITTEN, key)
        return {"worker": job.worker}

    def reconcile(stale: oncely.StaleClaim) -> oncely.Resolution:
        # Ask the external system whether the lapsed attempt's effect happened (R10).
        key = stale.record.key
        row = external.execute("SELECT worker FROM effects WHERE key = ?", (key,)).fetchone()
        log.write("RECONCILE", key, "retry" if row is None else "completed")
        if row is None:
            return oncely.Resolution.retry()
        return oncely.Resolution.completed({"worker": row[0]})

    inbox = oncely.Inbox(
        store,
        consumer=CONSUMER,
        lease=oncely.Lease(
            duration=timedelta(milliseconds=job.lease_ms),
            renew_every=timedelta(milliseconds=job.renew_ms),
        ),
        on_stale=reconcile if job.on_stale == "reconcile" else oncely.OnStale(job.on_stale),
    )
    log.write("START", "-", f"kill_point={job.kill_point} kill_after={job.kill_after}")
    while True:
        orphan.check()
        delivery = broker.receive()
        if delivery is None:
            if broker.unfinished() == 0:
                break
            time.sleep(0.02)
            continue
        message_id, key = delivery
        payload = {"key": key}
        if transactional:
            handled = inbox.handle_in_transaction(key, payload, book)
        else:
            handled = inbox.handle(key, payload, charge)
        outcome = handled.outcome
        log.write("OUT", key, f"{outcome} attempt={handled.attempt} {handled.reason or ''}")
        if outcome in (oncely.Outcome.PROCESSED, oncely.Outcome.STALE_RECLAIMED):
            trip.reached(COMPLETED, key)
        action = handled.action
        if action is oncely.Action.ACK:
            broker.ack(message_id)
        elif action is oncely.Action.REQUEUE_LATER:
            broker.requeue(message_id, delay_s=0.05)
        else:
            raise AssertionError(f"unexpected outcome {outcome} for {key}: {handled.reason}")
    log.write("DONE", "-")
    inbox.close()
    store.close()
    external.close()
    broker.close()


# --------------------------------------------------------------------------- zombie (R10)


def zombie_worker(
    db: str, key: str, lease_ms: int, claimed: Any, resume: Any, out: str, parent_pid: int
) -> None:
    """Claim ``key`` (two-phase, heartbeat off), signal ``claimed``, keep "working" until
    ``resume`` is set (the test freezes this process meanwhile), then try to complete."""
    route_logs(f"{out}.log")
    orphan = Orphan(parent_pid)
    store = oncely.SQLiteStore(db)
    inbox = oncely.Inbox(
        store,
        consumer=CONSUMER,
        lease=oncely.Lease(duration=timedelta(milliseconds=lease_ms), heartbeat=False),
    )

    def slow_charge(payload: dict[str, Any]) -> dict[str, str]:
        claimed.set()
        while not resume.is_set():
            orphan.check()
            time.sleep(0.01)
        return {"worker": "A"}

    handled = inbox.handle(key, {"key": key}, slow_charge)
    write_json(out, handled_dict(handled))
    inbox.close()
    store.close()


def takeover_worker(db: str, key: str, lease_ms: int, out: str, parent_pid: int) -> None:
    """Deliver ``key`` until it is no longer in flight (a broker redelivering it), then record
    the outcome; with on_stale="retry" a lapsed claim is taken over and the handler runs."""
    route_logs(f"{out}.log")
    orphan = Orphan(parent_pid)
    store = oncely.SQLiteStore(db)
    inbox = oncely.Inbox(
        store,
        consumer=CONSUMER,
        lease=oncely.Lease(duration=timedelta(milliseconds=lease_ms), heartbeat=False),
        on_stale="retry",
    )
    deliveries = 0
    while True:
        orphan.check()
        deliveries += 1
        handled = inbox.handle(key, {"key": key}, lambda payload: {"worker": "B"})
        if handled.outcome is not oncely.Outcome.IN_FLIGHT:
            break
        time.sleep(0.05)
    result = handled_dict(handled)
    result["deliveries"] = deliveries
    write_json(out, result)
    inbox.close()
    store.close()
