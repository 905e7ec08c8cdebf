"""The crash side of the chaos tests (R7, R10): consumers that die at chosen points.

oncely's cross-process test broker (:class:`oncely.testing.FileBroker`) hands out the messages;
each consumer drains it, SIGKILLs itself on cue (after the claim, after the effect, after the
completion) and logs every event as one whole line, so the test reads back what happened after
any kill."""

from __future__ import annotations

import os
import signal
import sqlite3
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import oncely
from oncely.testing import FileBroker, Published
from tests.chaos.workers import CONSUMER, INSERT_EFFECT, Orphan, connect, route_logs

# --------------------------------------------------------------------------- the broker


def open_broker(path: str, *, visibility_s: float) -> FileBroker:
    """The fleet's queue: oncely's own test broker in ``path``, handing out any visible copy
    (random order mixes the copies of one key between workers)."""
    return FileBroker(path, visibility_timeout=timedelta(seconds=visibility_s), order="random")


def fill_broker(path: str, keys: list[str], *, copies: int) -> None:
    """Publish each key ``copies`` times, as a producer that retried after a lost ack would."""
    broker = FileBroker(path)
    try:
        broker.create()
        broker.publish(Published(k, b"") for k in keys for _ in range(copies))
    finally:
        broker.close()


# --------------------------------------------------------------------------- crashes (R7, R10)

# Where a worker may be told to SIGKILL itself, in the order a delivery reaches them.
CLAIMED = "claimed"  # the handler started: the key is claimed, no effect yet
EFFECT_WRITTEN = "effect_written"  # the effect is written, the marker not completed/committed
COMPLETED = "completed"  # the marker is completed/committed, the broker not acknowledged
KILL_POINTS = (CLAIMED, EFFECT_WRITTEN, COMPLETED)
REQUEUE_DELAY = timedelta(milliseconds=50)  # in_flight: "requeue later"; failed: retry


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
    broker = open_broker(job.broker, visibility_s=job.visibility_s)
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
    while (delivery := broker.next(job.worker, check=orphan.check)) is not None:
        key = delivery.message_id
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
            broker.settle(delivery, "ack", outcome=outcome.value)
        elif action is oncely.Action.REQUEUE_LATER:
            broker.settle(delivery, "requeue", outcome=outcome.value, delay=REQUEUE_DELAY)
        else:
            raise AssertionError(f"unexpected outcome {outcome} for {key}: {handled.reason}")
    log.write("DONE", "-")
    inbox.close()
    store.close()
    external.close()
    broker.close()
