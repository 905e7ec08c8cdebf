"""The inbox at production size: ``python bench/scale.py --store postgres``.

Loads records in oncely's exact shape (36-character uuid keys in random order, real-size
fingerprints and tokens, 100-byte results, expiry spread over 7 days, 10% already expired)
into a table of its own, growing it through ``--sizes``, and at each size measures with the
store's own API (the sync class, one connection's worth of calls):

* claim latency p50/p99 for new keys (claim + complete) and duplicates (a claim that finds the
  completed record), ``--probe`` of each;
* a concurrent consumer's claim p99 (a process of its own, as a deployed consumer is) with no
  purge running and during a purge of the 10% expired, the two interleaved in ``--slice``
  seconds (the purge rests a slice after each slice of work, so host noise falls on both),
  and the purge's rows per second (over its working time);
* an empty purge (nothing expired any more): its wall time;
* ``stats(exact=False)`` (estimates from the database's statistics) and ``stats()`` (every
  record counted): their wall times, before the purge, and how far the estimate's live total
  and expired count are from the exact ones;
* bytes per record (table and indexes, as the server or the file reports them).

Writes ``bench/results/scale-<store>.md`` / ``.json`` / ``.png`` (``--out`` to change). The
table is dropped afterwards. ``--sizes 10000,100000,1000000,10000000`` for the 10^7 run.
Records are loaded by the driver's bulk path (COPY, executemany), not through oncely; rows
carry ``purge_ms`` when the table has it, so the same command measures an older oncely too
(``PYTHONPATH=<old checkout>/src python bench/scale.py ...``).
"""

from __future__ import annotations

import argparse
import inspect
import json
import multiprocessing
import os
import platform
import random
import sqlite3
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import oncely
from oncely.stores import ClaimStatus

try:
    from oncely.stores._purging import PURGE_BATCH
except ImportError:  # an older oncely: its own default then
    PURGE_BATCH = 1000
try:  # schema version 2 of the SQLite and MariaDB stores keeps tokens and fingerprints as bytes
    from oncely.stores._compact import pack_fingerprint, pack_token
except ImportError:  # an older oncely: text
    pack_fingerprint = pack_token = None  # type: ignore[assignment]

