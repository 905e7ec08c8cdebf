"""Constants and helpers shared by the PostgreSQL store test modules."""

from __future__ import annotations

import itertools
import os
import tempfile
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
from psycopg import pq

from tests.services import POSTGRES_DSN

LEASE_MS = 60_000
KEEP_MS = 3_600_000
_TWO_PHASE: dict[str, Any] = {"lease_ms": LEASE_MS, "keep_ms": KEEP_MS, "takeover": True}


def _sql(query: str, *params: object) -> list[tuple[Any, ...]]:
    with psycopg.connect(POSTGRES_DSN, autocommit=True) as conn:
        cursor = conn.execute(query.encode(), params or None)
        return cursor.fetchall() if cursor.description else []


def _claim(store: Any, key: str = "k", token: str = "t", **kw: Any) -> Any:
    options: dict[str, Any] = {
        "fingerprint": "f",
        "token": token,
        "lease_ms": LEASE_MS,
        "keep_ms": KEEP_MS,
        "takeover": True,
    }
    options.update(kw)
    return store.claim("c", key, **options)


def _ledger(table: str) -> str:
    name = f"{table}_ledger"
    _sql(f"CREATE TABLE IF NOT EXISTS {name} (key TEXT NOT NULL, worker TEXT)")
    return name


def _ledger_counts(ledger: str) -> Counter[str]:
    return Counter(dict(_sql(f"SELECT key, count(*) FROM {ledger} GROUP BY key")))


@contextmanager
def _traced(conn: Any, tags: list[str] | None = None) -> Iterator[dict[str, int]]:
    """Count the round trips (ReadyForQuery messages) and statements libpq exchanges on
    ``conn`` inside the block, and the waits: each time the client, having sent something,
    reads the server's answer (a pipeline that flushed and waited twice before its Sync
    would be one round trip by ReadyForQuery, two by waits). ``tags`` collects the server's
    command tags (``SAVEPOINT``, ``RELEASE``, ``INSERT 0 1`` ...)."""
    counts: dict[str, int] = {}
    fd, path = tempfile.mkstemp(prefix="oncely-trace-")
    conn.pgconn.trace(fd)
    conn.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)
    try:
        yield counts
    finally:
        conn.pgconn.untrace()
        os.close(fd)
        lines = Path(path).read_text().splitlines()
        os.unlink(path)
        fields = [line.split("\t") for line in lines if line[:2] in ("F\t", "B\t")]
        counts["round_trips"] = sum(1 for f in fields if f[0] == "B" and f[2] == "ReadyForQuery")
        counts["statements"] = sum(
            1 for f in fields if f[0] == "F" and f[2] in ("Query", "Execute")
        )
        counts["waits"] = sum(
            1 for a, b in itertools.pairwise(fields) if a[0] == "F" and b[0] == "B"
        )
        if tags is not None:
            tags += [f[3].strip().strip('"') for f in fields if f[2] == "CommandComplete"]
