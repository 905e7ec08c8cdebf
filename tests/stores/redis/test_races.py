"""Real processes racing for the same keys, and dying by SIGKILL in two-phase mode."""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import time
from collections import Counter
from datetime import timedelta
from typing import Any

import pytest
import redis

import oncely
from oncely import Outcome, Status
from oncely._core.records import ClaimRequest
from tests.backends.redis import with_options
from tests.services import REDIS_URL
from tests.stores.redis.helpers import KEEP_MS, LEASE_MS, _url_for

# ------------------------------------------------------------------ races (processes)

RACE_KEYS = 1000
RACE_WORKERS = 8


def race_worker(url: str, index: int, barrier: Any, results: Any) -> None:
    """Claim every race key once, in an order of this worker's own, right after the barrier;
    report the keys won. Even workers claim key by key, odd ones in batches of 50."""
    store = oncely.open(url)
    try:
        store.migrate()
        store.get("race", "warm-up")  # connection open, scripts known: the race starts level
        order = list(range(RACE_KEYS))
        random.Random(index).shuffle(order)
        won: list[int] = []
        barrier.wait(timeout=60)
        if index % 2 == 0:
            for i in order:
                claim = store.claim(
                    "race", f"key-{i}", fingerprint="f", token=f"w{index}-{i}",
                    lease_ms=LEASE_MS, keep_ms=KEEP_MS, takeover=True,
                )  # fmt: skip
                if claim.won:
                    won.append(i)
        else:
            for at in range(0, RACE_KEYS, 50):
                chunk = order[at : at + 50]
                requests = [ClaimRequest(f"key-{i}", "f", f"w{index}-{i}") for i in chunk]
                claims = store.claim_many(
                    "race", requests, lease_ms=LEASE_MS, keep_ms=KEEP_MS, takeover=True
                )
                won += [i for i, claim in zip(chunk, claims, strict=True) if claim.won]
        results.put((index, won))
    finally:
        store.close()


@pytest.mark.slow
@pytest.mark.services
@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["redis", "redis-cluster"])
def test_r8_r9_eight_processes_race_for_a_thousand_keys_one_winner_each(
    where: str, prefix: str, request: pytest.FixtureRequest
) -> None:
    url = with_options(_url_for(where, request), prefix=prefix)
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(RACE_WORKERS)
    results = ctx.Queue()
    workers = [
        ctx.Process(target=race_worker, args=(url, i, barrier, results), daemon=True)
        for i in range(RACE_WORKERS)
    ]
    try:
        for worker in workers:
            worker.start()
        reports = dict(results.get(timeout=100) for _ in workers)
    finally:
        _reap(workers)
    wins = Counter(i for won in reports.values() for i in won)
    assert sorted(wins) == list(range(RACE_KEYS)), "a key nobody won"
    assert set(wins.values()) == {1}, {i: n for i, n in wins.items() if n > 1}
    winners = {i: w for w, won in reports.items() for i in won}
    assert len(set(winners.values())) > 1  # a real race, not one worker alone
    store = oncely.open(url)
    held = {r.key: r.token for r in store.scan(consumer="race", limit=2 * RACE_KEYS)}
    assert held == {f"key-{i}": f"w{w}-{i}" for i, w in winners.items()}
    store.close()


def _reap(workers: list[Any]) -> None:
    for worker in workers:
        worker.join(timeout=30)
        if worker.is_alive():
            worker.kill()
            worker.join(timeout=10)


# ------------------------------------------------------------- SIGKILL crash (processes)

CRASH_KEYS = 120
CRASH_LEASE_MS = 800
CRASH_RENEW_MS = 150
POINTS = ("claimed", "effect", "completed")


def crash_worker(
    url: str,
    names: dict[str, str],
    worker: str,
    deliveries: list[tuple[str, str]],
    plan: tuple[str, int] | None,
) -> None:
    """Handle ``deliveries`` (message id, key) in two-phase mode. The effect is a push onto a
    Redis list that nothing dedups; the reconciler looks it up there. With a ``plan`` (point,
    n) the worker SIGKILLs itself the n-th time it reaches that point: right after its claim
    won, right after its effect, or right after the completion (before the acknowledgement)."""
    log = redis.Redis.from_url(REDIS_URL)
    store = oncely.open(url)
    reached: Counter[str] = Counter()

    def trip(point: str, key: str) -> None:
        reached[point] += 1
        if plan is not None and plan == (point, reached[point]):
            log.rpush(names["kills"], f"{point}|{key}|{worker}")
            os.kill(os.getpid(), signal.SIGKILL)

    def effect_of(key: str) -> str | None:
        for entry in log.lrange(names["effects"], 0, -1):
            done_key, _, by = entry.decode().partition("|")
            if done_key == key:
                return by
        return None

    def reconcile(stale: oncely.StaleClaim) -> oncely.Resolution:
        by = effect_of(stale.record.key)
        if by is None:
            return oncely.Resolution.retry()
        return oncely.Resolution.completed({"by": by})

    def charge(payload: dict[str, str]) -> dict[str, str]:
        key = payload["key"]
        trip("claimed", key)
        log.rpush(names["effects"], f"{key}|{worker}")
        trip("effect", key)
        return {"by": worker}

    lease = oncely.Lease(
        duration=timedelta(milliseconds=CRASH_LEASE_MS),
        renew_every=timedelta(milliseconds=CRASH_RENEW_MS),
    )
    inbox = oncely.Inbox(store, consumer="crash", lease=lease, on_stale=reconcile)
    for message_id, key in deliveries:
        handled = inbox.handle(key, {"key": key}, charge)
        if handled.outcome in (Outcome.PROCESSED, Outcome.STALE_RECLAIMED):
            trip("completed", key)
        if handled.action is oncely.Action.ACK:
            log.rpush(names["acks"], message_id)
    store.close()


