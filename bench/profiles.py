"""``bench/run.py --profile``: cProfile of the sync SQLite paths and the MemoryStore, in
microseconds per message (``stats_text`` also serves the servers section's Redis profile)."""

from __future__ import annotations

import cProfile
import gc
import io
import pstats
from pathlib import Path
from typing import Any

from cases import Keys, Resources, expect, trivial
from tx_case import book, create_business_schema

import oncely


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
    """``oncely/inbox/sync_inbox.py:44 handle`` rather than a full path."""
    path, line, name = func
    if path == "~":
        return name  # a C function: "<method 'execute' of 'sqlite3.Connection' objects>"
    marker = "/src/"
    short = path.split(marker, 1)[1] if marker in path else Path(path).name
    return f"{short}:{line} {name}"
