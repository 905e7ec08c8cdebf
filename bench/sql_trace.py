"""SQL per message of the SQLite paths (``bench/run.py``'s SQL table): statements, write
transactions and WAL pages, traced with sqlite3's trace callback on the sync connections."""

from __future__ import annotations

import os
import re
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cases import Keys, Resources, expect, trivial
from tx_case import TxConfig, check_tx, open_tx, tx_batch

import oncely


def label(sql: str) -> str:
    """A short name for a traced statement, e.g. ``INSERT oncely_inbox ON CONFLICT RETURNING``."""
    text = " ".join(sql.split())
    upper = text.upper()
    m = re.match(r"(INSERT INTO|UPDATE|DELETE FROM|SELECT .*? FROM)\s+(\w+)", text, re.I)
    if m:
        verb = m.group(1).split()[0].upper()
        name = f"{verb} {m.group(2)}"
        if " ON CONFLICT " in upper:
            name += " ON CONFLICT"
        if " RETURNING " in upper:
            name += " RETURNING"
        return name
    return " ".join(text.split()[:2]).upper()


@dataclass
class Trace:
    """Statements seen on one sqlite3 connection while active."""

    statements: list[str] = field(default_factory=list)
    active: bool = False

    def __call__(self, sql: str) -> None:
        if self.active:
            self.statements.append(label(sql))


def per_message(statements: list[str], n: int) -> tuple[float, float, list[str]]:
    """(statements per message, commits per message, one message's statement sequence).

    A commit is an explicit COMMIT or a write statement outside an explicit transaction
    (autocommit: at ``synchronous=full`` each one that changed a page is a WAL fsync).
    """
    commits = 0
    in_tx = False
    for s in statements:
        if s.startswith("BEGIN"):
            in_tx = True
        elif s in ("COMMIT", "END", "ROLLBACK"):
            commits += s != "ROLLBACK"
            in_tx = False
        elif not in_tx and s.split()[0] in ("INSERT", "UPDATE", "DELETE"):
            commits += 1
    one = statements[: len(statements) // n] if n else []
    return len(statements) / n, commits / n, one


def wal_frames(conn: sqlite3.Connection) -> int:
    """Frames in the WAL now (a PASSIVE checkpoint reports the log size)."""
    return int(conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()[1])


def grab_connection(store: oncely.SQLiteStore) -> sqlite3.Connection:
    """The store's pooled connection, through the public API: single-threaded use always
    reuses the one connection, and the transactional mode hands it to the handler."""
    got: list[sqlite3.Connection] = []

    def take(conn: sqlite3.Connection, _payload: object) -> None:
        got.append(conn)

    inbox = oncely.Inbox(store, consumer="bench-grab")
    expect(inbox.handle_in_transaction(os.urandom(8).hex(), {}, take), oncely.Outcome.PROCESSED)
    return got[0]


def trace_twophase(workdir: Path, res: Resources, n: int) -> dict[str, Any]:
    """SQL statements, commits and WAL pages per message of the sync SQLite two-phase path."""
    store = oncely.SQLiteStore(workdir / "trace-tp.db")
    inbox = oncely.Inbox(store, consumer="bench")
    res.add(store.close)
    res.add(inbox.close)
    conn = grab_connection(store)
    conn.execute("PRAGMA wal_autocheckpoint = 0")
    trace = Trace()
    conn.set_trace_callback(trace)
    msgs = Keys().batch(n)
    out: dict[str, Any] = {}
    for path, outcome in (
        ("new key", oncely.Outcome.PROCESSED),
        ("duplicate", oncely.Outcome.DUPLICATE),
    ):
        trace.statements.clear()
        conn.set_trace_callback(None)
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        conn.set_trace_callback(trace)
        before = wal_frames(conn)
        trace.active = True
        for k, p in msgs:
            expect(inbox.handle(k, p, trivial), outcome)
        trace.active = False
        frames = wal_frames(conn) - before
        stmts, commits, one = per_message(trace.statements, n)
        out[path] = {"statements": stmts, "commits": commits, "wal_pages": frames / n, "seq": one}
    conn.set_trace_callback(None)
    return out


def trace_tx(workdir: Path, res: Resources, n: int) -> dict[str, Any]:
    """SQL statements, commits and WAL pages per message, sync, for raw / marker / oncely."""
    cfg = TxConfig(False, "full")
    wd = workdir / "trace-tx"
    wd.mkdir(exist_ok=True)
    open_tx(cfg, wd, res)
    conns = {"raw": cfg.raw, "marker": cfg.marker, "oncely": grab_connection(cfg.store)}
    out: dict[str, Any] = {}
    keys = Keys()
    for variant, conn in conns.items():
        # No automatic checkpoint while counting: the WAL then holds exactly what was written.
        conn.execute("PRAGMA wal_autocheckpoint = 0")
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        before = wal_frames(conn)
        trace = Trace()
        conn.set_trace_callback(trace)
        trace.active = True
        tx_batch(cfg, variant, keys.batch(n), res.runner)
        trace.active = False
        conn.set_trace_callback(None)
        stmts, commits, one = per_message(trace.statements, n)
        out[variant] = {
            "statements": stmts,
            "commits": commits,
            "wal_pages": (wal_frames(conn) - before) / n,
            "seq": one,
        }
    check_tx(cfg, wd, extra_markers=1)  # grab_connection left one marker of its own
    return out
