"""Races for the same keys (R8): threads and tasks sharing one store, and processes
each with their own: one winner per key.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

import oncely
from oncely._core.records import ClaimRequest
from oncely.stores.postgres.async_store import AsyncPostgresStore
from oncely.stores.postgres.sync_store import PostgresStore
from tests.chaos.harness import Processes
from tests.services import POSTGRES_DSN
from tests.stores.postgres.helpers import _TWO_PHASE, KEEP_MS, LEASE_MS, _claim, _sql


def test_r8_threads_sharing_one_store_race_one_winner_per_key(store: PostgresStore) -> None:
    store.migrate()
    keys = [f"k{i}" for i in range(200)]
    start = threading.Barrier(8)
    won: Counter[str] = Counter()

    def race(n: int) -> None:
        order = list(keys)
        random.Random(n).shuffle(order)
        start.wait()
        for key in order:
            if _claim(store, key, token=f"t{n}-{key}").won:
                won[key] += 1

    threads = [threading.Thread(target=race, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert won == Counter(dict.fromkeys(keys, 1))


async def test_r8_tasks_sharing_one_async_store_race_one_winner_per_key(table: str) -> None:
    store = AsyncPostgresStore(POSTGRES_DSN, table=table, pool_max=4)
    await store.migrate()
    keys = [f"k{i}" for i in range(200)]

    async def race(n: int) -> list[str]:
        order = list(keys)
        random.Random(n).shuffle(order)
        won = []
        for key in order:
            claim = await store.claim("c", key, fingerprint=None, token=f"t{n}-{key}", **_TWO_PHASE)
            if claim.won:
                won.append(key)
        return won

    results = await asyncio.gather(*(race(n) for n in range(8)))
    assert Counter(k for won in results for k in won) == Counter(dict.fromkeys(keys, 1))
    await store.aclose()


# ------------------------------------------------------------------ real processes (slow)


def _race_worker(table: str, worker: int, keys: int, api: str, out: str, start_line: Any) -> None:
    order = list(range(keys))
    random.Random(worker).shuffle(order)
    answers: dict[str, tuple[str, str]] = {}

    def note(key: str, claim: oncely.stores.Claim) -> None:
        answers[key] = (claim.status.value, claim.record.token)

    common = {"lease_ms": LEASE_MS, "keep_ms": KEEP_MS, "takeover": False}
    if api == "async":

        async def run() -> None:
            store = AsyncPostgresStore(POSTGRES_DSN, table=table, pool_max=2, migrate=False)
            await store.get("race", "warm-up")
            start_line.wait(60)
            for i in order:
                key = f"k{i}"
                note(
                    key,
                    await store.claim(
                        "race", key, fingerprint=None, token=f"w{worker}-{i}", **common
                    ),
                )  # type: ignore[arg-type]
            await store.aclose()

        asyncio.run(run())
    else:
        store = PostgresStore(POSTGRES_DSN, table=table, pool_max=2, migrate=False)
        store.get("race", "warm-up")
        start_line.wait(60)
        if api == "batch":
            for start in range(0, keys, 50):
                chunk = [
                    ClaimRequest(f"k{i}", None, f"w{worker}-{i}") for i in order[start : start + 50]
                ]
                for request, claim in zip(
                    chunk,
                    store.claim_many("race", chunk, **common),
                    strict=True,  # type: ignore[arg-type]
                ):
                    note(request.key, claim)
        else:
            for i in order:
                key = f"k{i}"
                note(
                    key,
                    store.claim("race", key, fingerprint=None, token=f"w{worker}-{i}", **common),
                )  # type: ignore[arg-type]
        store.close()
    Path(out).write_text(json.dumps(answers))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_r8_eight_processes_race_for_1000_keys_one_winner_each(table: str, tmp_path: Path) -> None:
    PostgresStore(POSTGRES_DSN, table=table).migrate()
    procs = Processes()
    apis = ["sync", "async", "batch", "sync", "async", "batch", "sync", "async"]
    start_line = procs.ctx.Barrier(len(apis))
    outs = [str(tmp_path / f"racer{n}.json") for n in range(len(apis))]
    try:
        started = [
            procs.start(_race_worker, table, n, 1000, api, outs[n], start_line, name=f"racer{n}")
            for n, api in enumerate(apis)
        ]
        for p in started:
            p.join(100)
        codes = [p.exitcode for p in started]
    finally:
        procs.reap()
    assert codes == [0] * len(apis)
    answers = [json.loads(Path(o).read_text()) for o in outs]
    stored = dict(_sql(f"SELECT key, token FROM {table} WHERE consumer = 'race'"))
    winners: Counter[str] = Counter()
    for by_key in answers:
        assert len(by_key) == 1000
        for key, (status, token) in by_key.items():
            assert token == stored[key], (key, status, token, stored[key])
            if status == "new":
                winners[key] += 1
    assert set(winners) == set(stored) and len(stored) == 1000
    assert set(winners.values()) == {1}  # exactly one winner per key
    # Each racer lost some keys: the claims really overlapped.
    assert all(sum(s == "existing" for s, _ in a.values()) > 0 for a in answers)
