"""How long a SQLite writer waits behind a purge, by the way it waits:
python bench/sqlite_busy_wait.py

A consumer process inserts one row at a time (autocommit, about 400 a second) into a WAL
database of ``--rows`` random uuid keys: ``--ops`` inserts alone, then as many as it makes
while a second process deletes 10% of the keys by primary key, ``--write-rows`` per write
transaction, resting as long as each write took after it (the purge's default pause). Two
ways to wait for the write lock:

- ``sqlite``: SQLite's own busy handler (``timeout=30``), which sleeps 1, 2, 5, 10... ms
  between tries;
- ``python``: no busy handler (``timeout=0``) and a retry every 0.2 ms from Python, the
  finest wait a caller of the ``sqlite3`` module can have.

It shows what a purge can cost a consumer's p99 on SQLite whoever writes it: the time a
purge write holds the lock is the wait, and the busy handler's steps add to it. No oncely code
runs. About 30 seconds.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import sqlite3
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any


def load(path: Path, rows: int) -> None:
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("CREATE TABLE t (k TEXT PRIMARY KEY, v BLOB, e INTEGER)")
    conn.execute("CREATE INDEX t_e ON t (e)")
    conn.execute("BEGIN")
    conn.executemany(
        "INSERT INTO t VALUES (?, ?, ?)",
        ((str(uuid.uuid4()), os.urandom(150), random.randrange(10)) for _ in range(rows)),
    )
    conn.execute("COMMIT")
    conn.close()


def purge(path: Path, write_rows: int, stop: Any, rate: Any) -> None:
    conn = sqlite3.connect(path, isolation_level=None, timeout=30)
    conn.execute("PRAGMA synchronous=NORMAL")
    keys = [k for (k,) in conn.execute("SELECT k FROM t WHERE e = 0")]
    deleted, started = 0, time.monotonic()
    for start in range(0, len(keys), write_rows):
        if stop.is_set():
            break
        chunk = keys[start : start + write_rows]
        began = time.monotonic()
        conn.execute(f"DELETE FROM t WHERE k IN ({','.join('?' * len(chunk))})", chunk)
        conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
        deleted += len(chunk)
        time.sleep(time.monotonic() - began)
    rate.put(deleted / (time.monotonic() - started))
    stop.set()  # the consumer times its inserts while the purge runs, no longer
    conn.close()


def consume(path: Path, waiter: str, purging: bool, ops: int, write_rows: int, out: Any) -> None:
    conn = sqlite3.connect(path, isolation_level=None, timeout=30 if waiter == "sqlite" else 0)
    conn.execute("PRAGMA synchronous=NORMAL")
    stop = mp.Event()
    rate: Any = mp.Queue()
    purger = None
    if purging:
        purger = mp.Process(target=purge, args=(path, write_rows, stop, rate))
        purger.start()
        time.sleep(0.2)
    times = []
    while len(times) < ops if purger is None else not stop.is_set():
        key = str(uuid.uuid4())
        began = time.perf_counter()
        while True:
            try:
                conn.execute("INSERT INTO t VALUES (?, ?, 5)", (key, b"x" * 100))
                break
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) and "busy" not in str(exc):
                    raise
                time.sleep(0.0002)
        times.append(time.perf_counter() - began)
        time.sleep(0.0025)
    rows_per_s = 0.0
    if purger is not None:
        rows_per_s = rate.get()
        purger.join()
    times.sort()
    out.put((times[len(times) // 2], times[int(len(times) * 0.99)], rows_per_s))


def main() -> None:
    p = argparse.ArgumentParser(prog="python bench/sqlite_busy_wait.py", description=__doc__)
    p.add_argument("--rows", type=int, default=200_000, help="rows loaded (200,000)")
    p.add_argument("--ops", type=int, default=3000, help="inserts timed per run (3,000)")
    p.add_argument("--write-rows", type=int, default=100, help="rows per purge write (100)")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    print(f"sqlite {sqlite3.sqlite_version}, {args.rows:,} rows, {args.write_rows} per write")
    print(
        "| round | waiter | quiet p50 / p99 (ms) | during purge p50 / p99 (ms) | p99 ratio "
        "| purge rows/s |"
    )
    print("|---:|---|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "busy.db"
        for n in range(args.rounds):
            for waiter in ("sqlite", "python"):
                found = []
                for purging in (False, True):
                    load(path, args.rows)
                    out: Any = mp.Queue()
                    run = mp.Process(
                        target=consume,
                        args=(path, waiter, purging, args.ops, args.write_rows, out),
                    )
                    run.start()
                    found.append(out.get())
                    run.join()
                (q50, q99, _), (p50, p99, rows_per_s) = found
                print(
                    f"| {n + 1} | {waiter} | {q50 * 1e3:.2f} / {q99 * 1e3:.2f} | "
                    f"{p50 * 1e3:.2f} / {p99 * 1e3:.2f} | {p99 / q99:.1f}x | {rows_per_s:,.0f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
