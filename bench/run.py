"""oncely benchmarks: one command, one table (``python bench/run.py``, or ``make bench``).

Three sections, measured side by side in one run:

``twophase``
    Two-phase mode (``Inbox.handle`` / ``AsyncInbox.handle``, R10) with a trivial handler, per
    store: new keys (claim + handler + complete) and the duplicate path (the same keys again).
``tx``
    Transactional mode (``Inbox.handle_in_transaction``, R7) against the same SQLite
    transaction written by hand without oncely ("raw floor": ``BEGIN IMMEDIATE; INSERT ledger;
    UPDATE account; COMMIT``), sync (sqlite3) and async (aiosqlite), at ``synchronous=full``
    and ``normal``. A third variant, "raw + marker", runs oncely's own claim statement by hand
    inside the raw transaction, so the gap splits into what the extra SQL costs and what
    oncely's Python costs. Variants run interleaved in rounds with a rotating order; each
    round's ratio compares batches measured next to each other, and the median is reported.
``core``
    The pure decision path per message: key validation, payload fingerprint, claim decision
    (``apply_claim`` + ``decide``).
``servers``
    The PostgreSQL, MariaDB and Redis stores against their raw floors (the same driver running
    the store's own statements or Lua scripts by hand), both modes, batch claims, round trips
    per message counted on the wire, client CPU per message, and Redis against AWS Lambda
    Powertools' idempotency utility (``servers.py``). A server that does not answer is
    skipped with the reason.

Every batch checks its outcomes (and the tx section checks the ledger and balances at the end),
so a broken path fails the run instead of reporting a fast number. ``--profile`` also runs
cProfile over the sync transactional and two-phase paths.

Writes ``bench/results/latest.md``, ``latest.json`` and ``latest.png`` (``--out`` to change).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from cases import Resources
from charts import chart
from core_case import run_core
from profiles import profile
from report import filesystem_of, machine, machine_text, tables, write_markdown
from servers import profile_redis, run_servers
from sql_trace import trace_twophase, trace_tx
from twophase_case import run_twophase
from tx_case import run_tx

SECTIONS = ("twophase", "tx", "core", "servers")
HERE = Path(__file__).resolve().parent

# --------------------------------------------------------------------------- main


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python bench/run.py",
        description="Benchmark oncely: two-phase throughput per store, transactional mode vs "
        "raw SQLite, and the pure-core decision path.",
    )
    p.add_argument("--quick", action="store_true", help="small N for a smoke run (seconds)")
    p.add_argument("--messages", type=int, help="messages per batch (default 1000; quick: 100)")
    p.add_argument("--rounds", type=int, help="interleaved rounds (default 7; quick: 3)")
    p.add_argument(
        "--server-messages",
        type=int,
        help="messages per batch in the servers section (default: --messages, at most 500)",
    )
    p.add_argument(
        "--only",
        action="append",
        choices=SECTIONS,
        help="run only this section (repeatable)",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="also cProfile the sync SQLite paths (and, with servers, the Redis path)",
    )
    p.add_argument("--top", type=int, default=25, help="profile rows to show per path")
    p.add_argument(
        "--dir", type=Path, help="where the database files go (default: a fresh temp dir)"
    )
    p.add_argument("--out", type=Path, default=HERE / "results", help="where results go")
    p.add_argument("--no-save", action="store_true", help="print only; write no files")
    args = p.parse_args(argv)
    if args.messages is None:
        args.messages = 100 if args.quick else 1000
    if args.rounds is None:
        args.rounds = 3 if args.quick else 7
    if args.server_messages is None:
        args.server_messages = min(args.messages, 500)
    if args.messages < 1 or args.rounds < 1 or args.server_messages < 1:
        p.error("--messages, --server-messages and --rounds must be at least 1")
    args.warmup = min(args.messages, 50 if args.quick else 200)
    args.server_warmup = min(args.server_messages, 20 if args.quick else 100)
    return args


@contextlib.contextmanager
def workdir(base: Path | None) -> Iterator[Path]:
    if base is not None:
        base.mkdir(parents=True, exist_ok=True)
    d = Path(tempfile.mkdtemp(prefix="oncely-bench-", dir=base))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    sections = [s for s in SECTIONS if not args.only or s in args.only]
    command = "python bench/run.py" + (" " + " ".join(sys.argv[1:]) if sys.argv[1:] else "")
    results: dict[str, Any] = {
        "command": command,
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "messages": args.messages,
        "rounds": args.rounds,
        "warmup": args.warmup,
        "sections": sections,
    }
    print(machine_text(results["machine"]), flush=True)
    started = time.perf_counter()
    traced = min(args.messages, 200)
    with (
        workdir(args.dir) as d,
        asyncio.Runner() as runner,
        contextlib.closing(Resources(runner)) as res,
    ):
        results["dir_fs"] = filesystem_of(d)
        if "twophase" in sections:
            print("\nrunning two-phase ...", flush=True)
            results["twophase"] = run_twophase(d, res, args.messages, args.rounds, args.warmup)
            results["twophase_trace"] = trace_twophase(d, res, traced)
        if "tx" in sections:
            print("running transactional vs raw ...", flush=True)
            results["tx"] = run_tx(d, res, args.messages, args.rounds, args.warmup)
            results["tx_trace"] = trace_tx(d, res, traced)
        if "core" in sections:
            print("running pure core ...", flush=True)
            results["core_n"] = args.messages * 10
            results["core"] = run_core(args.messages * 10, args.rounds)
        if "servers" in sections:
            print("running server stores ...", flush=True)
            results["server_messages"] = args.server_messages
            results["servers"] = run_servers(
                res, args.server_messages, args.rounds, args.server_warmup
            )
        prof = None
        if args.profile:
            print("profiling ...", flush=True)
            prof = profile(d, res, args.messages, args.top)
            if "servers" in sections:
                prof += profile_redis(res, args.server_messages, args.top)
    results["machine"]["load_after"] = os.getloadavg()
    results["seconds"] = round(time.perf_counter() - started, 1)
    ts = tables(results)
    print()
    print(machine_text(results["machine"]))
    for t in ts:
        print()
        print(t.text())
    print(f"\n({results['seconds']} s)")
    if prof is not None:
        print(prof)
    if not args.no_save:
        args.out.mkdir(parents=True, exist_ok=True)
        write_markdown(args.out / "latest.md", results, ts)
        (args.out / "latest.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
        chart(args.out / "latest.png", results)
        written = ["latest.md", "latest.json", "latest.png"]
        if prof is not None:
            (args.out / "profile.txt").write_text(prof)
            written.append("profile.txt")
        print(f"wrote {', '.join(str(args.out / w) for w in written)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
