"""How much more the same Python costs right after an fsync: python bench/cold_cpu.py

Runs the raw SQLite business transaction (ledger insert + balance update) with and without a
fixed slice of Python work (four fingerprints of a small payload) before each transaction, at
synchronous=normal and synchronous=full, and prints what the work added per message next to
what it costs on a warm CPU. At synchronous=full each commit waits for an fsync, the CPU idles,
and the Python that follows runs from cold caches: this is why oncely's fixed Python cost weighs
more in the full-durability ratio than in the normal one.
"""

from __future__ import annotations

import os
import sqlite3
import statistics
import tempfile
import time
import timeit
from pathlib import Path

from oncely import fingerprint

PAYLOAD = {
    "order_id": "ord-123456",
    "account": 1,
    "amount_cents": 4250,
    "customer": {"id": "c-99", "email": "a@example.com"},
    "items": [{"sku": "A-1", "qty": 2}],
    "created_at": "2026-11-30T01:00:00Z",
}
MESSAGES = 2000
ROUNDS = 3


def work() -> None:
    for _ in range(4):
        fingerprint(PAYLOAD)


def run(path: Path, synchronous: str, with_work: bool) -> float:
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute(f"PRAGMA synchronous = {synchronous}")
    conn.execute("CREATE TABLE ledger (ref TEXT, amount INTEGER)")
    conn.execute("CREATE TABLE account (id INTEGER PRIMARY KEY, balance INTEGER)")
    conn.execute("INSERT INTO account VALUES (1, 0)")
    started = time.perf_counter()
    for i in range(MESSAGES):
        if with_work:
            work()
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("INSERT INTO ledger VALUES (?, ?)", (f"r{i}", 5))
        conn.execute("UPDATE account SET balance = balance + 5 WHERE id = 1")
        conn.execute("COMMIT")
    conn.close()
    return (time.perf_counter() - started) / MESSAGES * 1e6


def main() -> None:
    warm = min(timeit.repeat(work, number=10_000, repeat=3)) / 10_000 * 1e6
    print(f"the Python slice on a warm CPU: {warm:.1f} us")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "cold.db"
        for synchronous in ("normal", "full"):
            plain = statistics.median(run(path, synchronous, False) for _ in range(ROUNDS))
            busy = statistics.median(run(path, synchronous, True) for _ in range(ROUNDS))
            added = busy - plain
            print(
                f"synchronous={synchronous:6s} transaction {plain:7.1f} us, with the slice "
                f"{busy:7.1f} us: the slice cost {added:5.1f} us ({added / warm:.1f}x warm)"
            )
    print(f"(pid {os.getpid()}; {MESSAGES} messages x {ROUNDS} rounds, medians)")


if __name__ == "__main__":
    main()
