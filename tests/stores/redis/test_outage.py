"""A real restart of the machine's Redis in the middle of a run."""

from __future__ import annotations

import queue
import sqlite3
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import pytest

import oncely
from oncely import StoreUnavailable
from tests.backends.redis import with_options
from tests.services import disruptive

# -------------------------------------------------------------- outage (real restart)

START_REDIS = [
    *("redis-server", "--daemonize", "yes", "--bind", "127.0.0.1", "-::1", "--port", "6379"),
    *("--save", "", "--appendonly", "no", "--dir", "/var/lib/redis"),
    *("--logfile", "/var/log/redis/ci.log"),
]  # the machine's start command (shared SERVICES.md)
OUTAGE_MESSAGES = 400


def _redis_answers() -> bool:
    done = subprocess.run(
        ["redis-cli", "-h", "127.0.0.1", "-p", "6379", "ping"],
        capture_output=True,
        text=True,
        timeout=10,
        check=False,
    )
    return "PONG" in done.stdout


def _until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


@pytest.mark.slow
@pytest.mark.services
@pytest.mark.timeout(120)
@disruptive("shuts down the machine's Redis (shutdown nosave)")
def test_outage_a_redis_restart_mid_run_is_ridden_out(
    redis_url: str, prefix: str, tmp_path: Path
) -> None:
    """Two consumer threads drain a broker (each message once) through one store; midway the
    machine's Redis is shut down (``shutdown nosave``) and started again.

    While it is down, every call raises StoreUnavailable (the message goes back to the
    broker, nothing else escapes); afterwards the same store reconnects and the run finishes.
    This Redis keeps nothing on disk, so the restart forgets every record: an acknowledged
    message is gone from the broker and never comes back, but a message whose handler had run
    when Redis went down cannot record its completion, is not acknowledged, and runs again
    (the store cannot know; Redis persistence is the cure, see the store's docstring). So the
    test asserts: every message acknowledged exactly once, and every effect exactly once
    except those repeats, which happen only to a message in flight at the restart (at most
    one per consumer) and only after the inbox reported that delivery as not done."""
    parts = urlsplit(redis_url)
    if (parts.hostname, parts.port or 6379) != ("127.0.0.1", 6379):
        pytest.skip("restarts only the machine's own Redis at 127.0.0.1:6379")
    effects = tmp_path / "effects.db"
    with sqlite3.connect(effects) as conn:
        conn.execute("CREATE TABLE effects (key TEXT NOT NULL, thread TEXT NOT NULL)")
    store = oncely.open(with_options(redis_url, prefix=prefix, timeout="2", connect_timeout="1"))
    inbox = oncely.Inbox(store, consumer="outage")
    broker: queue.Queue[str] = queue.Queue()
    for i in range(OUTAGE_MESSAGES):
        broker.put(f"order-{i:04d}")
    acked: list[str] = []
    acked_after_restart: list[str] = []
    exposed: Counter[str] = Counter()  # deliveries whose effect ran but which were not acked
    unavailable = Counter[str]()
    unexpected: list[BaseException] = []
    restarted = threading.Event()
    stop = threading.Event()

    def consume(name: str) -> None:
        conn = sqlite3.connect(effects, timeout=30, isolation_level=None)
        while not stop.is_set():
            try:
                key = broker.get(timeout=0.05)
            except queue.Empty:
                continue
            ran: list[bool] = []

            def charge(payload: dict[str, str], ran: list[bool] = ran) -> str:
                conn.execute("INSERT INTO effects VALUES (?, ?)", (payload["key"], name))
                ran.append(True)
                time.sleep(0.004)
                return name

            try:
                handled = inbox.handle(key, {"key": key}, charge)
            except StoreUnavailable:
                unavailable[name] += 1
                exposed[key] += len(ran)
                time.sleep(0.02)
                broker.put(key)
                continue
            except BaseException as exc:
                unexpected.append(exc)
                broker.put(key)
                continue
            if handled.action is oncely.Action.ACK:
                acked.append(key)
                if restarted.is_set():
                    acked_after_restart.append(key)
            else:
                exposed[key] += len(ran)
                time.sleep(0.02)
                broker.put(key)
        conn.close()

    consumers = [threading.Thread(target=consume, args=(f"c{i}",)) for i in range(2)]
    for consumer in consumers:
        consumer.start()
    try:
        _until(lambda: len(acked) >= 100, 30, "the first hundred messages")
        try:
            subprocess.run(
                ["redis-cli", "-h", "127.0.0.1", "-p", "6379", "shutdown", "nosave"],
                capture_output=True,
                timeout=10,
                check=False,
            )
            _until(lambda: not _redis_answers(), 10, "Redis to stop")
            failed_before = sum(unavailable.values())
            _until(lambda: sum(unavailable.values()) >= failed_before + 4, 5, "calls to fail")
        finally:
            if not _redis_answers():
                subprocess.run(START_REDIS, capture_output=True, timeout=30, check=False)
            _until(_redis_answers, 30, "Redis to answer again")
            restarted.set()
        _until(lambda: len(acked) >= OUTAGE_MESSAGES, 60, "every message")
    finally:
        stop.set()
        for consumer in consumers:
            consumer.join(timeout=30)
        store.close()
    print(
        f"\n[Redis outage] unavailable={dict(unavailable)} exposed={dict(+exposed)} "
        f"acked_after_restart={len(acked_after_restart)}"
    )
    assert not unexpected, unexpected
    assert sum(unavailable.values()) >= 4  # calls during the outage said StoreUnavailable
    assert acked_after_restart  # the same store carried on after the restart
    assert sorted(acked) == [f"order-{i:04d}" for i in range(OUTAGE_MESSAGES)]  # once each
    with sqlite3.connect(effects) as conn:
        counts = Counter(key for (key,) in conn.execute("SELECT key FROM effects"))
    assert set(counts) == set(acked)  # nothing lost
    repeats = {key: n for key, n in counts.items() if n != 1}
    assert repeats == {key: 1 + n for key, n in exposed.items() if n}, (repeats, exposed)
    assert sum(exposed.values()) <= len(consumers), exposed
