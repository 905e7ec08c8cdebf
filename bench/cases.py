"""The measurements behind ``bench/run.py``: workloads, timed batches, SQL traces, profiles.

Every batch checks its outcomes, and the transactional section checks the ledger, balances and
markers at the end, so a broken path fails the run instead of reporting a fast number.
"""

from __future__ import annotations

import asyncio
import contextlib
import cProfile
import gc
import io
import os
import pstats
import re
import sqlite3
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import aiosqlite

import oncely
from oncely._core.flows import Step, decide
from oncely._core.keys import validate_key
from oncely._core.records import Status
from oncely._core.state import ClaimEvent, apply_claim
from oncely._dialects.sqlite import SQLiteDialect

TARGET_TX_RATIO = 1.3
TARGET_CORE_US = 20.0
ACCOUNTS = 100
AMOUNT_CENTS = 1250

# --------------------------------------------------------------------------- workload


def order(i: int) -> dict[str, Any]:
    """A realistic small message body (about 300 bytes of JSON): an order to book."""
    return {
        "order_id": f"ord-{i:08d}",
        "account": i % ACCOUNTS + 1,
        "amount_cents": AMOUNT_CENTS,
        "currency": "EUR",
        "customer": {"id": f"cus-{i % 977:05d}", "email": "a.user@example.com", "tier": "gold"},
        "items": [
            {"sku": "SKU-1001", "qty": 2, "price": "4.00"},
            {"sku": "SKU-2002", "qty": 1, "price": "4.50"},
        ],
        "created_at": "2026-01-01T12:00:00Z",
        "note": None,
    }


class Keys:
    """Fresh dedup keys: every batch of new messages uses keys never seen before."""

    def __init__(self) -> None:
        self._next = 0
        self._run = os.urandom(3).hex()

    def batch(self, n: int) -> list[tuple[str, dict[str, Any]]]:
        start = self._next
        self._next += n
        return [(f"bench-{self._run}-{i:08d}", order(i)) for i in range(start, start + n)]


class Resources:
    """Closes what the sections opened, even when a measurement fails: an unclosed aiosqlite
    connection keeps a non-daemon thread alive, and the interpreter would never exit."""

    def __init__(self, runner: asyncio.Runner) -> None:
        self.runner = runner
        self._closers: list[Callable[[], object]] = []

    def add(self, close: Callable[[], object]) -> None:
        self._closers.append(close)

    def add_async(self, thing: Any) -> None:
        """Close ``thing`` (an async store, inbox or aiosqlite connection) at the end."""
        close = getattr(thing, "aclose", None) or thing.close
        self._closers.append(lambda: self.runner.run(close()))

    def close(self) -> None:
        while self._closers:
            with contextlib.suppress(Exception):
                self._closers.pop()()


class BenchError(RuntimeError):
    """A measured path did not do what it should (wrong outcome, missing rows)."""


def expect(handled: oncely.Handled[Any], outcome: oncely.Outcome) -> None:
    if handled.outcome is not outcome:
        raise BenchError(
            f"key {handled.key!r}: expected {outcome.value}, got {handled.outcome.value} "
            f"({handled.reason})"
        )


def timed(run: Callable[[], None]) -> float:
    """Seconds taken by ``run``; the collector runs before, not during, the batch."""
    gc.collect()
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def timed_async(runner: asyncio.Runner, make: Callable[[], Awaitable[None]]) -> float:
    gc.collect()

    async def go() -> float:
        started = time.perf_counter()
        await make()
        return time.perf_counter() - started

    return runner.run(go())


T = TypeVar("T")
CHUNK = 100
"""Messages per interleaving step: a round runs its variants A/B/C, A/B/C, ... in chunks this
size, so a burst of load from elsewhere hits every variant of the round nearly alike."""


def chunks(n: int) -> list[int]:
    """``n`` messages as chunk sizes."""
    return [min(CHUNK, n - start) for start in range(0, n, CHUNK)]


def rotated(items: Sequence[T], by: int) -> list[T]:
    """``items`` rotated left by ``by``, so no variant always runs first after a switch."""
    k = by % len(items)
    return [*items[k:], *items[:k]]