HERE = Path(__file__).resolve().parent
DAY_MS = 86_400_000
KEEP_MS = 7 * DAY_MS
LEASE_MS = 30_000
BUCKET_MS = 60_000
FP = oncely.fingerprint({"order": "x" * 200})
RESULT = os.urandom(100)
POSTGRES_URL = os.environ.get(
    "ONCELY_BENCH_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test"
)
MYSQL_URL = os.environ.get("ONCELY_BENCH_MYSQL_URL", "mysql://root@127.0.0.1:3306/test")
COLUMNS = (
    "consumer, key, status, fingerprint, token, attempt, created_ms, updated_ms, "
    "lease_until_ms, expires_ms, result, error"
)


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def bucket(ms: int) -> int:
    return -(-ms // BUCKET_MS) * BUCKET_MS


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# ------------------------------------------------------------------------------- the stores


class Target:
    """One store kind: how to open the oncely store, bulk-load rows, and read the size."""

    name: str
    store: Any
    compact = False
    """Whether this oncely keeps tokens and fingerprints of this store as bytes."""

    def has_purge_column(self) -> bool:
        raise NotImplementedError

    def load(self, rows: list[tuple[Any, ...]]) -> None:
        raise NotImplementedError

    def bytes_used(self) -> int:
        raise NotImplementedError

    def drop(self) -> None:
        raise NotImplementedError

    def server(self) -> str:
        return ""

    def where(self) -> tuple[str, str]:
        """What another process needs to open the same store: ``open_store(*where())``."""
        raise NotImplementedError


def open_store(kind: str, where: str) -> Any:
    if kind == "postgres":
        from oncely.stores.postgres import PostgresStore  # noqa: PLC0415

        return PostgresStore(POSTGRES_URL, table=where, pool_max=2)
    if kind == "mysql":
        from oncely.stores.mysql import MySQLStore  # noqa: PLC0415

        return MySQLStore.from_url(f"{MYSQL_URL}?table={where}")
    return oncely.SQLiteStore(where)


class Postgres(Target):
    name = "postgres"

    def __init__(self) -> None:
        import psycopg  # noqa: PLC0415 - only this store needs it

        from oncely.stores.postgres import PostgresStore  # noqa: PLC0415

        self.table = f"oncely_scale_{os.urandom(3).hex()}"
        self.conn = psycopg.connect(POSTGRES_URL, autocommit=True)
        self.store = PostgresStore(POSTGRES_URL, table=self.table, pool_max=4)
        self.store.migrate()

    def has_purge_column(self) -> bool:
        rows = self.conn.execute(
            "SELECT 1 FROM information_schema.columns WHERE table_name = %s "
            "AND column_name = 'purge_ms'",
            (self.table,),
        ).fetchall()
        return bool(rows)

    def load(self, rows: list[tuple[Any, ...]]) -> None:
        columns = COLUMNS + (", purge_ms" if len(rows[0]) == 13 else "")
        with self.conn.cursor().copy(f'COPY "{self.table}" ({columns}) FROM STDIN') as copy:
            for row in rows:
                copy.write_row(row)
        self.conn.execute(f'ANALYZE "{self.table}"')

    def bytes_used(self) -> int:
        row = self.conn.execute("SELECT pg_total_relation_size(%s)", (self.table,)).fetchone()
        return int(row[0]) if row else 0

    def drop(self) -> None:
        self.store.close()
        self.conn.execute(f'DROP TABLE IF EXISTS "{self.table}", "{self.table}_meta"')

    def server(self) -> str:
        row = self.conn.execute("SHOW server_version").fetchone()
        return f"PostgreSQL {row[0] if row else '?'}"

    def where(self) -> tuple[str, str]:
        return "postgres", self.table


class SQLite(Target):
    name = "sqlite"
    compact = pack_token is not None

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="oncely-scale-")
        self.path = os.path.join(self.dir, "inbox.db")
        self.store = oncely.SQLiteStore(self.path)
        self.store.migrate()
        self.conn = sqlite3.connect(self.path, isolation_level=None, timeout=60)

    def has_purge_column(self) -> bool:
        names = [r[1] for r in self.conn.execute("PRAGMA table_info(oncely_inbox)")]
        return "purge_ms" in names

    def load(self, rows: list[tuple[Any, ...]]) -> None:
        marks = ", ".join("?" * len(rows[0]))
        columns = COLUMNS + (", purge_ms" if len(rows[0]) == 13 else "")
        self.conn.execute("BEGIN IMMEDIATE")
        self.conn.executemany(f"INSERT INTO oncely_inbox ({columns}) VALUES ({marks})", rows)
        self.conn.execute("COMMIT")
        self.conn.execute("ANALYZE")

    def bytes_used(self) -> int:
        ((pages,),) = self.conn.execute("PRAGMA page_count")
        ((size,),) = self.conn.execute("PRAGMA page_size")
        ((free,),) = self.conn.execute("PRAGMA freelist_count")
        return int((pages - free) * size)

    def drop(self) -> None:
        self.store.close()
        self.conn.close()
        for suffix in ("", "-wal", "-shm"):
            if os.path.exists(self.path + suffix):
                os.remove(self.path + suffix)
        os.rmdir(self.dir)

    def server(self) -> str:
        return f"SQLite {sqlite3.sqlite_version}"

    def where(self) -> tuple[str, str]:
        return "sqlite", self.path


