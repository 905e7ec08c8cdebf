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

This module runs the section (rounds, round-trip pass, targets, profile); the cases are in
``server_postgres.py``, ``server_mariadb.py`` and ``server_redis.py``, what they share in
``server_common.py`` and the round-trip counting in ``server_trips.py``.
"""

from __future__ import annotations

import contextlib
import cProfile
import gc
import io
import resource
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from cases import CHUNK, Keys, Resources, chunks, rotated, us_per
from powertools_case import POWERTOOLS_REQUIREMENT
from profiles import stats_text
from server_common import RUN, Group, Server
from server_mariadb import MariaDB
from server_postgres import Postgres
from server_redis import Redis
from server_trips import Trips, counting_pymysql, per_message

import oncely

# The performance targets the project set for the server stores.
TARGET_REDIS_TRIPS_NEW = 2
TARGET_REDIS_TRIPS_DUP = 1
TARGET_CPU_SHARE = 0.5  # oncely's client CPU per message at most half of Powertools'
TARGET_SPEEDUP_NEW = 1.3  # oncely's throughput vs Powertools, new keys
TARGET_SPEEDUP_DUP = 2.5  # ... duplicates
TARGET_TX_EXTRA_TRIPS = 1  # round trips oncely adds to the caller's transaction
TARGET_FLOOR_RATIO = 1.5  # every per-message path within 1.5x of its raw floor
TARGET_BATCH_SPEEDUP = 10.0  # claim_many of 100 keys vs per-message claims
BATCH = 100


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
            for c, size in enumerate(chunks(n, group.sample)):
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
                    units = -(-n // BATCH) if "claim_many" in variant.name else n
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
