"""The child-process side of the chaos tests (R7, R8, R10): what every worker shares.

The workers themselves, real consumers in real processes, are in race_workers.py (R8),
crash_workers.py (R7, R10) and zombie_workers.py (R10). Every function whose name ends in
``_worker`` is the target of a process started with the multiprocessing "spawn" context: a fresh
interpreter that imports oncely like a deployed consumer would, and shares nothing with its
siblings but SQLite files. Results travel back through files, never pipes or queues: a worker
may be SIGKILLed at any instruction, and a ``multiprocessing.Queue`` whose writer dies in the
middle of a ``put`` can stay locked, while one ``os.write`` to an ``O_APPEND`` file lands whole
or not at all.

The effects the handlers apply go to an ``effects`` table with *no* unique constraint, on
purpose: a message applied twice leaves two rows, so "exactly once" is something the tests
count rather than something a constraint quietly enforces.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import time
from collections import Counter
from typing import Any

import oncely

CONSUMER = "chaos"

EFFECTS_DDL = "CREATE TABLE IF NOT EXISTS effects (key TEXT NOT NULL, worker TEXT NOT NULL)"
INSERT_EFFECT = "INSERT INTO effects (key, worker) VALUES (?, ?)"

# Every worker gives up after this long: a hang must end as a failure, never block CI.
WORKER_DEADLINE_S = 90.0


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
