"""The servers section of ``bench/run.py`` (``--only servers``): oncely's PostgreSQL, MariaDB and
Redis stores against their raw floors, and Redis against AWS Lambda Powertools' idempotency.

Per store, measured side by side in interleaved rounds (like the SQLite sections):

two-phase
    ``Inbox.handle`` with a trivial handler, new keys then the same keys again (duplicates),
    against the **raw floor**: the same driver running the store's own statements (PostgreSQL,
    MariaDB) or Lua scripts (Redis, ``EVALSHA``) by hand, with no oncely Python. On Redis also
    Powertools' ``idempotent_function`` with its Redis layer (:mod:`powertools_case`).
tx (PostgreSQL, MariaDB)
    ``Inbox.handle_in_transaction`` against the same business transaction written by hand
    (``BEGIN; INSERT ledger; UPDATE account; COMMIT``): oncely opening its own transaction,
    and joining the caller's with ``savepoint=False`` and with the default savepoint.
batch
    ``store.claim_many`` of 100 keys against 100 ``store.claim`` calls.

For every case: wall time per message (median over rounds), client CPU per message
(``time.process_time()`` around the timed loop, so the server's CPU is not in it), and round
trips per message, counted on the wire in a separate pass: a counting redis-py connection
class, libpq's own protocol trace (one round trip per ``Sync`` or simple ``Query`` message),
and a counting wrapper of PyMySQL's ``Connection._execute_command``. Every batch checks its
outcomes, the transactional databases are checked row by row at the end, and every table and
key the section created is dropped or deleted when it ends (also when it fails).

Servers come from ``ONCELY_BENCH_{POSTGRES,MYSQL,REDIS}_URL`` (default: the test servers'
variables, then this machine's defaults). A server that does not answer, or a missing driver,
skips that store with the reason; it never fails the other sections.
"""

from __future__ import annotations

import contextlib
import cProfile
import gc
import importlib
import importlib.util
import io
import itertools
import os
import re
import resource
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from cases import (
    ACCOUNTS,
    AMOUNT_CENTS,
    CHUNK,
    BenchError,
    Keys,
    Resources,
    chunks,
    expect,
    order,
    rotated,
    trivial,
    us_per,
)
from powertools_case import POWERTOOLS_REQUIREMENT, PowertoolsCase, powertools_version
from profiles import stats_text

import oncely
from oncely._dialects import redis as redis_dialect
from oncely._dialects.mysql import MySQLDialect
from oncely._dialects.postgres import PostgresDialect

# Targets of issue 3 ("Done when", benchmark item).
TARGET_REDIS_TRIPS_NEW = 2
TARGET_REDIS_TRIPS_DUP = 1
TARGET_CPU_SHARE = 0.5  # oncely's client CPU per message at most half of Powertools'
TARGET_SPEEDUP_NEW = 1.3  # oncely's throughput vs Powertools, new keys
TARGET_SPEEDUP_DUP = 2.5  # ... duplicates
TARGET_TX_EXTRA_TRIPS = 1  # round trips oncely adds to the caller's transaction
TARGET_FLOOR_RATIO = 1.5  # every per-message path within 1.5x of its raw floor
TARGET_BATCH_SPEEDUP = 10.0  # claim_many of 100 keys vs per-message claims
BATCH = 100

RUN = os.urandom(3).hex()
LEASE_MS = oncely.Lease().duration_ms
KEEP_MS = oncely.Retention().keep_ms
SPAN_MS = max(KEEP_MS, LEASE_MS)
FP = oncely.fingerprint(order(0))
"""The raw floors send a fingerprint of the same size as oncely's, computed once: the floor
measures the driver and the server, not oncely's Python."""


def _env(*names: str, default: str) -> str:
    for name in names:
        if os.environ.get(name):
            return os.environ[name]
    return default


POSTGRES_URL = _env(
    "ONCELY_BENCH_POSTGRES_URL",
    "ONCELY_TEST_POSTGRES_DSN",
    default="postgresql://postgres@127.0.0.1:5432/test",
)
MYSQL_URL = _env(
    "ONCELY_BENCH_MYSQL_URL", "ONCELY_TEST_MYSQL_URL", default="mysql://root@127.0.0.1:3306/test"
)
REDIS_URL = _env(
    "ONCELY_BENCH_REDIS_URL", "ONCELY_TEST_REDIS_URL", default="redis://127.0.0.1:6379/0"
)


def with_option(url: str, name: str, value: str) -> str:
    return f"{url}{'&' if '?' in url else '?'}{name}={value}"


def driver(name: str) -> Any:
    """A driver module (or an oncely module that needs one), imported on first use: a missing
    driver skips its store instead of failing the whole run."""
    return importlib.import_module(name)


def answers(url: str, default_port: int) -> bool:
    parts = urlsplit(url)
    try:
        with socket.create_connection(
            (parts.hostname or "127.0.0.1", parts.port or default_port), 2
        ):
            return True
    except OSError:
        return False


class Tokens:
    """Fencing tokens for the raw floors, made the way oncely makes them (a random prefix and
    a counter): unique, and as cheap as oncely's."""

    def __init__(self) -> None:
        self._prefix = os.urandom(8).hex()
        self._count = itertools.count()

    def __call__(self) -> str:
        return f"{self._prefix}{next(self._count):016x}"


# --------------------------------------------------------------------------- round trips


