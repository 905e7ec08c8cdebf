"""Leases on the real clock: heartbeats, waiting for an in-flight claim, thread and task races.

These use real threads, real asyncio tasks and real time (short leases). They assert on what
happened (outcomes, effects), never on how long it took.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest

import oncely
from oncely import Lease, Outcome

SHORT = Lease(duration=timedelta(milliseconds=300), renew_every=timedelta(milliseconds=50))
NO_BEAT = Lease(duration=timedelta(milliseconds=300), heartbeat=False)


@pytest.fixture(params=["memory", "sqlite"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> oncely.Store:
    if request.param == "memory":
        return oncely.MemoryStore()
    return oncely.SQLiteStore(tmp_path / "oncely.db")


@pytest.fixture(params=["memory", "sqlite"])
def async_store(request: pytest.FixtureRequest, tmp_path: Path) -> oncely.AsyncStore:
    if request.param == "memory":
        return oncely.AsyncMemoryStore()
    return oncely.AsyncSQLiteStore(tmp_path / "oncely.db")


def _in_thread(fn: object) -> tuple[threading.Thread, list[object]]:
    out: list[object] = []
    thread = threading.Thread(target=lambda: out.append(fn()))  # type: ignore[operator]
    thread.start()
    return thread, out


def test_r10_heartbeat_keeps_a_long_handler_s_claim(store: oncely.Store) -> None:
    inbox = oncely.Inbox(store, consumer="c", lease=SHORT)
    started = threading.Event()
    release = threading.Event()

    def long_handler(payload: object) -> str:
        started.set()
        release.wait(10)
        return "slow result"

    thread, out = _in_thread(lambda: inbox.handle("k", {"a": 1}, long_handler))
    assert started.wait(5)
    time.sleep(0.9)  # three leases: without renewals the claim would be stale by now
    other = oncely.Inbox(store, consumer="c", lease=SHORT)
    ran: list[int] = []
    busy = other.handle("k", {"a": 1}, lambda p: ran.append(1))
    assert busy.outcome is Outcome.IN_FLIGHT and not ran
    release.set()
    thread.join(10)
    assert out[0].outcome is Outcome.PROCESSED  # type: ignore[attr-defined]
    again = other.handle("k", {"a": 1}, lambda p: ran.append(1))
    assert again.outcome is Outcome.DUPLICATE and again.value == "slow result" and not ran


def test_r10_without_heartbeat_a_lapsed_claim_is_taken_over(store: oncely.Store) -> None:
    inbox = oncely.Inbox(store, consumer="c", lease=NO_BEAT)
    started = threading.Event()
    release = threading.Event()

    def stuck(payload: object) -> str:
        started.set()
        release.wait(10)
        return "zombie"

    thread, out = _in_thread(lambda: inbox.handle("k", {"a": 1}, stuck))
    assert started.wait(5)
    time.sleep(0.6)
    rescued = inbox.handle("k", {"a": 1}, lambda p: "rescuer")
    assert rescued.outcome is Outcome.STALE_RECLAIMED and rescued.value == "rescuer"
    release.set()
    thread.join(10)
    zombie = out[0]
    assert zombie.outcome is Outcome.IN_FLIGHT  # type: ignore[attr-defined]
    assert "lease lost" in zombie.reason  # type: ignore[attr-defined]
    assert inbox.handle("k", {"a": 1}, lambda p: "x").value == "rescuer"


def test_callers_can_wait_for_an_in_flight_result(store: oncely.Store) -> None:
    inbox = oncely.Inbox(store, consumer="c", lease=SHORT)
    started = threading.Event()

    def first(payload: object) -> dict[str, int]:
        started.set()
        time.sleep(0.4)
        return {"id": 7}

    thread, out = _in_thread(lambda: inbox.handle("k", {"a": 1}, first))
    assert started.wait(5)
    ran: list[int] = []
    waited = inbox.handle("k", {"a": 1}, lambda p: ran.append(1), wait=timedelta(seconds=10))
    thread.join(10)
    assert waited.outcome is Outcome.DUPLICATE and waited.value == {"id": 7} and not ran
    assert out[0].outcome is Outcome.PROCESSED  # type: ignore[attr-defined]


def test_a_waiter_takes_over_work_that_was_released(store: oncely.Store) -> None:
    inbox = oncely.Inbox(store, consumer="c", lease=SHORT)
    started = threading.Event()

    def fails(payload: object) -> None:
        started.set()
        time.sleep(0.3)
        raise RuntimeError("downstream 503")

    thread, out = _in_thread(lambda: inbox.handle("k", {"a": 1}, fails))
    assert started.wait(5)
    waited = inbox.handle("k", {"a": 1}, lambda p: "second try", wait=timedelta(seconds=10))
    thread.join(10)
    assert out[0].outcome is Outcome.FAILED  # type: ignore[attr-defined]
    assert waited.outcome is Outcome.PROCESSED and waited.value == "second try"


def test_waiting_gives_up_with_in_flight(store: oncely.Store) -> None:
    inbox = oncely.Inbox(store, consumer="c", lease=SHORT)
    started = threading.Event()
    release = threading.Event()

    def slow(payload: object) -> None:
        started.set()
        release.wait(10)

    @inbox.idempotent(key=lambda a: "d", wait=timedelta(milliseconds=50))
    def decorated(a: int) -> None:
        slow(a)

    thread, _ = _in_thread(lambda: inbox.handle("k", {"a": 1}, slow))
    assert started.wait(5)
    started.clear()
    # The decorated function's own call holds its key: another function's record of the
    # same key would be a key conflict, not in flight.
    other, _ = _in_thread(lambda: decorated(1))
    assert started.wait(5)
    try:
        waited = inbox.handle("k", {"a": 1}, lambda p: None, wait=timedelta(milliseconds=100))
        assert waited.outcome is Outcome.IN_FLIGHT
        with pytest.raises(oncely.InFlight):
            decorated(1)
    finally:
        release.set()
        thread.join(10)
        other.join(10)


def test_r8_threads_racing_on_one_key_have_one_winner(store: oncely.Store) -> None:
    inbox = oncely.Inbox(store, consumer="c", lease=SHORT)
    gate = threading.Barrier(16)
    effects: list[int] = []
    lock = threading.Lock()
    outcomes: list[Outcome] = []

    def effect(payload: object) -> str:
        with lock:
            effects.append(1)
        time.sleep(0.05)
        return "won"

    def worker() -> None:
        gate.wait(5)
        handled = inbox.handle("k", {"a": 1}, effect, wait=timedelta(seconds=10))
        with lock:
            outcomes.append(handled.outcome)

    threads = [threading.Thread(target=worker) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert len(effects) == 1
    assert sorted(outcomes).count(Outcome.PROCESSED) == 1
    assert outcomes.count(Outcome.DUPLICATE) == 15


async def test_r10_async_heartbeat_and_wait(async_store: oncely.AsyncStore) -> None:
    inbox = oncely.AsyncInbox(async_store, consumer="c", lease=SHORT)
    started = asyncio.Event()

    async def long_handler(payload: object) -> str:
        started.set()
        await asyncio.sleep(0.9)
        return "async result"

    first = asyncio.create_task(inbox.handle("k", {"a": 1}, long_handler))
    await asyncio.wait_for(started.wait(), 5)
    await asyncio.sleep(0.6)
    ran: list[int] = []

    async def second(payload: object) -> None:
        ran.append(1)

    busy = await inbox.handle("k", {"a": 1}, second)
    assert busy.outcome is Outcome.IN_FLIGHT  # renewed: not stale after two lease lengths
    waited = await inbox.handle("k", {"a": 1}, second, wait=timedelta(seconds=10))
    assert (await first).outcome is Outcome.PROCESSED
    assert waited.outcome is Outcome.DUPLICATE and waited.value == "async result" and not ran
    await async_store.aclose()


async def test_r8_concurrent_async_claims_have_one_winner(async_store: oncely.AsyncStore) -> None:
    claims = await asyncio.gather(
        *(
            async_store.claim(
                "c",
                "k",
                fingerprint=None,
                token=f"t{i}",
                lease_ms=30_000,
                keep_ms=60_000,
                takeover=True,
            )
            for i in range(40)
        )
    )
    winners = [c for c in claims if c.won]
    assert len(winners) == 1
    assert {c.record.token for c in claims} == {winners[0].record.token}
    await async_store.aclose()


async def test_cancelled_handler_releases_its_claim(async_store: oncely.AsyncStore) -> None:
    inbox = oncely.AsyncInbox(async_store, consumer="c", lease=SHORT)
    started = asyncio.Event()

    async def hangs(payload: object) -> None:
        started.set()
        await asyncio.sleep(30)

    task = asyncio.create_task(inbox.handle("k", {"a": 1}, hangs))
    await asyncio.wait_for(started.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await async_store.get("c", "k") is None  # released: a redelivery starts afresh
    await async_store.aclose()


def _in_forked_child(body: Callable[[], object]) -> object:
    """Run ``body`` in a forked child (killed by an alarm after 10 s if it hangs) and return
    what it returned, as JSON through a pipe; None when the child died without answering."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            signal.alarm(10)
            os.write(write, json.dumps(body()).encode())
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    with os.fdopen(read) as pipe:
        text = pipe.read()
    return json.loads(text) if text else None


