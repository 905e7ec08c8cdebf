"""The zombie test's two workers (R10): one frozen while it holds a claim, one that takes
the lapsed claim over."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import oncely
from tests.chaos.workers import CONSUMER, Orphan, handled_dict, route_logs, write_json


def zombie_worker(
    db: str, key: str, lease_ms: int, claimed: Any, resume: Any, out: str, parent_pid: int
) -> None:
    """Claim ``key`` (two-phase, heartbeat off), signal ``claimed``, keep "working" until
    ``resume`` is set (the test freezes this process meanwhile), then try to complete."""
    route_logs(f"{out}.log")
    orphan = Orphan(parent_pid)
    store, inbox = _open(db, lease_ms)

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
    store, inbox = _open(db, lease_ms, on_stale="retry")
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


def _open(db: str, lease_ms: int, **options: Any) -> tuple[oncely.SQLiteStore, oncely.Inbox]:
    """The worker's store and inbox: a lease of ``lease_ms`` with no heartbeat, so a frozen
    worker's claim lapses on time."""
    store = oncely.SQLiteStore(db)
    lease = oncely.Lease(duration=timedelta(milliseconds=lease_ms), heartbeat=False)
    return store, oncely.Inbox(store, consumer=CONSUMER, lease=lease, **options)
