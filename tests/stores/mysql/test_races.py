"""Races (R8): eight processes claim the same keys; one winner each."""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

import oncely
from oncely.errors import (
    StoreError,
)
from oncely.stores.mysql.async_store import AsyncMySQLStore
from oncely.stores.mysql.sync_store import MySQLStore
from tests.backends.mysql import url
from tests.chaos.harness import Processes
from tests.chaos.workers import Orphan, write_json
from tests.stores.mysql.helpers import KEEP_MS, LEASE_MS, _claim, _deadlocks

RACE_KEYS = 1000
RACERS = ("sync", "async") * 4


def race_worker(
    store_url: str, api: str, worker: str, seed: int, out: str, start: Any, parent_pid: int
) -> None:
    """Claim every one of ``RACE_KEYS`` keys in an order of this worker's own; write what it
    won and which token it saw win each key."""
    order = list(range(RACE_KEYS))
    random.Random(seed).shuffle(order)
    tally: dict[str, Any] = {"worker": worker, "won": [], "seen": {}, "errors": []}
    orphan = Orphan(parent_pid)

    def note(key: str, claim: oncely.stores.Claim) -> None:
        if claim.won:
            tally["won"].append(key)
        tally["seen"][key] = claim.record.token

    def run_sync() -> None:
        store = MySQLStore.from_url(store_url)
        store.get("racer", "warm-up")  # connect now, so the race starts at the first claim
        start.wait(timeout=60)
        for i in order:
            key = f"order-{i:04d}"
            try:
                note(key, _claim(store, key, f"{worker}/{i}", consumer="racer"))
            except StoreError as exc:
                tally["errors"].append(f"{key}: {exc!r}")
            if i % 100 == 0:
                orphan.check()
        store.close()

    async def run_async() -> None:
        store = AsyncMySQLStore.from_url(store_url)
        await store.get("racer", "warm-up")
        start.wait(timeout=60)  # blocking on purpose: nothing else runs before the start
        for i in order:
            key = f"order-{i:04d}"
            try:
                claim = await store.claim(
                    "racer", key, fingerprint="f", token=f"{worker}/{i}", lease_ms=LEASE_MS,
                    keep_ms=KEEP_MS, takeover=False,
                )  # fmt: skip
                note(key, claim)
            except StoreError as exc:
                tally["errors"].append(f"{key}: {exc!r}")
            if i % 100 == 0:
                orphan.check()
        await store.aclose()

    started = time.monotonic()
    if api == "sync":
        run_sync()
    else:
        asyncio.run(run_async())
    tally["seconds"] = time.monotonic() - started
    write_json(out, tally)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_r8_r9_eight_processes_racing_over_the_same_keys_elect_one_winner_each(
    table: str, tmp_path: Path
) -> None:
    """Eight processes (four on each twin), released together from a barrier, each claim the
    same 1,000 keys in its own random order: InnoDB's unique key gives each key to exactly
    one of them, and every other one is told who won."""
    store_url = url(table)
    MySQLStore.from_url(store_url).migrate()
    procs = Processes()
    deadlocks = _deadlocks()
    start = procs.ctx.Barrier(len(RACERS))
    outs = [tmp_path / f"racer{n}.json" for n in range(len(RACERS))]
    seed = random.randrange(2**32)
    try:
        started = [
            procs.start(
                race_worker,
                store_url,
                api,
                f"racer{n}-{api}",
                seed + n,
                str(outs[n]),
                start,
                os.getpid(),
                name=f"racer{n}",
            )
            for n, api in enumerate(RACERS)
        ]
        for process in started:
            process.join(timeout=100)
        codes = [p.exitcode for p in started]
    finally:
        left = procs.reap()
    assert not left and codes == [0] * len(RACERS), (left, codes)
    tallies = [json.loads(out.read_text()) for out in outs]
    errors = [e for t in tallies for e in t["errors"]]
    assert not errors, errors[:5]
    winners: dict[str, list[str]] = {}
    for tally in tallies:
        for key in tally["won"]:
            winners.setdefault(key, []).append(tally["worker"])
    keys = [f"order-{i:04d}" for i in range(RACE_KEYS)]
    assert sorted(winners) == keys
    doubled = {k: w for k, w in winners.items() if len(w) != 1}
    assert not doubled, f"seed={seed}: {doubled}"
    checker = MySQLStore.from_url(store_url)
    try:
        stored = {r.key: r.token for r in checker.scan(consumer="racer", limit=RACE_KEYS + 10)}
    finally:
        checker.close()
    for tally in tallies:
        mismatched = [k for k in keys if tally["seen"][k] != stored[k]]
        assert not mismatched, f"{tally['worker']} saw other winners for {mismatched[:5]}"
    wins = Counter({t["worker"]: len(t["won"]) for t in tallies})
    slowest = max(t["seconds"] for t in tallies)
    print(
        f"\n[R8 MariaDB race] seed={seed} {len(RACERS)} processes x {RACE_KEYS} keys: "
        f"wins {dict(wins)}; {len(RACERS) * RACE_KEYS / slowest:.0f} claims/s overall "
        f"(slowest racer {slowest:.2f}s); InnoDB deadlocks {_deadlocks() - deadlocks}"
    )