def _child_keeps_its_lease(inbox: oncely.Inbox, store: oncely.Store) -> object:
    """In the child: a handler running three leases long, then whether its claim was still
    live (renewed) at the end, and the outcome."""
    live: list[bool] = []

    def long_handler(payload: object) -> str:
        time.sleep(0.9)
        record = store.get("c", "child-key")
        live.append(record is not None and record.lease_until_ms > time.time() * 1000)
        return "done"

    handled = inbox.handle("child-key", {"a": 1}, long_handler)
    return [handled.outcome.value, live]


def test_r10_a_forked_child_renews_its_own_leases(tmp_path: Path) -> None:
    """An inbox made before a fork (a prefork server's workers): the parent's heartbeat
    thread is alive at the fork, and does not exist in the child. The child starts its own,
    so a long handler there keeps its claim."""
    store = oncely.SQLiteStore(tmp_path / "oncely.db")
    inbox = oncely.Inbox(store, consumer="c", lease=SHORT)
    inbox.handle("parent-key", {"a": 1}, lambda p: time.sleep(0.2))  # the thread is up
    assert _in_forked_child(lambda: _child_keeps_its_lease(inbox, store)) == [
        "processed",
        [True],
    ]
    assert inbox.handle("child-key", {"a": 1}, lambda p: "again").value == "done"