class MySQL(Target):
    name = "mysql"
    compact = pack_token is not None

    def __init__(self) -> None:
        import pymysql  # noqa: PLC0415 - only this store needs it

        from oncely.stores.mysql import MySQLStore  # noqa: PLC0415
        from oncely.stores.mysql.errors import parse_url  # noqa: PLC0415

        self.table = f"oncely_scale_{os.urandom(3).hex()}"
        s = parse_url(MYSQL_URL).settings
        self.conn = pymysql.connect(
            host=s.host, port=s.port, user=s.user, password=s.password or "",
            database=s.database, autocommit=True, charset="utf8mb4",
        )  # fmt: skip
        self.store = MySQLStore.from_url(f"{MYSQL_URL}?table={self.table}")
        self.store.migrate()

    def _sql(self, statement: str, params: Any = None) -> list[Any]:
        with self.conn.cursor() as cursor:
            cursor.execute(statement, params)
            return list(cursor.fetchall())

    def has_purge_column(self) -> bool:
        return bool(self._sql(f"SHOW COLUMNS FROM `{self.table}` LIKE 'purge_ms'"))

    def load(self, rows: list[tuple[Any, ...]]) -> None:
        columns = COLUMNS.replace("key", "`key`") + (", purge_ms" if len(rows[0]) == 13 else "")
        marks = ", ".join(["%s"] * len(rows[0]))
        statement = f"INSERT INTO `{self.table}` ({columns}) VALUES ({marks})"
        with self.conn.cursor() as cursor:
            for start in range(0, len(rows), 5000):
                self.conn.begin()
                cursor.executemany(statement, rows[start : start + 5000])
                self.conn.commit()
        self._sql(f"ANALYZE TABLE `{self.table}`")

    def bytes_used(self) -> int:
        rows = self._sql(
            "SELECT data_length + index_length FROM information_schema.tables "
            "WHERE table_schema = DATABASE() AND table_name = %s",
            (self.table,),
        )
        return int(rows[0][0]) if rows else 0

    def drop(self) -> None:
        self.store.close()
        self._sql(f"DROP TABLE IF EXISTS `{self.table}`, `{self.table}_meta`")
        self.conn.close()

    def server(self) -> str:
        return f"MariaDB/MySQL {self._sql('SELECT version()')[0][0]}"

    def where(self) -> tuple[str, str]:
        return "mysql", self.table


TARGETS: dict[str, Callable[[], Target]] = {"postgres": Postgres, "sqlite": SQLite, "mysql": MySQL}


# ------------------------------------------------------------------------------- the run


class LiveOrder:
    """Expiries for ``--order live``: one rising sequence over the whole run, the expired
    share over the last day and the live one over the next seven, each record's expiry
    after every one loaded before it, as a live inbox writes them (the store's indexes by
    expiry then grow at their end, whichever size the run is at)."""

    def __init__(self, total: int, expired: float) -> None:
        self.start = now_ms()
        self.gone_step = DAY_MS / max(1.0, total * expired)
        self.live_step = (KEEP_MS - 3_600_000) / max(1.0, total * (1 - expired))
        self.gone = self.live = 0

    def next(self, gone: bool) -> int:
        if gone:
            self.gone += 1
            return self.start - DAY_MS + int(self.gone * self.gone_step)
        self.live += 1
        return self.start + 3_600_000 + int(self.live * self.live_step)


def make_rows(
    n: int,
    expired: float,
    purge_column: bool,
    keys: list[str],
    order: str,
    compact: bool,
    live: LiveOrder | None = None,
) -> list[tuple[Any, ...]]:
    """``n`` completed records; a share ``expired`` already past their expiry. ``order``
    "live" takes the expiries from ``live`` (see :class:`LiveOrder`); "time" writes each
    call's rows in expiry order, though the calls' ranges overlap; "random" in random order,
    the worst case for the purge. ``compact``: tokens and fingerprints in the store's byte
    form."""
    now = now_ms()
    fingerprint = pack_fingerprint(FP) if compact and pack_fingerprint else FP
    rows = []
    for _ in range(n):
        key = str(uuid.uuid4())
        gone = random.random() < expired
        if live is not None:
            expires = live.next(gone)
        elif gone:
            expires = now - random.randint(1_000, DAY_MS)
        else:
            expires = now + random.randint(BUCKET_MS, KEEP_MS)
        if not gone and len(keys) < 200_000:
            keys.append(key)
        written = expires - KEEP_MS
        row: tuple[Any, ...] = (
            "bench", key, "completed", fingerprint,
            os.urandom(16) if compact else os.urandom(16).hex(), 1, written, written,
            written, expires, RESULT, None,
        )  # fmt: skip
        rows.append((*row, bucket(expires)) if purge_column else row)
    if order != "random":
        rows.sort(key=lambda r: r[9])
    return rows


