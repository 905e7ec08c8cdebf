"""What a marker row costs SQLite, whatever its shape: python bench/sqlite_marker_rows.py

The business transaction of the ``tx`` section (``BEGIN IMMEDIATE``; a ledger insert; a
balance update; ``COMMIT``), by hand on sqlite3 with no oncely code, against the same
transaction plus one marker row written by hand in several shapes:

- ``oncely``: oncely's own inbox table (created by the store) and claim statement;
- ``in-check``: the same table with the status ``CHECK`` spelled ``status IN (...)``, as
  tables created before that constraint was rewritten have it (``oncely migrate`` rewrites
  it): SQLite fills a temporary b-tree for it on every INSERT;
- ``no-check``: the same table without its ``CHECK`` on the status;
- ``no-token``: oncely's table, the row written with an empty token (a smaller row);
- ``key-only``: the smallest marker there is, a ``WITHOUT ROWID`` table of (consumer, key).

Each variant has a database file of its own, with the pragmas oncely's store applies at the
chosen ``synchronous`` (``--synchronous``, default ``full``); rounds are interleaved in a
rotating order and the medians of the per-round times and ratios are printed, with the WAL
pages each transaction appends (counted afterwards with automatic checkpoints off). It shows
how much of the transactional mode's cost is the marker row itself, which no oncely code can
remove: at ``normal`` even the key-only row costs far more than the 1.3x target.
About 30 seconds.
"""

from __future__ import annotations

import argparse
import gc
import sqlite3
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from cases import Keys
from tx_case import CLAIM_SQL, book, create_business_schema, marker_params

import oncely
from oncely.stores.sqlite.dialect import OLD_STATUS_CHECK, STATUS_CHECK

_FP = "v1:" + "0" * 32
_TOKEN = "f" * 32
_KEY_ONLY = (
    "CREATE TABLE marker (consumer TEXT NOT NULL, key TEXT NOT NULL, "
    "PRIMARY KEY (consumer, key)) WITHOUT ROWID"
)
_KEY_ONLY_INSERT = "INSERT INTO marker (consumer, key) VALUES (?, ?) ON CONFLICT DO NOTHING"


def _rewrite_check(path: Path, check: str) -> None:
    """oncely's inbox table, rebuilt with its status CHECK replaced by ``check`` (same
    columns, same key)."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        (sql,) = conn.execute(
            "SELECT sql FROM sqlite_master WHERE name = 'oncely_inbox'"
        ).fetchone()
        assert STATUS_CHECK in sql, sql
        conn.execute("DROP TABLE oncely_inbox")
        conn.execute(sql.replace(STATUS_CHECK, check))
    finally:
        conn.close()


def _writer(variant: str) -> Callable[[sqlite3.Connection, str], None]:
    """The marker row of ``variant``, written by hand inside the open transaction."""
    if variant == "raw":
        return lambda conn, key: None
    if variant == "key-only":

        def key_only(conn: sqlite3.Connection, key: str) -> None:
            conn.execute(_KEY_ONLY_INSERT, ("ledger", key)).fetchall()

        return key_only
    token = "" if variant == "no-token" else _TOKEN

    def claim(conn: sqlite3.Connection, key: str) -> None:
        conn.execute(CLAIM_SQL, marker_params(key, token, _FP)).fetchall()

    return claim


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--synchronous", default="full", choices=("full", "normal", "off"))
    parser.add_argument("--messages", type=int, default=1000, help="transactions per round")
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()

    variants = ("raw", "oncely", "in-check", "no-check", "no-token", "key-only")
    settings = oncely.SQLiteSettings(synchronous=args.synchronous)
    workdir = Path(tempfile.mkdtemp(prefix="oncely-marker-rows-"))
    conns: dict[str, sqlite3.Connection] = {}
    for variant in variants:
        path = workdir / f"{variant}.db"
        create_business_schema(path)
        if variant in ("oncely", "in-check", "no-check", "no-token"):
            store = oncely.SQLiteStore(path)
            store.migrate()
            store.close()
            if variant == "in-check":
                _rewrite_check(path, OLD_STATUS_CHECK)
            elif variant == "no-check":
                _rewrite_check(path, "")
        conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        for pragma in ("PRAGMA journal_mode = WAL", *settings.pragmas()):
            conn.execute(pragma)
        if variant == "key-only":
            conn.execute(_KEY_ONLY)
        conns[variant] = conn
    keys = Keys()

    def run(variant: str, n: int) -> float:
        conn, write = conns[variant], _writer(variant)
        msgs = keys.batch(n)
        gc.collect()
        started = time.perf_counter()
        for key, payload in msgs:
            conn.execute("BEGIN IMMEDIATE")
            write(conn, key)
            book(conn, payload)
            conn.execute("COMMIT")
        return (time.perf_counter() - started) / n * 1e6

    for variant in variants:
        run(variant, 200)  # warm-up
    times: dict[str, list[float]] = {v: [] for v in variants}
    for r in range(args.rounds):
        order = variants[r % len(variants) :] + variants[: r % len(variants)]
        for variant in order:
            times[variant].append(run(variant, args.messages))

    pages: dict[str, float] = {}
    for variant, conn in conns.items():
        conn.execute("PRAGMA wal_autocheckpoint = 0")
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        before = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()[1]
        run(variant, 1000)
        pages[variant] = (
            conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()[1] - before
        ) / 1000
        conn.close()

    print(
        f"synchronous={args.synchronous}: {args.rounds} interleaved rounds of {args.messages} "
        "transactions; medians"
    )
    print(f"{'variant':10s} {'us/tx':>8s} {'vs raw':>7s} {'WAL pages/tx':>13s}")
    for variant in variants:
        ratio = statistics.median(a / b for a, b in zip(times[variant], times["raw"], strict=True))
        print(
            f"{variant:10s} {statistics.median(times[variant]):8.1f} {ratio:6.2f}x "
            f"{pages[variant]:13.2f}"
        )


if __name__ == "__main__":
    main()
