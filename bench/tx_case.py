"""The ``tx`` section of ``bench/run.py``: ``Inbox.handle_in_transaction`` against the same
SQLite business transaction written by hand ("raw") and the same plus oncely's claim statement
run by hand ("raw + marker"), sync and async, at ``synchronous=full`` and ``normal``, in
interleaved rounds; every database's ledger, balances and markers are checked at the end.

A fourth variant ("oncely, fingerprint precomputed") runs oncely with a fingerprinter that
returns the same precomputed fingerprint the marker variant writes: the same row, the same
statements and all of oncely's Python but the fingerprint's, which shows the fingerprint's
share of the overhead."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiosqlite
from cases import (
    ACCOUNTS,
    AMOUNT_CENTS,
    BenchError,
    Keys,
    Resources,
    chunks,
    expect,
    rotated,
    timed,
    timed_async,
    us_per,
)

import oncely
from oncely.stores.sqlite.dialect import SQLiteDialect

LEDGER_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS ledger (
        id INTEGER PRIMARY KEY,
        account_id INTEGER NOT NULL,
        amount_cents INTEGER NOT NULL,
        ref TEXT NOT NULL
    )""",
    "CREATE TABLE IF NOT EXISTS account (id INTEGER PRIMARY KEY, balance_cents INTEGER NOT NULL)",
)
INSERT_LEDGER = "INSERT INTO ledger (account_id, amount_cents, ref) VALUES (?, ?, ?)"
UPDATE_BALANCE = "UPDATE account SET balance_cents = balance_cents + ? WHERE id = ?"


def create_business_schema(path: Path) -> None:
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode = WAL")
        for statement in LEDGER_SCHEMA:
            conn.execute(statement)
        conn.executemany(
            "INSERT INTO account (id, balance_cents) VALUES (?, 0)",
            [(i,) for i in range(1, ACCOUNTS + 1)],
        )
    finally:
        conn.close()


def pragmas(synchronous: str) -> tuple[str, ...]:
    """The raw floor's connection set-up: the same pragmas oncely's store applies."""
    return oncely.SQLiteSettings(synchronous=synchronous).pragmas()


def book(conn: sqlite3.Connection, payload: dict[str, Any]) -> None:
    """The business transaction's body, identical for raw and oncely."""
    conn.execute(INSERT_LEDGER, (payload["account"], payload["amount_cents"], payload["order_id"]))
    conn.execute(UPDATE_BALANCE, (payload["amount_cents"], payload["account"]))


async def book_async(conn: Any, payload: dict[str, Any]) -> None:
    await conn.execute(
        INSERT_LEDGER, (payload["account"], payload["amount_cents"], payload["order_id"])
    )
    await conn.execute(UPDATE_BALANCE, (payload["amount_cents"], payload["account"]))


def marker_params(key: str, token: str, fp: str) -> tuple[object, ...]:
    """Parameters of oncely's claim statement for a transactional marker (status completed),
    as the store binds them (positionally: consumer, key, status, fingerprint, token, now,
    lease_until, expires, error), for the hand-run "raw + marker" variant."""
    now = time.time_ns() // 1_000_000
    return ("ledger", key, "completed", fp, token, now, now, now + 7 * 86_400_000, None)


# Precomputed for the marker variant: it measures the statement, not oncely's Python.
_FP = "v1:" + "0" * 32
_TOKEN = "f" * 32


_DIALECT = SQLiteDialect()
CLAIM_SQL: str = getattr(_DIALECT, "insert", None) or _DIALECT.claim
"""The statement oncely runs to claim a new key (default table), run by hand in the "raw +
marker" variant. Its rows (if it has RETURNING) are fetched as the store does; whether every
marker landed is checked at the end (:func:`check_tx`)."""

VARIANTS = ("raw", "marker", "oncely", "prefp")


def _precomputed(_payload: object) -> str:
    return _FP