@pytest.mark.slow
@pytest.mark.services
@pytest.mark.timeout(120)
def test_r10_sigkill_in_two_phase_mode_with_a_reconciler_every_effect_exactly_once(
    redis_url: str, prefix: str
) -> None:
    """Each message is published twice. Rounds of three worker processes take the messages
    not yet acknowledged; workers die by SIGKILL at chosen points and at random moments (from
    the parent), and the next round redelivers. A claim left by a dead worker lapses after the
    short lease; the reconciler completes it when the effect is on the list (no second
    effect) and retries it when it is not."""
    url = with_options(redis_url, prefix=prefix)
    names = {part: f"{prefix}:{part}" for part in ("effects", "kills", "acks")}
    log = redis.Redis.from_url(redis_url)
    keys = [f"order-{i:04d}" for i in range(CRASH_KEYS)]
    messages = [(f"{key}#{copy}", key) for copy in (1, 2) for key in keys]
    plans: list[list[tuple[str, int] | None]] = [
        [("claimed", 7), ("effect", 5), ("completed", 9)],
        [("effect", 2), ("claimed", 3), None],
        [("completed", 4), ("effect", 8), None],
    ]
    rng = random.Random(20_26)
    ctx = multiprocessing.get_context("spawn")
    parent_kills = 0
    for round_no in range(20):
        acked = {m.decode() for m in log.lrange(names["acks"], 0, -1)}
        remaining = [m for m in messages if m[0] not in acked]
        if not remaining:
            break
        rng.shuffle(remaining)
        plan = plans[round_no] if round_no < len(plans) else [None, None, None]
        workers = [
            ctx.Process(
                target=crash_worker,
                args=(url, names, f"w{round_no}.{slot}", remaining[slot::3], plan[slot]),
                daemon=True,
            )
            for slot in range(3)
        ]
        for worker in workers:
            worker.start()
        if round_no in (1, 2):  # one more death, at a moment the worker did not choose
            time.sleep(rng.uniform(0.6, 1.2))
            workers[2].kill()
            parent_kills += 1
        _reap(workers)
        time.sleep(CRASH_LEASE_MS / 1000)  # a dead worker's lease lapses before redelivery
    acked = {m.decode() for m in log.lrange(names["acks"], 0, -1)}
    effects = [e.decode().split("|") for e in log.lrange(names["effects"], 0, -1)]
    kills = [k.decode().split("|") for k in log.lrange(names["kills"], 0, -1)]
    summary = f"kills={kills} parent_kills={parent_kills} rounds={round_no}"
    print(f"\n[R10 Redis two-phase SIGKILL + reconciler] {summary}")
    assert acked == {m[0] for m in messages}, f"messages never acknowledged; {summary}"
    counts = Counter(key for key, _ in effects)
    assert set(counts) == set(keys), f"effects lost: {set(keys) - set(counts)}; {summary}"
    assert set(counts.values()) == {1}, {k: n for k, n in counts.items() if n > 1}
    assert {point for point, _, _ in kills} == set(POINTS), summary
    store = oncely.open(url)
    held = {r.key: r for r in store.scan(consumer="crash", limit=1000)}
    assert {k: r.status for k, r in held.items()} == dict.fromkeys(keys, Status.COMPLETED)
    by = dict(effects)
    for point, key, worker in kills:
        if point == "effect":  # effect done, completion not: the reconciler found it
            assert (held[key].error or "").startswith("reconciled"), (key, held[key], summary)
            assert by[key] == worker
        elif point == "claimed":  # claimed, no effect: another attempt did the work
            assert held[key].attempt >= 2 and by[key] != worker, (key, held[key], summary)
        else:  # completed, then killed before the ack: the redelivery was a duplicate
            assert by[key] == worker, (key, held[key], summary)
    store.close()
    log.close()
