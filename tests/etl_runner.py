"""An ETL run for ``tests/test_etl.py``: ``python -m tests.etl_runner DB INCOMING LOG PAUSE``
loads every ``*.csv`` of INCOMING (one unit per file) into the table ``orders``, then the
lines of LOG from the checkpoint on, 10 lines a unit, into ``clicks``, on the SQLite file
DB, pausing PAUSE seconds after each unit. It prints ``processed=N duplicate=M``."""

from __future__ import annotations

import sqlite3
import sys
import time
from collections import Counter
from pathlib import Path

import oncely
from oncely.etl import Checkpoint, file_unit

CHUNK = 10


def main() -> None:
    db, incoming, log, pause = sys.argv[1:]
    store = oncely.SQLiteStore(db)
    inbox = oncely.Inbox(store, consumer="loader")
    seen: Counter[str] = Counter()

    def load(tx: sqlite3.Connection, payload: dict[str, str]) -> int:
        lines = Path(payload["path"]).read_text().splitlines()
        tx.executemany(
            "INSERT INTO orders (file, line) VALUES (?, ?)", [(payload["name"], x) for x in lines]
        )
        return len(lines)

    for path in sorted(Path(incoming).glob("*.csv")):
        handled = inbox.handle_in_transaction(
            file_unit(path), {"name": path.name, "path": str(path)}, load
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
