"""SIGKILL (R7): consumers killed at every point of the transactional mode apply every
effect exactly once.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from collections import Counter, deque
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

import oncely
from oncely import Outcome, Status
from oncely.errors import (
    StoreUnavailable,
)
from oncely.stores.mysql.sync_store import MySQLStore
from tests.backends.mysql import sql, url
from tests.chaos.crash_workers import REQUEUE_DELAY, Log, Tripwire, fill_broker, open_broker
from tests.chaos.harness import Processes
from tests.chaos.workers import Orphan

CRASH_KEYS = 150
CLAIMED, EFFECT_WRITTEN, COMPLETED = "claimed", "effect_written", "completed"
# The n-th time an incarnation reaches a point it SIGKILLs itself; restarts take the rest.
CRASH_PLANS = [
    (CLAIMED, 2), (EFFECT_WRITTEN, 3), (COMPLETED, 2), (EFFECT_WRITTEN, 1), (CLAIMED, 5),
    (COMPLETED, 4), (COMPLETED, 1), (CLAIMED, 1), (EFFECT_WRITTEN, 6),
]  # fmt: skip
PARENT_KILLS = 8


@dataclass(frozen=True)
class CrashJob:
    """One incarnation of a transactional consumer draining the broker."""

    store_url: str
    ledger: str
    broker: str
    worker: str
    log: str
    parent_pid: int
    kill_point: str | None = None
    kill_after: int = 1
    visibility_s: float = 0.5


def crash_worker(job: CrashJob) -> None:
    """Consume until the broker is drained; any surprise is logged and exits with 3."""
    log = Log(job.log)
    try:
        _consume(job, log)
    except BaseException as exc:
        log.write("ERROR", "-", repr(exc))
        os._exit(3)


def _consume(job: CrashJob, log: Log) -> None:
    orphan = Orphan(job.parent_pid)
    trip = Tripwire(job.kill_point, job.kill_after, log)
    broker = open_broker(job.broker, visibility_s=job.visibility_s)
    store = MySQLStore.from_url(job.store_url)
    inbox = oncely.Inbox(store, consumer="chaos")

    def book(tx: Any, payload: dict[str, str]) -> dict[str, str]:
        key = payload["key"]
        trip.reached(CLAIMED, key)
        with tx.cursor() as cursor:
            cursor.execute(
                f"INSERT INTO `{job.ledger}` (k, worker) VALUES (%s, %s)", (key, job.worker)
            )
        trip.reached(EFFECT_WRITTEN, key)
        return {"worker": job.worker}

    log.write("START", "-", f"kill_point={job.kill_point} kill_after={job.kill_after}")
    while (delivery := broker.next(job.worker, check=orphan.check)) is not None:
        key = delivery.message_id
        try:
            handled = inbox.handle_in_transaction(key, {"key": key}, book)
        except StoreUnavailable as exc:  # a lock wait or a deadlock: nothing was recorded
            log.write("UNAVAILABLE", key, str(exc))
            broker.settle(delivery, "requeue", outcome="store_unavailable", delay=REQUEUE_DELAY)
            continue
        log.write("OUT", key, f"{handled.outcome} {handled.reason or ''}")
        if handled.outcome is Outcome.PROCESSED:
            trip.reached(COMPLETED, key)
        if handled.action is oncely.Action.ACK:
            broker.settle(delivery, "ack", outcome=handled.outcome.value)
        elif handled.action in (oncely.Action.REQUEUE_LATER, oncely.Action.RETRY):
            broker.settle(delivery, "requeue", outcome=handled.outcome.value, delay=REQUEUE_DELAY)
        else:
            raise AssertionError(f"unexpected outcome {handled.outcome} for {key}")
    log.write("DONE", "-")
    store.close()
    broker.close()


def _lines(path: str) -> list[str]:
    log = Path(path)
    return log.read_text().splitlines() if log.exists() else []


def _drain_with_kills(
    procs: Processes, template: CrashJob, logs: Path, seed: int, slots: int = 3
) -> dict[str, Any]:
    """Run ``slots`` consumers until the broker is drained, SIGKILLing them (by plan, and from
    here at random moments) and restarting the dead; the kills that fired, by point."""
    rng = random.Random(seed)
    broker = open_broker(template.broker, visibility_s=template.visibility_s)
    plans = deque(CRASH_PLANS)
    live: dict[int, tuple[Any, CrashJob]] = {}
    report: dict[str, Any] = {"self": [], "parent": 0, "incarnations": 0}
    started = time.monotonic()
    kills_left, next_kill = PARENT_KILLS, time.monotonic() + rng.uniform(0.1, 0.3)

    def launch(slot: int) -> None:
        point, nth = plans.popleft() if plans else (None, 1)
        name = f"w{slot}.{report['incarnations']}"
        job = replace(
            template, worker=name, log=str(logs / f"{name}.log"), kill_point=point, kill_after=nth
        )
        live[slot] = (procs.start(crash_worker, job, name=name), job)
        report["incarnations"] += 1

    try:
        for slot in range(slots):
            launch(slot)
        while live:
            assert time.monotonic() - started < 90, f"not drained: {broker.open_copies()} left"
            for slot, (process, job) in list(live.items()):
                if process.exitcode is None:
                    continue
                del live[slot]
                lines = _lines(job.log)
                assert process.exitcode in (0, -signal.SIGKILL), "\n".join(lines)
                fired = [line.split(" ", 2)[1:] for line in lines if line.startswith("KILL ")]
                if fired:
                    report["self"].append((fired[0][1], fired[0][0], job.worker))
                elif job.kill_point is not None:
                    plans.appendleft((job.kill_point, job.kill_after))
                if broker.open_copies() > 0:
                    launch(slot)
            now = time.monotonic()
            if kills_left and now >= next_kill:
                alive = [p for p, j in live.values() if p.exitcode is None and _lines(j.log)]
                if alive:
                    rng.choice(alive).kill()
                    report["parent"] += 1
                    kills_left -= 1
                next_kill = now + rng.uniform(0.05, 0.3)
            time.sleep(0.01)
        assert broker.open_copies() == 0
        report["deliveries"] = broker.deliveries()
    finally:
        broker.close()
        procs.reap()
    report["seconds"] = time.monotonic() - started
    return report


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_r7_sigkill_at_any_point_applies_every_effect_exactly_once(
    table: str, tmp_path: Path
) -> None:
    """Transactional mode: consumers SIGKILLed after the claim, after the effect is written
    (before the commit) and after the commit (before the acknowledgement), plus at random
    moments. A kill before the commit loses marker and effect together (InnoDB rolls the dead
    session's transaction back); after it, the redelivery finds the marker. The ledger has no
    unique key, so an effect applied twice would show as two rows."""
    ledger = f"{table}_ledger"
    sql(f"CREATE TABLE `{ledger}` (k VARCHAR(64) NOT NULL, worker VARCHAR(64)) ENGINE=InnoDB")
    store_url = url(table)
    MySQLStore.from_url(store_url).migrate()
    keys = [f"order-{i:04d}" for i in range(CRASH_KEYS)]
    fill_broker(str(tmp_path / "broker.db"), keys, copies=2)
    (tmp_path / "logs").mkdir()
    seed = int(os.environ.get("ONCELY_CHAOS_SEED", random.randrange(2**32)))
    template = CrashJob(
        store_url=store_url, ledger=ledger, broker=str(tmp_path / "broker.db"), worker="",
        log="", parent_pid=os.getpid(),
    )  # fmt: skip
    report = _drain_with_kills(Processes(), template, tmp_path / "logs", seed)
    summary = (
        f"seed={seed} deliveries={report['deliveries']} parent kills={report['parent']} "
        f"self kills={Counter(point for point, _, _ in report['self'])} "
        f"incarnations={report['incarnations']} in {report['seconds']:.1f}s"
    )
    print(f"\n[R7 MariaDB SIGKILL] {summary}")
    applied: dict[str, list[str]] = {}
    for key, worker in sql(f"SELECT k, worker FROM `{ledger}`"):
        applied.setdefault(key, []).append(worker)
    assert sorted(applied) == keys, f"effects lost: {sorted(set(keys) - set(applied))}; {summary}"
    doubled = {k: w for k, w in applied.items() if len(w) > 1}
    assert not doubled, f"effects applied twice: {doubled}; {summary}"
    checker = MySQLStore.from_url(store_url)
    try:
        held = {r.key: r for r in checker.scan(consumer="chaos", limit=CRASH_KEYS + 10)}
    finally:
        checker.close()
    assert sorted(held) == keys and all(r.status is Status.COMPLETED for r in held.values())
    points = {point for point, _, _ in report["self"]}
    assert points == {CLAIMED, EFFECT_WRITTEN, COMPLETED}, summary
    for point, key, worker in report["self"]:
        if point == COMPLETED:  # committed, killed before the ack: its effect stands
            assert applied[key] == [worker], summary
            assert json.loads(held[key].result or b"{}") == {"worker": worker}
        else:  # killed before the commit: its write vanished with its transaction
            assert worker not in applied[key], f"{point} {key} {worker}: {summary}"