def test_r10_a_fork_while_the_heartbeat_thread_holds_its_lock_does_not_hang_the_child(
    tmp_path: Path,
) -> None:
    """The parent's heartbeat thread holds its lock briefly on every wake-up; a fork at that
    moment left the lock held forever in the child, whose first claim then waited for it
    (a test under load caught it). A thread here holds the lock across the fork."""
    store = oncely.SQLiteStore(tmp_path / "oncely.db")
    inbox = oncely.Inbox(store, consumer="c", lease=SHORT)
    inbox.handle("parent-key", {"a": 1}, lambda p: None)
    holding, done = threading.Event(), threading.Event()

    def hold() -> None:
        with inbox._heartbeats._cond:
            holding.set()
            done.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    assert holding.wait(5)
    try:
        answer = _in_forked_child(lambda: _child_keeps_its_lease(inbox, store))
    finally:
        done.set()
        holder.join(10)
    assert answer == ["processed", [True]]


def test_r10_a_claim_dropped_without_an_ending_lapses_and_is_taken_over(
    store: oncely.Store,
) -> None:
    """Before, a claim collected while held kept its heartbeat for as long as the process
    lived: the key stayed in_flight for everyone. Now renewal stops, with a ResourceWarning,
    and the next caller takes the key over once the lease lapses."""
    inbox = oncely.Inbox(store, consumer="c", lease=SHORT)

    def drop() -> None:
        claimed = inbox.claim("k", {"n": 1})
        assert claimed.won

    with pytest.warns(ResourceWarning, match="dropped without complete"):
        drop()  # collected as it returns (nothing else refers to it)
    deadline = time.monotonic() + 10
    while True:
        again = inbox.claim("k", {"n": 1})
        if again.won or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert again.won and again.handled is None
    assert again.complete("done").outcome is Outcome.STALE_RECLAIMED


async def test_r10_an_async_claim_dropped_without_an_ending_lapses_too(
    async_store: oncely.AsyncStore,
) -> None:
    inbox = oncely.AsyncInbox(async_store, consumer="c", lease=SHORT)

    async def drop() -> None:
        claimed = await inbox.claim("k", {"n": 1})
        assert claimed.won

    with pytest.warns(ResourceWarning, match="dropped without complete"):
        await drop()
    deadline = time.monotonic() + 10
    while True:
        again = await inbox.claim("k", {"n": 1})
        if again.won or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    assert again.won
    assert (await again.complete("done")).outcome is Outcome.STALE_RECLAIMED