@dataclass
class TxConfig:
    """One driver and ``synchronous`` setting: a database file and connection per variant."""

    is_async: bool
    synchronous: str
    raw: Any = None
    marker: Any = None
    store: Any = None
    inbox: Any = None
    prefp: Any = None
    """The inbox of the "oncely, fingerprint precomputed" variant."""
    sent: dict[str, int] = field(default_factory=lambda: dict.fromkeys(VARIANTS, 0))

    @property
    def name(self) -> str:
        return f"{'async' if self.is_async else 'sync'} {self.synchronous}"

    def path(self, workdir: Path, variant: str) -> Path:
        return workdir / f"tx-{'a' if self.is_async else 's'}{self.synchronous}-{variant}.db"


def open_tx(cfg: TxConfig, workdir: Path, res: Resources) -> None:
    paths = {v: cfg.path(workdir, v) for v in VARIANTS}
    for path in paths.values():
        create_business_schema(path)
    settings = oncely.SQLiteSettings(synchronous=cfg.synchronous)
    # The marker variant's table is created by oncely itself (same schema, same index).
    setup = oncely.SQLiteStore(paths["marker"])
    setup.migrate()
    setup.close()
    if cfg.is_async:

        async def connect(path: Path) -> aiosqlite.Connection:
            conn = await aiosqlite.connect(
                path, isolation_level=None, timeout=30, check_same_thread=False
            )
            for pragma in ("PRAGMA journal_mode = WAL", *settings.pragmas()):
                await conn.execute(pragma)
            return conn

        cfg.raw = res.runner.run(connect(paths["raw"]))
        res.add_async(cfg.raw)
        cfg.marker = res.runner.run(connect(paths["marker"]))
        res.add_async(cfg.marker)
        cfg.store = oncely.AsyncSQLiteStore(paths["oncely"], settings=settings)
        res.add_async(cfg.store)
        cfg.inbox = oncely.AsyncInbox(cfg.store, consumer="ledger")
        res.add_async(cfg.inbox)
        prefp_store = oncely.AsyncSQLiteStore(paths["prefp"], settings=settings)
        res.add_async(prefp_store)
        cfg.prefp = oncely.AsyncInbox(prefp_store, consumer="ledger", fingerprint=_precomputed)
        res.add_async(cfg.prefp)
    else:

        def connect_s(path: Path) -> sqlite3.Connection:
            # The same connect() arguments and pragmas as the store's own connections.
            conn = sqlite3.connect(path, isolation_level=None, timeout=30, check_same_thread=False)
            for pragma in ("PRAGMA journal_mode = WAL", *settings.pragmas()):
                conn.execute(pragma)
            return conn

        cfg.raw = connect_s(paths["raw"])
        res.add(cfg.raw.close)
        cfg.marker = connect_s(paths["marker"])
        res.add(cfg.marker.close)
        cfg.store = oncely.SQLiteStore(paths["oncely"], settings=settings)
        res.add(cfg.store.close)
        cfg.inbox = oncely.Inbox(cfg.store, consumer="ledger")
        res.add(cfg.inbox.close)
        prefp_store = oncely.SQLiteStore(paths["prefp"], settings=settings)
        res.add(prefp_store.close)
        cfg.prefp = oncely.Inbox(prefp_store, consumer="ledger", fingerprint=_precomputed)
        res.add(cfg.prefp.close)