def claim_new(store: Any, key: str) -> None:
    token = os.urandom(16).hex()
    claim = store.claim(
        "bench", key, fingerprint=FP, token=token, lease_ms=LEASE_MS, keep_ms=KEEP_MS,
        takeover=True,
    )  # fmt: skip
    store.complete("bench", key, token=claim.record.token, result=RESULT, keep_ms=KEEP_MS)


def claim_duplicate(store: Any, key: str) -> None:
    claim = store.claim(
        "bench", key, fingerprint=FP, token=os.urandom(16).hex(), lease_ms=LEASE_MS,
        keep_ms=KEEP_MS, takeover=True,
    )  # fmt: skip
    if claim.status is not ClaimStatus.EXISTING:
        raise SystemExit(f"a duplicate of {key} was not found: {claim.status}")


def timed(calls: Iterator[Callable[[], None]]) -> list[float]:
    out = []
    for call in calls:
        started = time.perf_counter()
        call()
        out.append((time.perf_counter() - started) * 1000)
    return out


def consumer_main(kind: str, where: str, stop: Any, ready: Any, out: Any) -> None:
    """The consumer process: claim + complete new keys about 400 times a second until told to
    stop; sends back (monotonic start, latency ms) per claim."""
    store = open_store(kind, where)
    samples: list[tuple[float, float]] = []
    ready.set()
    while not stop.is_set():
        started = time.monotonic()
        claim_new(store, str(uuid.uuid4()))
        samples.append((started, (time.monotonic() - started) * 1000))
        time.sleep(0.002)  # about 400 messages a second: a busy consumer, not a flood
    store.close()
    out.put(samples)


@contextmanager
def consumer(target: Target) -> Iterator[list[tuple[float, float]]]:
    """A consumer in a process of its own (as a deployed one is: no GIL shared with the purge)
    claiming new keys while the block runs; its (start, latency ms) samples, filled on exit."""
    context = multiprocessing.get_context("spawn")
    stop, ready, out = context.Event(), context.Event(), context.Queue()
    kind, where = target.where()
    child = context.Process(target=consumer_main, args=(kind, where, stop, ready, out))
    child.start()
    samples: list[tuple[float, float]] = []
    try:
        if not ready.wait(60):
            raise SystemExit("the consumer process did not start")
        time.sleep(1)  # its connections warm
        yield samples
    finally:
        stop.set()
        samples.extend(out.get(timeout=60))
        child.join(30)


class Slices:
    """Quiet and purging time interleaved in slices of ``length`` seconds: the purge's
    ``on_batch`` rests a slice whenever it has purged for one, so a noisy host's moods fall on
    both windows alike and the consumer's p99 with and without a purge are compared fairly."""

    def __init__(self, length: float) -> None:
        self.length = length
        self.quiet: list[tuple[float, float]] = []
        self.purging: list[tuple[float, float]] = []
        self.began = 0.0

    def rest(self) -> None:
        began = time.monotonic()
        time.sleep(self.length)
        self.quiet.append((began, time.monotonic()))

    def start(self) -> None:
        self.began = time.monotonic()

    def stop(self) -> None:
        self.purging.append((self.began, time.monotonic()))

    def on_batch(self, _taken: int, _deleted: int) -> None:
        if time.monotonic() - self.began >= self.length:
            self.stop()
            self.rest()
            self.start()


def between(samples: list[tuple[float, float]], start: float, end: float) -> list[float]:
    return [ms for at, ms in samples if start <= at <= end]


@dataclass
class Point:
    size: int
    new_p50: float = 0.0
    new_p99: float = 0.0
    dup_p50: float = 0.0
    dup_p99: float = 0.0
    quiet_p99: float = 0.0
    purge_p99: float = 0.0
    purge_max: float = 0.0
    purged: int = 0
    purge_s: float = 0.0
    purge_rate: float = 0.0
    empty_purge_s: float = 0.0
    stats_estimate_s: float = 0.0
    stats_exact_s: float = 0.0
    estimate_error: float = 0.0
    bytes_per_record: float = 0.0
    load_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


