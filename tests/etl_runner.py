"""ETL runs for ``tests/test_etl.py``, each in a process of its own.

``python -m tests.etl_runner DB INCOMING LOG PAUSE`` loads every ``*.csv`` of INCOMING (one
unit per file) into the table ``orders``, then the lines of LOG from the checkpoint on, 10
lines a unit, into ``clicks``, on the SQLite file DB, pausing PAUSE seconds after each unit.
It prints ``processed=N duplicate=M``.

``python -m tests.etl_runner apply WHERE TABLE FIRST LAST START_AT HOLD [STREAM]`` applies the
range ``[FIRST, LAST)`` of the stream STREAM (default ``log``) through a
:class:`~oncely.etl.Checkpoint` on the store WHERE (``sqlite:<path>``, ``postgres`` or
``mysql``, the test servers) with the inbox table TABLE, at the epoch time START_AT; its
handler writes the offsets into ``TABLE_rows`` and holds the transaction open HOLD seconds.
It prints the outcome, or ``refused`` and the error.
"""

from __future__ import annotations

import sqlite3
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import oncely
from oncely.errors import ConfigurationError
from oncely.etl import Checkpoint, file_unit

CHUNK = 10


def open_store(where: str, table: str) -> oncely.Store:
    """The store WHERE names (``sqlite:<path>``, ``postgres``, ``mysql``) on inbox ``table``."""
    if where.startswith("sqlite:"):
        return oncely.SQLiteStore(where.removeprefix("sqlite:"), table=table)
    if where == "postgres":
        from oncely.stores.postgres.sync_store import PostgresStore
        from tests.services import POSTGRES_DSN

        return PostgresStore(POSTGRES_DSN, table=table, pool_max=4)
    from oncely.stores.mysql.sync_store import MySQLStore
    from tests.services import MYSQL_URL

    return MySQLStore.from_url(f"{MYSQL_URL}{'&' if '?' in MYSQL_URL else '?'}table={table}")


def row_writer(where: str, table: str, hold: float = 0) -> Callable[[Any, list[int]], int]:
    """A handler that inserts its payload's offsets into ``<table>_rows`` (a column ``n``,
    without a unique key: a row applied twice shows), then holds the transaction ``hold``
    seconds (saying ``holding`` on stderr first)."""
    mark = "?" if where.startswith("sqlite:") else "%s"
    sql = f"INSERT INTO {table}_rows (n) VALUES ({mark})"

    def write(tx: Any, offsets: list[int]) -> int:
        cursor = tx.cursor()
        try:
            cursor.executemany(sql, [(n,) for n in offsets])
        finally:
            cursor.close()
        if hold:
            print("holding", file=sys.stderr, flush=True)  # the mark is locked: for the test
        time.sleep(hold)
        return len(offsets)

    return write


def apply(
    where: str, table: str, first: int, last: int, start_at: float, hold: float, stream: str
) -> None:
    store = open_store(where, table)
    inbox = oncely.Inbox(store, consumer="loader")
    mark = Checkpoint(inbox, stream)
    time.sleep(max(0.0, start_at - time.time()))
    try:
        handled = mark.apply(first, last, list(range(first, last)), row_writer(where, table, hold))
    except ConfigurationError as exc:
        print("refused", exc, flush=True)
    else:
        print(handled.outcome.value, handled.value, flush=True)
    inbox.close()
    store.close()


def main() -> None:
    if sys.argv[1] == "apply":
        where, table, first, last, start_at, hold, *stream = sys.argv[2:]
        apply(where, table, int(first), int(last), float(start_at), float(hold), *stream or ["log"])
        return
    db, incoming, log, pause = sys.argv[1:]
    store = oncely.SQLiteStore(db)
    inbox = oncely.Inbox(store, consumer="loader")
    seen: Counter[str] = Counter()

    def load(tx: sqlite3.Connection, path: Path) -> int:
        lines = path.read_text().splitlines()
        tx.executemany(
            "INSERT INTO orders (file, line) VALUES (?, ?)", [(path.name, x) for x in lines]
        )
        return len(lines)

    for path in sorted(Path(incoming).glob("*.csv")):
        # The payload names the unit as its key does (the file's name, not where it lies), so
        # the same file fed from another folder is a duplicate; the handler reads the path.
        handled = inbox.handle_in_transaction(
            file_unit(path),
            {"file": path.name},
            lambda tx, _unit: load(tx, path),  # noqa: B023
        )
        seen[handled.outcome.value] += 1
        time.sleep(float(pause))

    def clicks(tx: sqlite3.Connection, rows: list[list[object]]) -> None:
        tx.executemany("INSERT INTO clicks (n, text) VALUES (?, ?)", rows)

    mark = Checkpoint(inbox, "clicks.log")
    lines = Path(log).read_text().splitlines()
    start = mark.position()
    for first in range(start - start % CHUNK, len(lines), CHUNK):
        last = min(first + CHUNK, len(lines))
        rows = [[n, lines[n]] for n in range(first, last)]
        seen[mark.apply(first, last, rows, clicks).outcome.value] += 1
        time.sleep(float(pause))
    print(f"processed={seen['processed']} duplicate={seen['duplicate']} start={start}", flush=True)
    inbox.close()
    store.close()


if __name__ == "__main__":
    main()