def tx_batch(
    cfg: TxConfig, variant: str, msgs: list[tuple[str, Any]], runner: asyncio.Runner
) -> float:
    """Seconds to book ``msgs``, one transaction each."""
    cfg.sent[variant] += len(msgs)
    if not cfg.is_async:
        conn: sqlite3.Connection = cfg.raw if variant == "raw" else cfg.marker
        inbox: oncely.Inbox = cfg.prefp if variant == "prefp" else cfg.inbox

        def raw() -> None:
            for key, payload in msgs:
                conn.execute("BEGIN IMMEDIATE")
                try:
                    if variant == "marker":
                        conn.execute(CLAIM_SQL, marker_params(key, _TOKEN, _FP)).fetchall()
                    book(conn, payload)
                except BaseException:
                    conn.execute("ROLLBACK")
                    raise
                conn.execute("COMMIT")

        def with_oncely() -> None:
            for key, payload in msgs:
                expect(inbox.handle_in_transaction(key, payload, book), oncely.Outcome.PROCESSED)

        return timed(with_oncely if variant in ("oncely", "prefp") else raw)

    aconn: aiosqlite.Connection = cfg.raw if variant == "raw" else cfg.marker
    ainbox: oncely.AsyncInbox = cfg.prefp if variant == "prefp" else cfg.inbox

    async def araw() -> None:
        for key, payload in msgs:
            await aconn.execute("BEGIN IMMEDIATE")
            try:
                if variant == "marker":
                    await aconn.execute_fetchall(CLAIM_SQL, marker_params(key, _TOKEN, _FP))
                await book_async(aconn, payload)
            except BaseException:
                await aconn.execute("ROLLBACK")
                raise
            await aconn.execute("COMMIT")

    async def awith_oncely() -> None:
        for key, payload in msgs:
            expect(
                await ainbox.handle_in_transaction(key, payload, book_async),
                oncely.Outcome.PROCESSED,
            )

    return timed_async(runner, awith_oncely if variant in ("oncely", "prefp") else araw)


def check_tx(cfg: TxConfig, workdir: Path, extra_markers: int = 0) -> None:
    """Every message booked exactly once: ledger rows, balances and markers add up."""
    for variant in VARIANTS:
        if not cfg.sent[variant]:
            continue  # not run (the SQL trace runs three of the variants)
        conn = sqlite3.connect(cfg.path(workdir, variant))
        try:
            rows = conn.execute("SELECT count(*) FROM ledger").fetchone()[0]
            total = conn.execute("SELECT sum(balance_cents) FROM account").fetchone()[0]
            markers = rows
            if variant != "raw":
                found = conn.execute("SELECT count(*) FROM oncely_inbox").fetchone()[0]
                markers = found - (extra_markers if variant == "oncely" else 0)
        finally:
            conn.close()
        sent = cfg.sent[variant]
        if rows != sent or total != sent * AMOUNT_CENTS or markers != sent:
            raise BenchError(
                f"{cfg.name} {variant}: sent {sent}, ledger {rows}, markers {markers}, "
                f"balance {total}"
            )


def run_tx(workdir: Path, res: Resources, n: int, rounds: int, warmup: int) -> list[dict[str, Any]]:
    keys = Keys()
    configs = [
        TxConfig(is_async, sync) for is_async in (False, True) for sync in ("full", "normal")
    ]
    times: dict[str, dict[str, list[float]]] = {}
    for cfg in configs:
        open_tx(cfg, workdir, res)
        times[cfg.name] = {v: [] for v in VARIANTS}
        for v in VARIANTS:
            tx_batch(cfg, v, keys.batch(warmup), res.runner)
    for r in range(rounds):
        for cfg in configs:
            spent = dict.fromkeys(VARIANTS, 0.0)
            for c, size in enumerate(chunks(n)):
                for v in rotated(VARIANTS, r + c):
                    spent[v] += tx_batch(cfg, v, keys.batch(size), res.runner)
            for v in VARIANTS:
                times[cfg.name][v].append(us_per(spent[v], n))
    rows = []
    for cfg in configs:
        check_tx(cfg, workdir)
        t = times[cfg.name]
        rows.append(
            {
                "config": cfg.name,
                "raw": t["raw"],
                "marker": t["marker"],
                "oncely": t["oncely"],
                "prefp": t["prefp"],
                "ratios": [o / a for o, a in zip(t["oncely"], t["raw"], strict=True)],
                "prefp_ratios": [o / a for o, a in zip(t["prefp"], t["raw"], strict=True)],
                "marker_ratios": [m / a for m, a in zip(t["marker"], t["raw"], strict=True)],
            }
        )
    return rows
