"""Crashes and outages (R7, slow): a server restart in the middle of a run, and workers
SIGKILLed at every point of the transactional mode; every effect exactly once.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import threading
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

import oncely
from oncely import Outcome, Status
from oncely.stores.postgres.sync_store import PostgresStore
from tests.chaos.harness import Processes
from tests.services import POSTGRES_DSN, disruptive
from tests.stores.postgres.helpers import _ledger, _ledger_counts, _sql

# ------------------------------------------------------------------ the outage (slow)


def _cluster() -> str:
    return sorted(os.listdir("/etc/postgresql"))[-1]


def _pg_ctl(action: str) -> None:
    subprocess.run(
        ["pg_ctlcluster", "--skip-systemctl-redirect", "-m", "fast", _cluster(), "main", action],
        capture_output=True,
        timeout=60,
        check=False,
    )


def _wait_until_ready(seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        ready = subprocess.run(["pg_isready", "-h", "127.0.0.1"], capture_output=True, check=False)
        if ready.returncode == 0:
            return
        time.sleep(0.2)
    raise AssertionError("PostgreSQL did not come back")


@pytest.mark.slow
@pytest.mark.timeout(120)
@disruptive("stops and starts the machine's PostgreSQL cluster")
def test_r7_server_restart_mid_run_loses_nothing_and_doubles_nothing(table: str) -> None:
    """PostgreSQL stops (fast shutdown: every session is cut) and starts again while three
    threads process messages in the transactional mode, each message delivered twice. Calls
    during the outage raise StoreUnavailable (never a psycopg error); every message is
    redelivered until acknowledged; afterwards every effect is in the ledger exactly once."""
    if not os.path.isdir("/etc/postgresql") or os.geteuid() != 0:
        pytest.skip("needs a local Debian PostgreSQL cluster and root to restart it")
    keys = [f"order-{i:03d}" for i in range(150)]
    ledger = _ledger(table)
    store = PostgresStore(
        POSTGRES_DSN, table=table, pool_max=4, connect_timeout=timedelta(seconds=1)
    )
    store.migrate()
    inbox = oncely.Inbox(store, consumer="outage")
    deliveries = [k for k in keys for _ in range(2)]
    random.Random(7).shuffle(deliveries)
    pending = list(deliveries)
    lock = threading.Lock()
    tally: Counter[str] = Counter()
    processed: list[str] = []
    strange: list[str] = []
    reasons: Counter[str] = Counter()

    def book(tx: psycopg.Connection[Any], payload: dict[str, str]) -> None:
        tx.execute(f"INSERT INTO {ledger} (key) VALUES (%s)".encode(), (payload["key"],))
        time.sleep(0.002)  # keep transactions open long enough to be cut mid-flight

    def consume() -> None:
        while True:
            with lock:
                if not pending:
                    return
                key = pending.pop()
            try:
                handled = inbox.handle_in_transaction(key, {"key": key}, book)
            except oncely.StoreUnavailable as exc:
                tally["unavailable"] += 1
                reasons[str(exc).split(":")[0] + ": " + str(exc).split(": ", 2)[-1][:50]] += 1
                with lock:
                    pending.insert(0, key)  # redelivered later
                time.sleep(0.05)
                continue
            except Exception as exc:  # a psycopg error escaping would land here
                strange.append(f"{key}: {type(exc).__module__}.{type(exc).__name__}: {exc}")
                with lock:
                    pending.insert(0, key)
                continue
            tally[handled.outcome.value] += 1
            if handled.outcome is Outcome.PROCESSED:
                processed.append(key)
            elif handled.outcome is not Outcome.DUPLICATE:
                # The handler's own write failed when the connection dropped: retried.
                with lock:
                    pending.insert(0, key)

    workers = [threading.Thread(target=consume) for _ in range(3)]
    for w in workers:
        w.start()
    try:
        while len(pending) > len(deliveries) * 2 // 3:
            time.sleep(0.01)
        _pg_ctl("stop")
        time.sleep(1.5)  # connections are refused for a while
    finally:
        _pg_ctl("start")
        _wait_until_ready()
    for w in workers:
        w.join(60)
    store.close()
    print(f"\n[outage] {dict(tally)} {dict(reasons)}")
    assert not strange, strange
    assert not pending, pending
    assert tally["unavailable"] > 0, "the outage was never felt: the test proved nothing"
    counts = _ledger_counts(ledger)
    assert {k: n for k, n in counts.items() if n != 1} == {}
    assert set(counts) == set(keys)
    check = PostgresStore(POSTGRES_DSN, table=table)
    for key in set(processed) | set(keys):
        record = check.get("outage", key)
        assert record is not None and record.status is Status.COMPLETED, key
    check.close()


_KILL_POINTS = ("before the write", "after the write", "after the commit")


def _crash_worker(table: str, keys: list[str], plan: tuple[str, int] | None, out: str) -> None:
    """Handle ``keys`` in the transactional mode; with a ``plan`` (point, n), SIGKILL itself
    the n-th time it reaches that point. Acknowledgements go to ``out``, one ``os.write`` on
    an ``O_APPEND`` file each: a line lands whole or not at all."""
    store = PostgresStore(POSTGRES_DSN, table=table, pool_max=1, migrate=False)
    inbox = oncely.Inbox(store, consumer="crash")
    log = os.open(out, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    reached: Counter[str] = Counter()
    name = os.path.basename(out)

    def point(where: str, key: str) -> None:
        reached[where] += 1
        if plan is not None and plan == (where, reached[where]):
            os.write(log, f"kill {where}|{key}\n".encode())
            os.kill(os.getpid(), signal.SIGKILL)

    def book(tx: psycopg.Connection[Any], payload: dict[str, str]) -> None:
        point("before the write", payload["key"])
        tx.execute(
            f"INSERT INTO {table}_ledger (key, worker) VALUES (%s, %s)".encode(),
            (payload["key"], name),
        )
        point("after the write", payload["key"])

    for key in keys:
        try:
            handled = inbox.handle_in_transaction(key, {"key": key}, book)
        except oncely.StoreUnavailable:
            continue  # not acknowledged: redelivered
        if handled.outcome is Outcome.PROCESSED:
            point("after the commit", key)  # its own effect committed, not acknowledged yet
        if handled.outcome in (Outcome.PROCESSED, Outcome.DUPLICATE):
            os.write(log, f"ack {handled.outcome.value}|{key}\n".encode())
    store.close()
    os.close(log)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_r7_sigkilled_workers_apply_every_effect_exactly_once(table: str, tmp_path: Path) -> None:
    """Four workers in the transactional mode get every unacknowledged message (concurrent
    duplicates). In the first rounds three of them SIGKILL themselves, one before its write,
    one after it (before the commit), one after the commit (before the acknowledgement), and
    the parent SIGKILLs the fourth at a random moment; every message not acknowledged goes to
    a fresh fleet until all are. The ledger has no unique key: each effect must be there
    exactly once, and every record completed at its first attempt."""
    keys = [f"order-{i:03d}" for i in range(200)]
    _ledger(table)
    PostgresStore(POSTGRES_DSN, table=table).migrate()
    seed = int(os.environ.get("ONCELY_CHAOS_SEED", random.randrange(2**32)))
    rng = random.Random(seed)
    pending = set(keys)
    kills: list[tuple[str, str, str]] = []  # (point, key, worker)
    outcomes: Counter[str] = Counter()
    parent_kills = rounds = 0
    procs = Processes()
    try:
        while pending and rounds < 20:
            rounds += 1
            chaos = rounds <= 3
            logs = [str(tmp_path / f"r{rounds}-w{n}.log") for n in range(4)]
            fleet = []
            for n, out in enumerate(logs):
                order = sorted(pending)
                rng.shuffle(order)
                plan = (_KILL_POINTS[n], rng.randint(1, 12)) if chaos and n < 3 else None
                fleet.append(procs.start(_crash_worker, table, order, plan, out, name=out))
            if chaos:
                time.sleep(rng.uniform(0.05, 0.5))
                if fleet[3].is_alive():
                    os.kill(fleet[3].pid, signal.SIGKILL)  # type: ignore[arg-type]
                    parent_kills += 1
            for p in fleet:
                p.join(60)
            procs.reap()
            for out in logs:
                lines = Path(out).read_text().splitlines() if os.path.exists(out) else []
                for line in lines:
                    kind, rest = line.split(" ", 1)
                    what, key = rest.split("|")
                    if kind == "ack":
                        outcomes[what] += 1
                        pending.discard(key)
                    else:
                        kills.append((what, key, os.path.basename(out)))
    finally:
        procs.reap()
    summary = (
        f"seed={seed} rounds={rounds} kills={Counter(w for w, _, _ in kills)} "
        f"parent_kills={parent_kills} outcomes={dict(outcomes)}"
    )
    print(f"\n[crash] {summary}")
    assert not pending, f"never acknowledged: {sorted(pending)[:10]}; {summary}"
    counts = _ledger_counts(f"{table}_ledger")
    assert {k: n for k, n in counts.items() if n != 1} == {}, summary
    assert set(counts) == set(keys), summary
    assert {w for w, _, _ in kills} == set(_KILL_POINTS), summary
    assert outcomes["duplicate"] > 0, summary
    check = PostgresStore(POSTGRES_DSN, table=table)
    records = {r.key: r for r in check.scan(consumer="crash", limit=1000)}
    check.close()
    assert set(records) == set(keys), summary
    assert all(r.status is Status.COMPLETED and r.attempt == 1 for r in records.values())
    applied = dict(_sql(f"SELECT key, worker FROM {table}_ledger"))
    for where, key, worker in kills:
        if where == "after the commit":  # committed, then killed: its effect stands
            assert applied[key] == worker, (where, key, worker, applied[key], summary)
        else:  # killed inside the transaction: its write vanished, another worker's stands
            assert applied[key] != worker, (where, key, worker, summary)