def measure(
    target: Target,
    size: int,
    probe: int,
    keys: list[str],
    load_s: float,
    pause: float,
    batch: int,
    quiet: float,
    by_hand: bool = False,
) -> Point:
    store = target.store
    point = Point(size=size, load_s=load_s)
    point.bytes_per_record = target.bytes_used() / size
    fresh = [str(uuid.uuid4()) for _ in range(probe)]
    new = timed(lambda k=k: claim_new(store, k) for k in fresh)
    sample = random.sample(keys, min(probe, len(keys)))
    dup = timed(lambda k=k: claim_duplicate(store, k) for k in sample)
    point.new_p50, point.new_p99 = pct(new, 0.5), pct(new, 0.99)
    point.dup_p50, point.dup_p99 = pct(dup, 0.5), pct(dup, 0.99)
    started = time.perf_counter()
    estimate = store.stats(exact=False)
    point.stats_estimate_s = time.perf_counter() - started
    started = time.perf_counter()
    exact = store.stats()
    point.stats_exact_s = time.perf_counter() - started
    point.estimate_error = max(
        abs(estimate.total - exact.total) / max(exact.total, 1),
        abs(estimate.expired - exact.expired) / max(exact.expired, 1),
    )
    point.extra["stats"] = {
        "estimate": {"total": estimate.total, "expired": estimate.expired},
        "exact": {"total": exact.total, "expired": exact.expired},
    }
    slices = Slices(quiet)
    options = pausing(store, pause)
    if "on_batch" in inspect.signature(store.purge_expired).parameters:
        options["on_batch"] = slices.on_batch
    with consumer(target) as samples:
        slices.rest()
        slices.start()
        if by_hand and isinstance(target, MySQL):
            point.purged = mysql_by_hand(target, slices.on_batch)
        elif by_hand:
            point.purged = sqlite_by_hand(target, batch, pause, slices.on_batch)
        else:
            point.purged = store.purge_expired(batch_size=batch, **options)
        slices.stop()
        slices.rest()
    point.purge_s = sum(b - a for a, b in slices.purging)
    during = [ms for a, b in slices.purging for ms in between(samples, a, b)]
    point.quiet_p99 = pct([ms for a, b in slices.quiet for ms in between(samples, a, b)], 0.99)
    point.purge_p99 = pct(during, 0.99)
    point.purge_max = max(during, default=float("nan"))
    point.extra["slices"] = len(slices.purging)
    point.purge_rate = point.purged / point.purge_s if point.purge_s else 0.0
    started = time.perf_counter()
    left = store.purge_expired(batch_size=1000)
    point.empty_purge_s = time.perf_counter() - started
    point.extra["empty_purge_deleted"] = left
    return point