class Trips:
    """Round trips seen while :meth:`measure` is active, with a short label each.

    Drivers report through :meth:`hit` as they send (redis-py, PyMySQL); libpq's trace is
    read when the measurement ends, through the ``hooks``."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.active = False
        self.seq: list[str] = []
        self.hooks: list[tuple[Callable[[], None], Callable[[], None]]] = []

    def hit(self, what: str) -> None:
        if self.active:
            self.seq.append(what)

    @contextlib.contextmanager
    def measure(self) -> Iterator[None]:
        self.seq = []
        self.active = True
        for start, _ in self.hooks:
            start()
        try:
            yield
        finally:
            for _, stop in self.hooks:
                stop()
            self.active = False


def per_message(seq: list[str], n: int) -> tuple[float, list[str]]:
    """(round trips per message, the labels of one message's round trips)."""
    one = seq[: len(seq) // n] if n and len(seq) % n == 0 else []
    return len(seq) / n, one


_VERB = re.compile(
    r"\b(INSERT INTO|UPDATE|DELETE FROM|SELECT\b.*?\bFROM)\s+([\w.\"`]+)", re.IGNORECASE | re.DOTALL
)


def sql_label(sql: str) -> str:
    """``INSERT inbox``, ``claim (INSERT ON CONFLICT)``, ``BEGIN`` ... for a statement."""
    text = " ".join(sql.split())
    upper = text.upper()
    if "UNNEST(" in upper:
        return "claim_many (INSERT ... unnest)"
    if upper.startswith("WITH") and "INSERT INTO" in upper and "ON CONFLICT" in upper:
        return "claim (INSERT ON CONFLICT + read)"
    m = _VERB.search(text)
    if m:
        table = m.group(2).replace('"', "").replace("`", "").split(".")[-1]
        table = table.replace(f"bench_{RUN}_", "").replace(f"bench_{RUN}", "inbox")
        name = f"{m.group(1).split()[0].upper()} {table}"
        if "ON DUPLICATE KEY" in upper:
            name += " ON DUPLICATE KEY"
        elif "ON CONFLICT" in upper:
            name += " ON CONFLICT"
        if upper.endswith("FOR UPDATE"):
            name += " FOR UPDATE"
        return name
    return " ".join(text.split()[:2]).rstrip(";")


# libpq trace lines (REGRESS_MODE, no timestamps): "F\t<len>\t<Message>\t<fields>"; a statement
# with newlines continues on the following lines.
_PQ_LINE = re.compile(r"^([FB])\t\d+\t(\w+)(.*)$")
_PQ_PARSE = re.compile(r'^\s*"([^"]*)" "(.*)" \d+', re.DOTALL)
_PQ_BIND = re.compile(r'^\s*"[^"]*" "([^"]*)"')
_PQ_QUERY = re.compile(r'^\s*"(.*)"\s*$', re.DOTALL)


def pq_round_trips(text: str, named: dict[str, str], *, count: bool = True) -> list[str]:
    """One label per round trip in a libpq protocol trace: a ``Sync`` ends an extended-protocol
    exchange (Parse/Bind/Execute), a ``Query`` is a simple-protocol one (BEGIN, COMMIT,
    SAVEPOINT). A Parse followed by a Sync without a Bind is psycopg preparing a statement.
    ``named`` maps prepared statements to their text, across calls (a statement is prepared
    once per connection, usually before the part of the trace that is counted)."""
    messages: list[list[str]] = []
    for line in text.split("\n"):
        m = _PQ_LINE.match(line)
        if m:
            messages.append([m.group(1), m.group(2), m.group(3)])
        elif messages:
            messages[-1][2] += "\n" + line
    current, bound = "", False
    out: list[str] = []
    for side, kind, rest in messages:
        if side != "F":
            continue
        if kind == "Parse":
            pm = _PQ_PARSE.match(rest)
            if pm:
                named[pm.group(1)] = current = pm.group(2)
            bound = False
        elif kind == "Bind":
            bm = _PQ_BIND.match(rest)
            if bm and bm.group(1):
                current = named.get(bm.group(1), "?")
            bound = True
        elif kind == "Sync":
            out.append(sql_label(current) if bound else f"PREPARE {sql_label(current)}")
            bound = False
        elif kind == "Query":
            qm = _PQ_QUERY.match(rest)
            out.append(sql_label(qm.group(1) if qm else rest))
    return out if count else []


def trace_libpq(trips: Trips, conn: Any, workdir: Path) -> None:
    """Count ``conn``'s round trips (a psycopg connection) with libpq's protocol trace, which
    runs from now on for the connection's life, into a file under ``workdir``; each
    measurement reads what was appended since it started."""
    pq = driver("psycopg.pq")

    fd, name = tempfile.mkstemp(prefix="pq-", suffix=".txt", dir=workdir)
    path = Path(name)
    named: dict[str, str] = {}
    state = {"read": 0, "start": 0}

    def trace() -> None:
        conn.pgconn.trace(fd)
        conn.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)

    def flushed() -> bytes:
        conn.pgconn.untrace()  # flushes libpq's stream; tracing resumes at once
        data = path.read_bytes()
        trace()
        return data

    def start() -> None:
        state["start"] = len(flushed())

    def stop() -> None:
        data = flushed()
        # What ran between two measurements (warm-up) only teaches the prepared names.
        between = data[state["read"] : state["start"]]
        pq_round_trips(between.decode(errors="replace"), named, count=False)
        for label in pq_round_trips(data[state["start"] :].decode(errors="replace"), named):
            trips.hit(label)
        state["read"] = len(data)

    trace()
    trips.hooks.append((start, stop))


@contextlib.contextmanager
def counting_pymysql(trips: Trips) -> Iterator[None]:
    """Count every command PyMySQL sends (each one waits for its reply: one round trip), for
    as long as the block runs. PyMySQL has no hook: the method is wrapped on the class."""
    pc = driver("pymysql.connections")

    original = pc.Connection._execute_command

    def counted(self: Any, command: int, sql: Any) -> Any:
        text = sql.decode("utf-8", "replace") if isinstance(sql, bytes | bytearray) else str(sql)
        trips.hit(sql_label(text) if text else f"command {command}")
        return original(self, command, sql)

    pc.Connection._execute_command = counted
    try:
        yield
    finally:
        pc.Connection._execute_command = original


_RESP = re.compile(rb"^\*\d+\r\n\$\d+\r\n([A-Za-z]+)\r\n(?:\$\d+\r\n([^\r\n]*)\r\n)?")


def counting_redis_client(url: str, trips: Trips, *, decode_responses: bool = False) -> Any:
    """A redis-py client whose connections report each send (one round trip: a command, or
    a whole pipeline) to ``trips``, labelled ``EVALSHA claim``, ``SET NX``, ``GET`` ..."""
    redis = driver("redis")
    scripts = {
        s.sha.encode(): s.name
        for s in (
            redis_dialect.CLAIM,
            redis_dialect.CLAIM_MANY,
            redis_dialect.COMPLETE,
            redis_dialect.RELEASE,
        )
    }

    class Counting(redis.Connection):
        def send_packed_command(self, command: Any, check_health: bool = True) -> None:
            if trips.active:
                data = command if isinstance(command, bytes) else b"".join(command)
                m = _RESP.match(data)
                name = m.group(1).decode().upper() if m else "?"
                if name == "EVALSHA" and m is not None and m.group(2) is not None:
                    name = f"EVALSHA {scripts.get(m.group(2), '?')}"
                elif name == "SET" and b"\r\nNX\r\n" in data.upper():
                    name = "SET NX"
                trips.hit(name)
            super().send_packed_command(command, check_health)

    pool = redis.ConnectionPool.from_url(
        url, connection_class=Counting, decode_responses=decode_responses
    )
    return redis.Redis(connection_pool=pool)


# --------------------------------------------------------------------------- cases


@dataclass
class Variant:
    """One way of processing a batch of messages: ``new`` for fresh keys, ``dup`` for the same
    keys again (None where only new keys make sense). Each checks its own outcomes."""

    name: str
    new: Callable[[list[tuple[str, Any]]], None]
    dup: Callable[[list[tuple[str, Any]]], None] | None = None


@dataclass
class Group:
    """Variants compared with one another, side by side: the first is the baseline."""

    store: str
    kind: str  # "twophase" | "tx" | "batch"
    variants: list[Variant]


def oncely_variants(inbox: Any) -> Variant:
    def new(msgs: list[tuple[str, Any]]) -> None:
        for k, p in msgs:
            expect(inbox.handle(k, p, trivial), oncely.Outcome.PROCESSED)

    def dup(msgs: list[tuple[str, Any]]) -> None:
        for k, p in msgs:
            expect(inbox.handle(k, p, trivial), oncely.Outcome.DUPLICATE)

    return Variant("oncely", new, dup)


def batch_variants(store: Any, consumer: str) -> list[Variant]:
    """100 ``store.claim`` calls against one ``store.claim_many`` of the same 100 keys (fresh
    keys, precomputed fingerprint: the store's work alone)."""
    tokens = Tokens()

    def each(msgs: list[tuple[str, Any]]) -> None:
        for k, _p in msgs:
            claim = store.claim(
                consumer,
                k,
                fingerprint=FP,
                token=tokens(),
                lease_ms=LEASE_MS,
                keep_ms=KEEP_MS,
                takeover=True,
            )
            if claim.status is not oncely.ClaimStatus.NEW:
                raise BenchError(f"claim of new key {k!r}: {claim.status}")

    def many(msgs: list[tuple[str, Any]]) -> None:
        claims = store.claim_many(
            consumer,
            [oncely.ClaimRequest(k, FP, tokens()) for k, _p in msgs],
            lease_ms=LEASE_MS,
            keep_ms=KEEP_MS,
            takeover=True,
        )
        if len(claims) != len(msgs) or any(c.status is not oncely.ClaimStatus.NEW for c in claims):
            raise BenchError("claim_many of new keys did not win every key")

    return [Variant("store.claim x100", each), Variant("store.claim_many(100)", many)]


class Server:
    """One server store: its groups of variants (timed, or counting round trips), the end-of-run
    checks and the clean-up."""

    name = ""
    url = ""
    port = 0
    driver = ""
    module = ""

    def unavailable(self) -> str | None:
        if importlib.util.find_spec(self.driver) is None:
            return f"the {self.driver} driver is not installed"
        if importlib.util.find_spec(self.module) is None:
            return f"this oncely has no {self.module} yet"
        if not answers(self.url, self.port):
            return f"nothing answers at {oncely.redact(self.url)}"
        return None

    def groups(self, res: Resources, trips: Trips | None) -> list[Group]:
        raise NotImplementedError

    def check(self) -> None:
        """Verify the transactional books at the end (databases only)."""

    def version(self) -> str:
        return "?"

    def cleanup(self) -> None:
        raise NotImplementedError


# --------------------------------------------------------------------------- PostgreSQL

PG_LEDGER = "INSERT INTO {ledger} (account_id, amount_cents, ref) VALUES (%s, %s, %s)"
PG_BALANCE = "UPDATE {account} SET balance_cents = balance_cents + %s WHERE id = %s"
TX_VARIANTS = ("raw", "marker", "own", "joined", "joined_sp")
TX_NAMES = {
    "raw": "raw",
    "marker": "raw + marker",
    "own": "oncely (own tx)",
    "joined": "oncely (tx=, savepoint=False)",
    "joined_sp": "oncely (tx=, savepoint=True)",
}


class Postgres(Server):
    name = "PostgreSQL"
    port = 5432
    driver = "psycopg"
    module = "oncely._sync.postgres"

    def __init__(self) -> None:
        self.url = POSTGRES_URL
        self.table = f"bench_{RUN}"
        self.store_url = with_option(self.url, "table", self.table)
        self.sent = dict.fromkeys(TX_VARIANTS, 0)
        self.created = False

    def _conninfo(self) -> str:
        return str(driver("oncely._drivers.postgres").parse_url(self.url).conninfo)

    def connect(self, trips: Trips | None) -> Any:
        conn = driver("psycopg").connect(self._conninfo(), autocommit=True)
        if trips is not None:
            trace_libpq(trips, conn, trips.workdir)
        return conn

    def store(self, res: Resources, trips: Trips | None) -> Any:
        """The store as a user opens it (``oncely.open(url)``, its own pool), or, to count round
        trips, on a one-connection pool of ours whose connection libpq traces (the same store
        code: only who owns the pool differs)."""
        if trips is None:
            store = oncely.open(self.store_url)
        else:
            pool: Any = driver("psycopg_pool").ConnectionPool(
                self._conninfo(), min_size=1, max_size=1, kwargs={"autocommit": True}, open=True
            )
            res.add(pool.close)
            pool.wait()
            conn = pool.getconn()
            pool.putconn(conn)
            trace_libpq(trips, conn, trips.workdir)
            store = oncely.PostgresStore(pool, table=self.table)
        res.add(store.close)
        return store

    def _tables(self) -> None:
        if self.created:
            return
        conn = self.connect(None)
        try:
            setup = oncely.PostgresStore(self._conninfo(), table=self.table)
            setup.migrate()
            setup.close()
            for v in TX_VARIANTS:
                ledger, account = f"{self.table}_ledger_{v}", f"{self.table}_account_{v}"
                conn.execute(
                    f"CREATE TABLE {ledger} (id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY, "
                    "account_id INTEGER NOT NULL, amount_cents BIGINT NOT NULL, ref TEXT NOT NULL)"
                )
                conn.execute(
                    f"CREATE TABLE {account} "
                    "(id INTEGER PRIMARY KEY, balance_cents BIGINT NOT NULL)"
                )
                conn.execute(
                    f"INSERT INTO {account} SELECT g, 0 FROM generate_series(1, {ACCOUNTS}) g"
                )
        finally:
            conn.close()
        self.created = True

    def groups(self, res: Resources, trips: Trips | None) -> list[Group]:
        self._tables()
        d = PostgresDialect("public", self.table)
        tokens = Tokens()
        store = self.store(res, trips)

        # ---- two-phase: the store's claim and complete statements by hand
        raw = self.connect(trips)
        res.add(raw.close)

        def claim_params(key: str) -> dict[str, Any]:
            return {
                "consumer": "raw",
                "key": key,
                "status": "in_progress",
                "fingerprint": FP,
                "token": tokens(),
                "lease": LEASE_MS,
                "span": SPAN_MS,
                "error": None,
                "now": None,
            }

        def raw_new(msgs: list[tuple[str, Any]]) -> None:
            for k, p in msgs:
                params = claim_params(k)
                rows = raw.execute(d.claim, params).fetchall()
                if not rows or rows[0][0] is not True:
                    raise BenchError(f"raw claim of new key {k!r} did not insert")
                trivial(p)
                done = {
                    "now": None,
                    "consumer": "raw",
                    "key": k,
                    "token": params["token"],
                    "keep": KEEP_MS,
                    "result": None,
                    "note": None,
                }
                if not raw.execute(d.complete, done).fetchall():
                    raise BenchError(f"raw complete of {k!r} matched nothing")

        def raw_dup(msgs: list[tuple[str, Any]]) -> None:
            for k, _p in msgs:
                rows = raw.execute(d.claim, claim_params(k)).fetchall()
                if not rows or rows[0][0] is not False or rows[0][1] != "completed":
                    raise BenchError(f"raw claim of completed key {k!r}: {rows[:1]}")

        inbox = oncely.Inbox(store, consumer="twophase")
        res.add(inbox.close)
        twophase = Group(self.name, "twophase", [Variant("raw", raw_new, raw_dup)])
        twophase.variants.append(oncely_variants(inbox))

        # ---- transactional: the business transaction, by hand and through oncely
        def book_for(v: str) -> Callable[[Any, dict[str, Any]], None]:
            ledger = PG_LEDGER.format(ledger=f"{self.table}_ledger_{v}")
            balance = PG_BALANCE.format(account=f"{self.table}_account_{v}")

            def book(conn: Any, payload: dict[str, Any]) -> None:
                conn.execute(
                    ledger, (payload["account"], payload["amount_cents"], payload["order_id"])
                )
                conn.execute(balance, (payload["amount_cents"], payload["account"]))

            return book

        counted = trips is None  # the trace pass books too, but is not checked against `sent`
        tx_raw = self.connect(trips)
        res.add(tx_raw.close)
        book_raw = book_for("raw")

        def tx_raw_new(msgs: list[tuple[str, Any]]) -> None:
            for _k, p in msgs:
                with tx_raw.transaction():
                    book_raw(tx_raw, p)
            self.sent["raw"] += len(msgs) if counted else 0

        tx_marker = self.connect(trips)
        res.add(tx_marker.close)
        book_marker = book_for("marker")

        def tx_marker_new(msgs: list[tuple[str, Any]]) -> None:
            for k, p in msgs:
                with tx_marker.transaction():
                    rows = tx_marker.execute(d.claim, marker_params(k, tokens())).fetchall()
                    if not rows or rows[0][0] is not True:
                        raise BenchError(f"raw marker of new key {k!r} did not insert")
                    book_marker(tx_marker, p)
            self.sent["marker"] += len(msgs) if counted else 0

        own_inbox = oncely.Inbox(store, consumer="tx-own")
        res.add(own_inbox.close)
        book_own = book_for("own")

        def tx_own_new(msgs: list[tuple[str, Any]]) -> None:
            for k, p in msgs:
                expect(own_inbox.handle_in_transaction(k, p, book_own), oncely.Outcome.PROCESSED)
            self.sent["own"] += len(msgs) if counted else 0

        def joined(v: str, savepoint: bool) -> Variant:
            user = self.connect(trips)
            res.add(user.close)
            jinbox = oncely.Inbox(store, consumer=f"tx-{v}")
            res.add(jinbox.close)
            book = book_for(v)

            def run(msgs: list[tuple[str, Any]]) -> None:
                for k, p in msgs:
                    with user.transaction():
                        expect(
                            jinbox.handle_in_transaction(k, p, book, tx=user, savepoint=savepoint),
                            oncely.Outcome.PROCESSED,
                        )
                self.sent[v] += len(msgs) if counted else 0

            return Variant(TX_NAMES[v], run)

        tx = Group(
            self.name,
            "tx",
            [
                Variant("raw", tx_raw_new),
                Variant(TX_NAMES["marker"], tx_marker_new),
                Variant(TX_NAMES["own"], tx_own_new),
                joined("joined", False),
                joined("joined_sp", True),
            ],
        )
        batch = Group(self.name, "batch", batch_variants(store, "batch"))
        return [twophase, tx, batch]

    def check(self) -> None:
        conn = self.connect(None)
        try:
            for v in TX_VARIANTS:
                rows, total = conn.execute(
                    f"SELECT count(*), coalesce(sum(amount_cents), 0) FROM {self.table}_ledger_{v}"
                ).fetchone()
                balance = conn.execute(
                    f"SELECT sum(balance_cents) FROM {self.table}_account_{v}"
                ).fetchone()[0]
                markers = rows
                if v != "raw":
                    markers = conn.execute(
                        f"SELECT count(*) FROM {self.table} WHERE consumer = %s", (f"tx-{v}",)
                    ).fetchone()[0]
                check_books(self.name, v, self.sent[v], rows, total, balance, markers)
        finally:
            conn.close()

    def version(self) -> str:
        conn = self.connect(None)
        try:
            return str(conn.execute("SHOW server_version").fetchone()[0]).split()[0]
        finally:
            conn.close()

    def cleanup(self) -> None:
        conn = self.connect(None)
        try:
            names = [self.table, f"{self.table}_meta"]
            for v in TX_VARIANTS:
                names += [f"{self.table}_ledger_{v}", f"{self.table}_account_{v}"]
            conn.execute("DROP TABLE IF EXISTS " + ", ".join(names))
        finally:
            conn.close()


def marker_params(key: str, token: str) -> dict[str, Any]:
    """oncely's claim parameters for a transactional marker (status completed, no lease), for
    the hand-run "raw + marker" variant (PostgreSQL form; MariaDB binds bytes)."""
    return {
        "consumer": "tx-marker",
        "key": key,
        "status": "completed",
        "fingerprint": FP,
        "token": token,
        "lease": 0,
        "span": SPAN_MS,
        "error": None,
        "now": None,
    }


def check_books(
    store: str, variant: str, sent: int, rows: int, total: int, balance: int, markers: int
) -> None:
    """Exactly one ledger row, one balance increment and one marker per message sent."""
    if rows != sent or int(total) != sent * AMOUNT_CENTS or int(balance) != sent * AMOUNT_CENTS:
        raise BenchError(
            f"{store} tx {variant}: sent {sent}, ledger {rows} rows / {total}, balance {balance}"
        )
    if markers != sent:
        raise BenchError(f"{store} tx {variant}: sent {sent} but {markers} markers")


# --------------------------------------------------------------------------- MariaDB

MY_LEDGER = "INSERT INTO {ledger} (account_id, amount_cents, ref) VALUES (%s, %s, %s)"
MY_BALANCE = "UPDATE {account} SET balance_cents = balance_cents + %s WHERE id = %s"


class MariaDB(Server):
    name = "MariaDB"
    port = 3306
    driver = "pymysql"
    module = "oncely._sync.mysql"

    def __init__(self) -> None:
        self.url = MYSQL_URL
        self.table = f"bench_{RUN}"
        self.store_url = with_option(self.url, "table", self.table)
        self.sent = dict.fromkeys(TX_VARIANTS, 0)
        self.created = False

    def connect(self) -> Any:
        """A PyMySQL connection set up exactly as the store's (autocommit, FOUND_ROWS, the
        same session settings)."""
        s = driver("oncely._drivers.mysql").parse_url(self.url).settings
        return driver("pymysql").connect(database=s.database, **s.connect_kwargs())

    def _tables(self) -> None:
        if self.created:
            return
        setup = oncely.open(self.store_url)
        setup.migrate()
        setup.close()
        conn = self.connect()
        try:
            with conn.cursor() as cur:
                for v in TX_VARIANTS:
                    ledger, account = f"{self.table}_ledger_{v}", f"{self.table}_account_{v}"
                    cur.execute(
                        f"CREATE TABLE {ledger} (id BIGINT AUTO_INCREMENT PRIMARY KEY, "
                        "account_id INT NOT NULL, amount_cents BIGINT NOT NULL, "
                        "ref VARCHAR(64) NOT NULL) ENGINE=InnoDB"
                    )
                    cur.execute(
                        f"CREATE TABLE {account} (id INT PRIMARY KEY, "
                        "balance_cents BIGINT NOT NULL) ENGINE=InnoDB"
                    )
                    cur.executemany(
                        f"INSERT INTO {account} (id, balance_cents) VALUES (%s, 0)",
                        [(i,) for i in range(1, ACCOUNTS + 1)],
                    )
        finally:
            conn.close()
        self.created = True

    def groups(self, res: Resources, trips: Trips | None) -> list[Group]:
        self._tables()
        d = MySQLDialect(self.table)
        tokens = Tokens()
        store = oncely.open(self.store_url)
        res.add(store.close)
        fp = FP.encode()

        raw = self.connect()
        res.add(raw.close)

        def claim_params(key: str) -> dict[str, Any]:
            return {
                "consumer": b"raw",
                "key": key.encode(),
                "status": "in_progress",
                "fingerprint": fp,
                "token": tokens().encode(),
                "lease": LEASE_MS,
                "span": SPAN_MS,
                "error": None,
                "now": None,
            }

        def raw_new(msgs: list[tuple[str, Any]]) -> None:
            for k, p in msgs:
                params = claim_params(k)
                with raw.cursor() as cur:
                    cur.execute(d.insert, params)
                    inserted = cur.lastrowid
                if not inserted:
                    raise BenchError(f"raw claim of new key {k!r} did not insert")
                trivial(p)
                # complete, as the store does it: read the row, then compare-and-set
                with raw.cursor() as cur:
                    cur.execute(d.read, params)
                    row = cur.fetchone()
                now = int(row[10])
                values = {
                    "consumer": b"raw",
                    "key": params["key"],
                    "token": row[2],
                    "status": row[0],
                    "updated": row[5],
                    "lease_until": row[6],
                    "expires": row[7],
                    "n_status": "completed",
                    "n_fingerprint": row[1],
                    "n_token": row[2],
                    "n_attempt": row[3],
                    "n_created": row[4],
                    "n_updated": now,
                    "n_lease_until": row[6],
                    "n_expires": now + KEEP_MS,
                    "n_result": None,
                    "n_error": None,
                }
                with raw.cursor() as cur:
                    if cur.execute(d.write, values) != 1:
                        raise BenchError(f"raw complete of {k!r} matched nothing")

        def raw_dup(msgs: list[tuple[str, Any]]) -> None:
            for k, _p in msgs:
                params = claim_params(k)
                with raw.cursor() as cur:
                    cur.execute(d.insert, params)
                    if cur.lastrowid:
                        raise BenchError(f"raw claim of completed key {k!r} inserted")
                    cur.execute(d.read, params)
                    row = cur.fetchone()
                if row is None or row[0] != "completed":
                    raise BenchError(f"raw read of completed key {k!r}: {row}")

        inbox = oncely.Inbox(store, consumer="twophase")
        res.add(inbox.close)
        twophase = Group(self.name, "twophase", [Variant("raw", raw_new, raw_dup)])
        twophase.variants.append(oncely_variants(inbox))

        def book_for(v: str) -> Callable[[Any, dict[str, Any]], None]:
            ledger = MY_LEDGER.format(ledger=f"{self.table}_ledger_{v}")
            balance = MY_BALANCE.format(account=f"{self.table}_account_{v}")

            def book(conn: Any, payload: dict[str, Any]) -> None:
                with conn.cursor() as cur:
                    cur.execute(
                        ledger, (payload["account"], payload["amount_cents"], payload["order_id"])
                    )
                    cur.execute(balance, (payload["amount_cents"], payload["account"]))

            return book

        counted = trips is None
        tx_raw = self.connect()
        res.add(tx_raw.close)
        book_raw = book_for("raw")

        def tx_raw_new(msgs: list[tuple[str, Any]]) -> None:
            for _k, p in msgs:
                tx_raw.begin()
                try:
                    book_raw(tx_raw, p)
                except BaseException:
                    tx_raw.rollback()
                    raise
                tx_raw.commit()
            self.sent["raw"] += len(msgs) if counted else 0

        tx_marker = self.connect()
        res.add(tx_marker.close)
        book_marker = book_for("marker")

        def tx_marker_new(msgs: list[tuple[str, Any]]) -> None:
            for k, p in msgs:
                params = marker_params(k, tokens())
                params.update(consumer=b"tx-marker", key=k.encode(), token=params["token"].encode())
                params["fingerprint"] = fp
                tx_marker.begin()
                try:
                    with tx_marker.cursor() as cur:
                        cur.execute(d.insert, params)
                        if not cur.lastrowid:
                            raise BenchError(f"raw marker of new key {k!r} did not insert")
                    book_marker(tx_marker, p)
                except BaseException:
                    tx_marker.rollback()
                    raise
                tx_marker.commit()
            self.sent["marker"] += len(msgs) if counted else 0

        own_inbox = oncely.Inbox(store, consumer="tx-own")
        res.add(own_inbox.close)
        book_own = book_for("own")

        def tx_own_new(msgs: list[tuple[str, Any]]) -> None:
            for k, p in msgs:
                expect(own_inbox.handle_in_transaction(k, p, book_own), oncely.Outcome.PROCESSED)
            self.sent["own"] += len(msgs) if counted else 0

        def joined(v: str, savepoint: bool) -> Variant:
            user = self.connect()
            res.add(user.close)
            jinbox = oncely.Inbox(store, consumer=f"tx-{v}")
            res.add(jinbox.close)
            book = book_for(v)

            def run(msgs: list[tuple[str, Any]]) -> None:
                for k, p in msgs:
                    user.begin()
                    try:
                        handled = jinbox.handle_in_transaction(
                            k, p, book, tx=user, savepoint=savepoint
                        )
                    except BaseException:
                        user.rollback()
                        raise
                    user.commit()
                    expect(handled, oncely.Outcome.PROCESSED)
                self.sent[v] += len(msgs) if counted else 0

            return Variant(TX_NAMES[v], run)

        tx = Group(
            self.name,
            "tx",
            [
                Variant("raw", tx_raw_new),
                Variant(TX_NAMES["marker"], tx_marker_new),
                Variant(TX_NAMES["own"], tx_own_new),
                joined("joined", False),
                joined("joined_sp", True),
            ],
        )
        batch = Group(self.name, "batch", batch_variants(store, "batch"))
        return [twophase, tx, batch]

    def check(self) -> None:
        conn = self.connect()
        try:
            with conn.cursor() as cur:
                for v in TX_VARIANTS:
                    cur.execute(
                        f"SELECT count(*), coalesce(sum(amount_cents), 0) "
                        f"FROM {self.table}_ledger_{v}"
                    )
                    rows, total = cur.fetchone()
                    cur.execute(f"SELECT sum(balance_cents) FROM {self.table}_account_{v}")
                    balance = cur.fetchone()[0]
                    markers = rows
                    if v != "raw":
                        cur.execute(
                            f"SELECT count(*) FROM {self.table} WHERE consumer = %s",
                            (f"tx-{v}".encode(),),
                        )
                        markers = cur.fetchone()[0]
                    check_books(self.name, v, self.sent[v], rows, total, balance, markers)
        finally:
            conn.close()

    def version(self) -> str:
        conn = self.connect()
        try:
            with conn.cursor() as cur:
                cur.execute("SELECT VERSION()")
                return str(cur.fetchone()[0]).split("-")[0]
        finally:
            conn.close()

    def cleanup(self) -> None:
        conn = self.connect()
        try:
            names = [self.table, f"{self.table}_meta"]
            for v in TX_VARIANTS:
                names += [f"{self.table}_ledger_{v}", f"{self.table}_account_{v}"]
            with conn.cursor() as cur:
                cur.execute("DROP TABLE IF EXISTS " + ", ".join(names))
        finally:
            conn.close()


# --------------------------------------------------------------------------- Redis


class Redis(Server):
    name = "Redis"
    port = 6379
    driver = "redis"
    module = "oncely._sync.redis"

    def __init__(self, tag: str = "") -> None:
        # Powertools' key is a hash of the payload alone, and every Keys() starts its payloads
        # at order(0): a second instance (the profile) needs prefixes of its own.
        self.url = REDIS_URL
        self.prefix = f"oncelybench{tag}{RUN}"
        self.raw_prefix = f"oncelybenchraw{tag}{RUN}"
        self.pt_prefix = f"ptbench{tag}{RUN}"
        self.powertools = powertools_version()

    def client(self, trips: Trips | None, *, decode_responses: bool = False) -> Any:
        if trips is not None:
            return counting_redis_client(self.url, trips, decode_responses=decode_responses)
        return driver("redis").Redis.from_url(self.url, decode_responses=decode_responses)

    def groups(self, res: Resources, trips: Trips | None) -> list[Group]:
        claim_script, complete_script = redis_dialect.CLAIM, redis_dialect.COMPLETE
        if trips is None:
            store = oncely.open(with_option(self.url, "prefix", self.prefix))
        else:
            counted_client = self.client(trips)
            res.add(counted_client.close)
            store = oncely.RedisStore(counted_client, prefix=self.prefix)
        res.add(store.close)
        inbox = oncely.Inbox(store, consumer="twophase")
        res.add(inbox.close)

        raw = self.client(trips)
        res.add(raw.close)
        raw.script_load(claim_script.text)
        raw.script_load(complete_script.text)
        keys = redis_dialect.RedisKeys(self.raw_prefix)
        tokens = Tokens()
        fp = redis_dialect.opt(FP)
        claim_sha, complete_sha = claim_script.sha, complete_script.sha

        def raw_new(msgs: list[tuple[str, Any]]) -> None:
            for k, p in msgs:
                name = keys.record("raw", k)
                token = tokens()
                reply = raw.evalsha(
                    claim_sha, 1, name, b"", LEASE_MS, KEEP_MS, b"1", b"", fp, token
                )
                if reply[0][0] != b"new":
                    raise BenchError(f"raw claim of new key {k!r}: {reply[0][0]!r}")
                trivial(p)
                done = raw.evalsha(complete_sha, 1, name, b"", token, KEEP_MS, b"", b"")
                if done[0] != b"ok":
                    raise BenchError(f"raw complete of {k!r}: {done[0]!r}")

        def raw_dup(msgs: list[tuple[str, Any]]) -> None:
            for k, _p in msgs:
                reply = raw.evalsha(
                    claim_sha,
                    1,
                    keys.record("raw", k),
                    b"",
                    LEASE_MS,
                    KEEP_MS,
                    b"1",
                    b"",
                    fp,
                    tokens(),
                )
                if reply[0][0] != b"existing" or reply[0][2] != b"completed":
                    raise BenchError(f"raw claim of completed key {k!r}: {reply[0][:3]!r}")

        variants = [Variant("raw", raw_new, raw_dup), oncely_variants(inbox)]
        if self.powertools is not None:
            pt_client = self.client(trips, decode_responses=True)
            res.add(pt_client.close)
            case = PowertoolsCase(pt_client, self.pt_prefix)
            variants.append(Variant("Powertools", case.new, case.dup))
        twophase = Group(self.name, "twophase", variants)
        batch = Group(self.name, "batch", batch_variants(store, "batch"))
        return [twophase, batch]

    def version(self) -> str:
        client = self.client(None)
        try:
            return str(client.info("server")["redis_version"])
        finally:
            client.close()

    def cleanup(self) -> None:
        client = self.client(None)
        try:
            for pattern in (f"{self.prefix}:*", f"{self.raw_prefix}:*", f"{self.pt_prefix}#*"):
                batch: list[bytes] = []
                for name in client.scan_iter(match=pattern, count=1000):
                    batch.append(name)
                    if len(batch) >= 1000:
                        client.unlink(*batch)
                        batch.clear()
                if batch:
                    client.unlink(*batch)
        finally:
            client.close()


SERVERS: tuple[type[Server], ...] = (Postgres, MariaDB, Redis)


# --------------------------------------------------------------------------- the run


def measure(run: Callable[[], None]) -> tuple[float, float, float]:
    """(wall seconds, client CPU seconds, of which in the kernel) of ``run``; the collector
    runs before, not during. CPU is ``time.process_time()`` (user + system, every thread of
    this process); the kernel's part is ``getrusage``'s system time, mostly the loopback TCP
    stack each round trip goes through."""
    gc.collect()
    kernel = resource.getrusage(resource.RUSAGE_SELF).ru_stime
    cpu = time.process_time()
    started = time.perf_counter()
    run()
    wall = time.perf_counter() - started
    cpu = time.process_time() - cpu
    return wall, cpu, resource.getrusage(resource.RUSAGE_SELF).ru_stime - kernel


@dataclass
class Series:
    """One variant on one path: µs per message per round: wall, client CPU, its kernel part."""

    us: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    sys: list[float] = field(default_factory=list)


def run_servers(res: Resources, n: int, rounds: int, warmup: int) -> dict[str, Any]:
    """Every available server store, measured in interleaved rounds, then a round-trip pass."""
    out: dict[str, Any] = {"stores": {}, "skipped": {}, "rows": [], "run": RUN}
    servers: list[Server] = []
    for cls in SERVERS:
        server = cls()
        reason = server.unavailable()
        if reason is not None:
            out["skipped"][server.name] = reason
            print(f"  {server.name}: skipped ({reason})", flush=True)
            continue
        servers.append(server)
        res.add(server.cleanup)  # registered first: runs after the stores are closed
        out["stores"][server.name] = {
            "url": oncely.redact(server.url),
            "version": server.version(),
        }
    out["drivers"] = driver_versions()
    redis_server = next((s for s in servers if isinstance(s, Redis)), None)
    if redis_server is not None and redis_server.powertools is None:
        out["skipped"]["Powertools"] = f"not installed (pip install '{POWERTOOLS_REQUIREMENT}')"
    keys = Keys()
    groups: list[Group] = []
    for server in servers:
        print(f"  {server.name}: opening and warming up ...", flush=True)
        found = server.groups(res, None)
        for group in found:
            for variant in group.variants:
                msgs = keys.batch(warmup)
                variant.new(msgs)
                if variant.dup is not None:
                    variant.dup(msgs)
        groups += found
    series: dict[tuple[int, str, str], Series] = {}
    for r in range(rounds):
        print(f"  round {r + 1}/{rounds}", flush=True)
        spent: dict[tuple[int, str, str], list[float]] = {}
        for g, group in enumerate(groups):
            for c, size in enumerate(chunks(n)):
                for variant in rotated(group.variants, r + c):
                    msgs = keys.batch(size)
                    new = spent.setdefault((g, variant.name, "new key"), [0.0, 0.0, 0.0])
                    for i, x in enumerate(measure(lambda v=variant, m=msgs: v.new(m))):
                        new[i] += x
                    again = variant.dup
                    if again is not None:
                        dup = spent.setdefault((g, variant.name, "duplicate"), [0.0, 0.0, 0.0])
                        for i, x in enumerate(measure(lambda d=again, m=msgs: d(m))):
                            dup[i] += x
        for key, (wall, cpu, kernel) in spent.items():
            s = series.setdefault(key, Series())
            s.us.append(us_per(wall, n))
            s.cpu.append(us_per(cpu, n))
            s.sys.append(us_per(kernel, n))
    for server in servers:
        server.check()
    print("  counting round trips ...", flush=True)
    trips = round_trips(servers, res, keys, min(n, 200), min(warmup, 50))
    for g, group in enumerate(groups):
        base = group.variants[0].name
        for path in ("new key", "duplicate"):
            if (g, base, path) not in series:
                continue
            for variant in group.variants:
                s = series[(g, variant.name, path)]
                b = series[(g, base, path)]
                per, seq = trips.get((group.store, group.kind, variant.name, path), (None, []))
                out["rows"].append(
                    {
                        "store": group.store,
                        "kind": group.kind,
                        "path": path,
                        "variant": variant.name,
                        "us": s.us,
                        "cpu": s.cpu,
                        "sys": s.sys,
                        "vs_base": [a / z for a, z in zip(s.us, b.us, strict=True)],
                        "cpu_vs_base": [a / z for a, z in zip(s.cpu, b.cpu, strict=True)],
                        "trips": per,
                        "seq": seq,
                    }
                )
    return out


def round_trips(
    servers: list[Server], res: Resources, keys: Keys, n: int, warmup: int
) -> dict[tuple[str, str, str, str], tuple[float, list[str]]]:
    """Round trips per message of every variant, on instances of their own whose drivers count
    (warmed up first: psycopg prepares a statement on its 5th run, which is a round trip of its
    own once per connection)."""
    out: dict[tuple[str, str, str, str], tuple[float, list[str]]] = {}
    workdir = Path(tempfile.mkdtemp(prefix="oncely-bench-trips-"))
    res.add(lambda: shutil.rmtree(workdir, ignore_errors=True))
    for server in servers:
        trips = Trips(workdir)
        with counting_pymysql(trips) if isinstance(server, MariaDB) else contextlib.nullcontext():
            for group in server.groups(res, trips):
                for variant in group.variants:
                    warm = keys.batch(warmup)
                    variant.new(warm)
                    if variant.dup is not None:
                        variant.dup(warm)
                    msgs = keys.batch(n)
                    parts = [msgs[i : i + CHUNK] for i in range(0, n, CHUNK)]
                    # one answer per message; for a batch claim, the round trips of one call
                    units = len(parts) if "claim_many" in variant.name else n
                    with trips.measure():
                        for part in parts:
                            variant.new(part)
                    out[(group.store, group.kind, variant.name, "new key")] = (
                        len(trips.seq) / n,
                        per_message(trips.seq, units)[1],
                    )
                    if variant.dup is not None:
                        with trips.measure():
                            for part in parts:
                                variant.dup(part)
                        out[(group.store, group.kind, variant.name, "duplicate")] = (
                            len(trips.seq) / n,
                            per_message(trips.seq, units)[1],
                        )
    return out


def driver_versions() -> dict[str, str]:
    found = {}
    for name in ("psycopg", "PyMySQL", "redis", "aws-lambda-powertools"):
        with contextlib.suppress(PackageNotFoundError):
            found[name] = version(name)
    return found


# --------------------------------------------------------------------------- profiling


def profile_redis(res: Resources, n: int, top: int) -> str:
    """cProfile of oncely's Redis two-phase path (new keys, then duplicates) and of Powertools'
    on the same server, in microseconds per message (the profiler inflates every figure)."""
    server = Redis(tag="prof")
    reason = server.unavailable()
    if reason is not None:
        return f"\n(Redis profile skipped: {reason})\n"
    res.add(server.cleanup)
    keys = Keys()
    out = io.StringIO()
    for group in server.groups(res, None):
        if group.kind != "twophase":
            continue
        for variant in group.variants:
            if variant.name == "raw":
                continue
            warm = keys.batch(200)
            variant.new(warm)
            assert variant.dup is not None
            variant.dup(warm)
            msgs = keys.batch(n)
            for path, run in (("new keys", variant.new), ("duplicates", variant.dup)):
                gc.collect()
                prof = cProfile.Profile()
                prof.enable()
                run(msgs)
                prof.disable()
                out.write(stats_text(prof, f"Redis two-phase, {variant.name}, {path}", top, n))
    return out.getvalue()