def us_per(seconds: float, n: int) -> float:
    return seconds / n * 1e6


def med(values: Sequence[float]) -> float:
    return statistics.median(values)


# --------------------------------------------------------------------------- SQL tracing


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


# --------------------------------------------------------------------------- section: core


def run_core(n: int, rounds: int) -> list[dict[str, Any]]:
    limits = oncely.Limits()
    keys = [f"order-{i:08d}" for i in range(n)]
    payloads = [order(i) for i in range(n)]
    fps = [oncely.fingerprint(p) for p in payloads]
    token = os.urandom(16).hex()
    lease_ms, keep_ms = 30_000, 7 * 86_400_000
    now = time.time_ns() // 1_000_000
    done = [
        apply_claim(
            None, ClaimEvent("bench", k, fp, token, 0, keep_ms, True, Status.COMPLETED), now
        )[1].record
        for k, fp in zip(keys, fps, strict=True)
    ]

    def validate() -> None:
        for k in keys:
            validate_key(k, limits)

    def fingerprint() -> None:
        for p in payloads:
            oncely.fingerprint(p)

    def decide_new() -> None:
        for k, fp in zip(keys, fps, strict=True):
            claim = apply_claim(
                None, ClaimEvent("bench", k, fp, token, lease_ms, keep_ms, True), now
            )[1]
            if decide(claim, fp) is not Step.PROCEED:
                raise BenchError("a new key must proceed")

    def decide_dup() -> None:
        for k, fp, rec in zip(keys, fps, done, strict=True):
            claim = apply_claim(
                rec, ClaimEvent("bench", k, fp, token, lease_ms, keep_ms, True), now
            )[1]
            if decide(claim, fp) is not Step.DUPLICATE:
                raise BenchError("a completed key must be a duplicate")

    def whole() -> None:
        for k, p in zip(keys, payloads, strict=True):
            key = validate_key(k, limits)
            fp = oncely.fingerprint(p)
            claim = apply_claim(
                None, ClaimEvent("bench", key, fp, token, lease_ms, keep_ms, True), now
            )[1]
            if decide(claim, fp) is not Step.PROCEED:
                raise BenchError("a new key must proceed")

    steps: list[tuple[str, Callable[[], None]]] = [
        ("validate_key", validate),
        ("fingerprint (~300 B dict)", fingerprint),
        ("apply_claim + decide (new key)", decide_new),
        ("apply_claim + decide (duplicate)", decide_dup),
        ("total: validate + fingerprint + decide (new)", whole),
    ]
    for _, fn in steps:  # warm-up
        fn()
    samples: dict[str, list[float]] = {name: [] for name, _ in steps}
    for _ in range(rounds):
        for name, fn in steps:
            samples[name].append(us_per(timed(fn), n))
    return [{"step": name, "us": samples[name]} for name, _ in steps]


# --------------------------------------------------------------------------- section: two-phase


def trivial(_payload: object) -> None:
    return None


async def trivial_async(_payload: object) -> None:
    return None


@dataclass
class TwoPhaseCase:
    name: str
    is_async: bool
    make: Callable[[Path], Any]  # workdir -> store
    sqlite: bool


def twophase_cases() -> list[TwoPhaseCase]:
    normal = oncely.SQLiteSettings(synchronous="normal")
    cases = [
        TwoPhaseCase("MemoryStore", False, lambda d: oncely.MemoryStore(), False),
        TwoPhaseCase("SQLiteStore (full)", False, lambda d: oncely.SQLiteStore(d / "tp.db"), True),
        TwoPhaseCase(
            "SQLiteStore (normal)",
            False,
            lambda d: oncely.SQLiteStore(d / "tpn.db", settings=normal),
            True,
        ),
        TwoPhaseCase("AsyncMemoryStore", True, lambda d: oncely.AsyncMemoryStore(), False),
        TwoPhaseCase(
            "AsyncSQLiteStore (full)", True, lambda d: oncely.AsyncSQLiteStore(d / "atp.db"), True
        ),
        TwoPhaseCase(
            "AsyncSQLiteStore (normal)",
            True,
            lambda d: oncely.AsyncSQLiteStore(d / "atpn.db", settings=normal),
            True,
        ),
    ]
    return cases