def sqlite_by_hand(target: Target, batch: int, pause: float, on_batch: Any) -> int:
    """The floor for SQLite's purge beside a consumer: the store's own statements (candidates
    off the purge index, deletes of 100 pairs, a passive checkpoint after each) run by hand on
    plain sqlite3, resting ``pause`` times each write's time after it, as the store does."""
    d = target.store._dialect
    conn = sqlite3.connect(target.path, isolation_level=None, timeout=30)
    deleted = 0
    try:
        while True:
            now = now_ms()
            found = conn.execute(d.purge_candidates, {"now": now, "limit": batch}).fetchall()
            pairs = [part for c, k, gone in found if gone for part in (c, k)]
            if not pairs:
                return deleted
            for start in range(0, len(pairs), 200):
                chunk = pairs[start : start + 200]
                began = time.monotonic()
                rows = conn.execute(d.purge_delete(len(chunk) // 2), [*chunk, now]).fetchall()
                conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
                deleted += len(rows)
                time.sleep(pause * (time.monotonic() - began))
            on_batch(len(found), deleted)
    finally:
        conn.close()


def mysql_by_hand(target: MySQL, on_batch: Any) -> int:
    """The floor for MariaDB's purge rate: every expired row in one unbatched ``DELETE`` by
    hand. InnoDB plans a full scan and the one statement holds the whole table, so no library
    would ship it, but no batched purge deletes faster."""
    now = now_ms()
    with target.conn.cursor() as cursor:
        deleted = int(
            cursor.execute(f"DELETE FROM `{target.table}` WHERE expires_ms <= %s", (now,))
        )
    on_batch(deleted, deleted)
    return deleted


def pausing(store: Any, pause: float) -> dict[str, float]:
    """The purge's pause, for an oncely whose purge takes one (an older checkout's does not)."""
    return {"pause": pause} if "pause" in inspect.signature(store.purge_expired).parameters else {}


def table(points: list[Point]) -> str:
    head = (
        "| records | claim new p50 / p99 (ms) | duplicate p50 / p99 (ms) | consumer p99 quiet / "
        "during purge (ms) | purge: rows, rows/s | empty purge (s) | stats estimate / exact "
        "(s) | estimate off by | bytes/record |\n"
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    lines = [
        f"| {p.size:,} | {p.new_p50:.2f} / {p.new_p99:.2f} | {p.dup_p50:.2f} / {p.dup_p99:.2f} | "
        f"{p.quiet_p99:.2f} / {p.purge_p99:.2f} | {p.purged:,}, {p.purge_rate:,.0f} | "
        f"{p.empty_purge_s:.3f} | {p.stats_estimate_s:.3f} / {p.stats_exact_s:.3f} | "
        f"{p.estimate_error:.1%} | {p.bytes_per_record:.0f} |"
        for p in points
    ]
    return head + "\n".join(lines) + "\n"


def chart(points: list[Point], title: str, path: Path) -> None:
    try:
        import matplotlib  # noqa: PLC0415 - optional, the bench extra

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        return
    sizes = [p.size for p in points]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for label, values in (
        ("new p50", [p.new_p50 for p in points]), ("new p99", [p.new_p99 for p in points]),
        ("duplicate p50", [p.dup_p50 for p in points]),
        ("duplicate p99", [p.dup_p99 for p in points]),
        ("consumer p99 during purge", [p.purge_p99 for p in points]),
    ):  # fmt: skip
        left.plot(sizes, values, marker="o", label=label)
    left.set(xscale="log", xlabel="records", ylabel="ms", title="claim latency")
    left.legend(fontsize=8)
    right.plot(sizes, [p.purge_rate for p in points], marker="o", label="purge rows/s")
    right.set(xscale="log", yscale="log", xlabel="records", ylabel="rows/s", title="purge rate")
    right2 = right.twinx()
    right2.plot(sizes, [p.empty_purge_s for p in points], marker="s", color="tab:red",
                label="empty purge (s)")  # fmt: skip
    right2.set_ylabel("empty purge (s)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def rss_mb() -> float:
    """This process's resident set size, from /proc (Linux)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def rss_over(store: Any, messages: int) -> list[tuple[int, float]]:
    """RSS sampled ten times while ``messages`` go through ``Inbox.handle`` on ``store``
    (new keys, one in ten sent twice), as a long-running consumer would handle them."""
    inbox = oncely.Inbox(store, consumer="rss", lease=oncely.Lease(heartbeat=False))
    result = {"charged": 1999, "receipt": "r" * 60}
    samples = [(0, rss_mb())]
    step = max(1, messages // 10)
    last = ""
    for n in range(1, messages + 1):
        key = last if n % 10 == 0 else str(uuid.uuid4())
        inbox.handle(key, {"order": key, "amount": 1999}, lambda _payload: result)
        last = key
        if n % step == 0:
            samples.append((n, rss_mb()))
    return samples


def main() -> None:
    p = argparse.ArgumentParser(prog="python bench/scale.py", description=__doc__.split("\n")[0])
    p.add_argument("--store", choices=sorted(TARGETS), required=True)
    p.add_argument("--sizes", default="10000,100000,1000000", help="comma-separated")
    p.add_argument("--expired", type=float, default=0.10, help="share loaded already expired")
    p.add_argument("--probe", type=int, default=2000, help="claims timed per kind and size")
    p.add_argument("--out", type=Path, default=HERE / "results", help="where results go")
    p.add_argument("--label", default="", help="a suffix for the result files")
    p.add_argument("--batch", type=int, default=PURGE_BATCH, help="the purge's batch size")
    p.add_argument(
        "--pause", type=float, default=1.0,
        help="the purge's rest after each batch, times the batch's time (the library's default)",
    )  # fmt: skip
    p.add_argument(
        "--slice", dest="quiet", type=float, default=1.0,
        help="seconds of purging, then of quiet, in turn: the consumer's two p99 windows",
    )  # fmt: skip
    p.add_argument(
        "--order", choices=("live", "time", "random"), default="live",
        help="rows written in one rising expiry order over the run, as a live inbox writes "
        "them (default); in expiry order within each 200,000-row load; or at random",
    )  # fmt: skip
    p.add_argument(
        "--rss", type=int, default=0, metavar="N",
        help="after the sizes, send N messages through Inbox.handle and sample the RSS",
    )  # fmt: skip
    p.add_argument(
        "--by-hand", action="store_true",
        help="the floor: on SQLite the purge's statements run by hand on plain sqlite3; on "
        "MariaDB/MySQL one unbatched DELETE of every expired row",
    )  # fmt: skip
    args = p.parse_args()
    if args.by_hand and args.store == "postgres":
        p.error("--by-hand is measured on SQLite and MariaDB/MySQL")
    sizes = sorted(int(s) for s in args.sizes.split(","))
    target = TARGETS[args.store]()
    command = "python bench/scale.py " + " ".join(sys.argv[1:])
    points: list[Point] = []
    keys: list[str] = []
    live = LiveOrder(sizes[-1], args.expired) if args.order == "live" else None
    try:
        purge_column = target.has_purge_column()
        loaded = 0
        for size in sizes:
            started = time.perf_counter()
            while loaded < size:
                chunk = min(200_000, size - loaded)
                rows = make_rows(
                    chunk, args.expired, purge_column, keys, args.order, target.compact, live
                )
                target.load(rows)
                loaded += chunk
            load_s = time.perf_counter() - started
            point = measure(
                target, size, args.probe, keys, load_s, args.pause, args.batch, args.quiet,
                args.by_hand,
            )  # fmt: skip
            loaded -= point.purged
            points.append(point)
            print(table([point]).splitlines()[-1], flush=True)
        rss = rss_over(target.store, args.rss) if args.rss else []
        server = target.server()
    finally:
        target.drop()
    stem = f"scale-{args.store}{'-' + args.label if args.label else ''}"
    args.out.mkdir(parents=True, exist_ok=True)
    host = f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    title = f"{server}: oncely {getattr(oncely, '__version__', '?')} (purge_ms: {purge_column})"
    text = (
        f"# {title}\n\n`{command}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"{host}\n\n{table(points)}\n"
        f"Each size: {args.probe} claims of each kind timed one by one; the consumer runs "
        "claim + complete about 400 times a second in a process of its own, while the purge "
        f"runs and rests in turn in slices of {args.quiet:g} s (its p99 during and quiet); the "
        "purge deletes the "
        f"{args.expired:.0%} loaded expired (batches of {args.batch}, resting {args.pause:g}x each "
        f"batch's time after it). Rows loaded in {args.order} "
        "order; load times: " + ", ".join(f"{p.size:,}: {p.load_s:.0f} s" for p in points) + ". "
        'Stats are read before the purge; "estimate off by" is the larger relative error of '
        "the estimate's live total and expired count.\n"
    )
    if rss:
        text += (
            f"\nRSS while {args.rss:,} messages went through `Inbox.handle` (one in ten twice): "
            + ", ".join(f"{n:,}: {mb:.1f} MB" for n, mb in rss)
            + f" (growth {rss[-1][1] - rss[1][1]:+.1f} MB after the first tenth).\n"
        )
    (args.out / f"{stem}.md").write_text(text)
    data = {"title": title, "command": command, "points": [vars(p) for p in points], "rss": rss}
    (args.out / f"{stem}.json").write_text(json.dumps(data, indent=2))
    chart(points, title, args.out / f"{stem}.png")
    print(text)
    print(f"median claim p50 over sizes: {statistics.median(p.new_p50 for p in points):.2f} ms")


if __name__ == "__main__":
    main()