def run_twophase(
    workdir: Path, res: Resources, n: int, rounds: int, warmup: int
) -> list[dict[str, Any]]:
    runner = res.runner
    keys = Keys()
    cases = twophase_cases()
    inboxes: list[Any] = []
    for case in cases:
        store = case.make(workdir)
        if case.is_async:
            inbox = oncely.AsyncInbox(store, consumer="bench")
            res.add_async(store)
            res.add_async(inbox)
        else:
            inbox = oncely.Inbox(store, consumer="bench")
            res.add(store.close)
            res.add(inbox.close)
        inboxes.append(inbox)

    def batch(case: TwoPhaseCase, inbox: Any, msgs: list[tuple[str, Any]]) -> tuple[float, float]:
        """(seconds for new keys, seconds for the same keys again)."""
        if case.is_async:

            async def new() -> None:
                for k, p in msgs:
                    expect(await inbox.handle(k, p, trivial_async), oncely.Outcome.PROCESSED)

            async def dup() -> None:
                for k, p in msgs:
                    expect(await inbox.handle(k, p, trivial_async), oncely.Outcome.DUPLICATE)

            return timed_async(runner, new), timed_async(runner, dup)

        def new_s() -> None:
            for k, p in msgs:
                expect(inbox.handle(k, p, trivial), oncely.Outcome.PROCESSED)

        def dup_s() -> None:
            for k, p in msgs:
                expect(inbox.handle(k, p, trivial), oncely.Outcome.DUPLICATE)

        return timed(new_s), timed(dup_s)

    new: dict[str, list[float]] = {c.name: [] for c in cases}
    dup: dict[str, list[float]] = {c.name: [] for c in cases}
    for case, inbox in zip(cases, inboxes, strict=True):
        batch(case, inbox, keys.batch(warmup))
    for r in range(rounds):
        spent_new = dict.fromkeys(new, 0.0)
        spent_dup = dict.fromkeys(dup, 0.0)
        for c, size in enumerate(chunks(n)):
            for i in rotated(range(len(cases)), r + c):
                a, b = batch(cases[i], inboxes[i], keys.batch(size))
                spent_new[cases[i].name] += a
                spent_dup[cases[i].name] += b
        for name, samples in new.items():
            samples.append(us_per(spent_new[name], n))
            dup[name].append(us_per(spent_dup[name], n))
    rows = []
    for case in cases:
        rows.append({"store": case.name, "path": "new key", "us": new[case.name]})
        rows.append({"store": case.name, "path": "duplicate", "us": dup[case.name]})
    return rows


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


# --------------------------------------------------------------------------- section: tx

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

VARIANTS = ("raw", "marker", "oncely")


@dataclass
class TxConfig:
    """One driver and ``synchronous`` setting: a database file and connection per variant."""

    is_async: bool
    synchronous: str
    raw: Any = None
    marker: Any = None
    store: Any = None
    inbox: Any = None
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


def tx_batch(
    cfg: TxConfig, variant: str, msgs: list[tuple[str, Any]], runner: asyncio.Runner
) -> float:
    """Seconds to book ``msgs``, one transaction each."""
    cfg.sent[variant] += len(msgs)
    if not cfg.is_async:
        conn: sqlite3.Connection = cfg.raw if variant == "raw" else cfg.marker
        inbox: oncely.Inbox = cfg.inbox

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

        return timed(with_oncely if variant == "oncely" else raw)

    aconn: aiosqlite.Connection = cfg.raw if variant == "raw" else cfg.marker
    ainbox: oncely.AsyncInbox = cfg.inbox

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

    return timed_async(runner, awith_oncely if variant == "oncely" else araw)


def check_tx(cfg: TxConfig, workdir: Path, extra_markers: int = 0) -> None:
    """Every message booked exactly once: ledger rows, balances and markers add up."""
    for variant in VARIANTS:
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
                "ratios": [o / a for o, a in zip(t["oncely"], t["raw"], strict=True)],
                "marker_ratios": [m / a for m, a in zip(t["marker"], t["raw"], strict=True)],
            }
        )
    return rows


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


# --------------------------------------------------------------------------- profiling


def profile(workdir: Path, res: Resources, n: int, top: int) -> str:
    """cProfile of the sync transactional and two-phase paths (SQLiteStore), per setting,
    and of the two-phase path on the MemoryStore (oncely's Python alone): the top functions
    by own time, then oncely's functions by cumulative time."""
    out = io.StringIO()
    keys = Keys()
    memory = oncely.Inbox(oncely.MemoryStore(), consumer="bench")
    res.add(memory.close)
    msgs = keys.batch(n)
    for k, p in keys.batch(200):
        memory.handle(k, p, trivial)
    gc.collect()
    prof = cProfile.Profile()
    prof.enable()
    for k, p in msgs:
        expect(memory.handle(k, p, trivial), oncely.Outcome.PROCESSED)
    prof.disable()
    out.write(
        stats_text(prof, f"two-phase mode (handle, new keys), MemoryStore, {n} messages", top, n)
    )
    for sync in ("normal", "full"):
        settings = oncely.SQLiteSettings(synchronous=sync)
        path = workdir / f"prof-tx-{sync}.db"
        create_business_schema(path)
        store = oncely.SQLiteStore(path, settings=settings)
        res.add(store.close)
        inbox = oncely.Inbox(store, consumer="ledger")

        def tx(msgs: list[tuple[str, Any]], inbox: oncely.Inbox = inbox) -> None:
            for k, p in msgs:
                expect(inbox.handle_in_transaction(k, p, book), oncely.Outcome.PROCESSED)

        store2 = oncely.SQLiteStore(workdir / f"prof-tp-{sync}.db", settings=settings)
        res.add(store2.close)
        inbox2 = oncely.Inbox(store2, consumer="bench")
        res.add(inbox2.close)

        def tp(msgs: list[tuple[str, Any]], inbox: oncely.Inbox = inbox2) -> None:
            for k, p in msgs:
                expect(inbox.handle(k, p, trivial), oncely.Outcome.PROCESSED)

        for what, run in (
            ("transactional mode (handle_in_transaction)", tx),
            ("two-phase mode (handle, new keys)", tp),
        ):
            run(keys.batch(200))  # warm-up
            msgs = keys.batch(n)
            gc.collect()
            prof = cProfile.Profile()
            prof.enable()
            run(msgs)
            prof.disable()
            header = f"{what}, sync SQLiteStore, synchronous={sync}, {n} messages"
            out.write(stats_text(prof, header, top, n))
    return out.getvalue()


def stats_text(prof: cProfile.Profile, header: str, top: int, n: int) -> str:
    """The profile in microseconds per message: top functions by own time, then oncely's
    functions by cumulative time (profiler overhead inflates every figure alike)."""
    st = pstats.Stats(prof)
    raw = st.stats  # {(file, line, function): (primitive calls, calls, own, cumulative, ...)}
    total = sum(v[2] for v in raw.values())
    rows = [(where(f), nc, tt / n * 1e6, ct / n * 1e6) for f, (_, nc, tt, ct, _c) in raw.items()]
    out = [f"\n=== {header}: {total / n * 1e6:.1f} us/message under the profiler ==="]

    def table(title: str, picked: list[tuple[str, int, float, float]]) -> None:
        out.append(f"--- {title} ---")
        out.append(f"{'calls/msg':>9}  {'own us/msg':>10}  {'cum us/msg':>10}  function")
        for name, nc, tt, ct in picked:
            out.append(f"{nc / n:9.1f}  {tt:10.1f}  {ct:10.1f}  {name}")

    table("by own time", sorted(rows, key=lambda r: -r[2])[:top])
    mine = [r for r in rows if r[0].startswith("oncely/")]
    table("oncely's functions by cumulative time", sorted(mine, key=lambda r: -r[3])[:top])
    return "\n".join(out) + "\n"


def where(func: tuple[str, int, str]) -> str:
    """``oncely/_sync/inbox_two_phase.py:44 handle`` rather than a full path."""
    path, line, name = func
    if path == "~":
        return name  # a C function: "<method 'execute' of 'sqlite3.Connection' objects>"
    marker = "/src/"
    short = path.split(marker, 1)[1] if marker in path else Path(path).name
    return f"{short}:{line} {name}"
