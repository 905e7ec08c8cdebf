"""Redis Streams end to end, against a real Redis: every scenario ends with each logical
message's effect applied exactly once (a ledger row per effect, no unique constraint), nothing
lost, and nothing pending in the consumer group (XPENDING 0, lag 0).

Transactional mode runs on PostgreSQL (the effect and the marker in one transaction, R7);
two-phase mode on Redis (a claim, the handler, a completion, R10). The restart test runs its
own redis-server (append-only file on, fsync always) on a free port, so the shared server on
6379 is never touched.

Here the faults: an unreachable Redis, consumers killed with SIGKILL pruned by housekeeping,
Redis killed and restarted mid-run.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import redis

import oncely
from oncely.brokers.redis_streams import RedisStreamsProducer
from tests.brokers.common import Ledger, running, unique, wait_until
from tests.brokers.redis_streams_helpers import (
    GROUP,
    MS,
    _fetch_into,
    assert_settled,
    consumer,
    publish,
    settings,
    settled,
    transport,
)
from tests.services import REDIS_URL

# ---------------------------------------------------------------------- the transport itself


async def test_unreachable_redis_raises_broker_unavailable() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens here once the socket is closed
    dead = transport("nowhere", f"redis://127.0.0.1:{port}/0")
    with pytest.raises(oncely.BrokerUnavailable):
        await dead.open(4)
    producer = RedisStreamsProducer(f"redis://127.0.0.1:{port}/0", "nowhere")
    with pytest.raises(oncely.BrokerUnavailable):
        await producer.publish(b"{}", message_id="m")
    await producer.close()
    await dead.close()


# A process with two consumers of the group: "gone" reads nothing, "holder" reads one entry and
# never settles it. It prints once both are registered and is then killed with SIGKILL.
_KILLED_CONSUMERS = """
import asyncio, sys
from datetime import timedelta
from oncely.brokers.redis_streams import RedisStreams

async def main(url, stream, group):
    gone = RedisStreams(url, stream, group=group, consumer="gone", prune_idle_consumers=None)
    holder = RedisStreams(url, stream, group=group, consumer="holder", prune_idle_consumers=None)
    await gone.open(1)
    await holder.open(1)
    print(len(await holder.fetch(1, timedelta(seconds=10))), flush=True)
    await asyncio.sleep(3600)

asyncio.run(main(*sys.argv[1:]))
"""


def idle_consumers(admin: redis.Redis, stream: str) -> dict[str, tuple[int, int]]:
    """Each consumer of the group: (pending entries, idle milliseconds)."""
    return {
        c["name"].decode(): (int(c["pending"]), int(c["idle"]))
        for c in admin.xinfo_consumers(stream, GROUP)
    }


async def test_consumers_killed_with_sigkill_are_pruned_once_idle_and_empty(
    admin: redis.Redis, stream: str
) -> None:
    """Consumers whose process was SIGKILLed stay registered; a transport that opens deletes
    those idle past ``prune_idle_consumers`` that hold nothing, keeps one holding an entry
    until XAUTOCLAIM took the entry over, then deletes it too on a later round."""
    await publish(stream, "m-1", {"n": 1})
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _KILLED_CONSUMERS,
        REDIS_URL,
        stream,
        GROUP,
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert child.stdout is not None
        line = await asyncio.wait_for(child.stdout.readline(), 60)
        assert line.strip() == b"1"  # "holder" holds the entry
    finally:
        child.kill()  # SIGKILL: neither consumer leaves the group
        await child.wait()
    threshold = timedelta(seconds=2)
    limit_ms = threshold.total_seconds() * 1000

    def both_idle_past_the_threshold() -> bool:
        found = idle_consumers(admin, stream)
        return all(found[name][1] > limit_ms for name in ("gone", "holder"))

    await wait_until(both_idle_past_the_threshold, what="the killed consumers to be idle")
    admin.xgroup_createconsumer(stream, GROUP, "fresh")  # idle for far less than 2 s
    sweeper = transport(
        stream, consumer="sweeper", ack_wait=200 * MS, prune_idle_consumers=threshold
    )
    try:
        await sweeper.open(4)
        found = idle_consumers(admin, stream)
        assert set(found) == {"holder", "fresh", "sweeper"}  # "gone" was deleted
        assert found["holder"][0] == 1  # kept: it still holds the entry
        pending = admin.xpending_range(stream, GROUP, "-", "+", 10)
        assert [p["consumer"] for p in pending] == [b"holder"]
        taken: list[Any] = []
        await wait_until(lambda: _fetch_into(sweeper, taken), what="XAUTOCLAIM to take it")
        (delivery,) = taken
        assert delivery.delivery_count == 2
        await delivery.ack()

        async def holder_pruned() -> bool:
            await sweeper.fetch(4, 50 * MS)  # housekeeping runs again while reading
            return "holder" not in idle_consumers(admin, stream)

        await wait_until(holder_pruned, what="the emptied holder to be deleted")
        assert "sweeper" in idle_consumers(admin, stream)
    finally:
        await sweeper.close()
    assert_settled(admin, stream)


# ---------------------------------------------------------------------- broker restart


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _start_redis(port: int, directory: Path) -> subprocess.Popen[bytes]:
    server = subprocess.Popen(
        [
            shutil.which("redis-server") or "redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "yes",
            "--appendfsync",
            "always",
            "--dir",
            str(directory),
            "--logfile",
            str(directory / "redis.log"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    client = redis.Redis(port=port)
    deadline = time.monotonic() + 20
    try:
        while True:
            try:
                if client.ping():
                    return server
            except redis.exceptions.RedisError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"redis-server did not start on port {port}")
            time.sleep(0.05)
    finally:
        client.close()


@pytest.mark.slow
async def test_f_redis_killed_and_restarted_mid_run(
    tmp_path: Path,
    ledger: Ledger,
    pg: oncely.AsyncPostgresStore,
    caplog: pytest.LogCaptureFixture,
) -> None:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    port = _free_port()
    url = f"redis://127.0.0.1:{port}/0"
    stream = unique("rs")
    server = _start_redis(port, tmp_path)
    try:
        keys = [f"m-{i}" for i in range(40)]
        for key in keys:
            await publish(stream, key, {"k": key}, url=url)

        async def handler(tx: Any, payload: dict[str, str]) -> None:
            await ledger.apply_in(tx, payload["k"], payload)
            await asyncio.sleep(0.05)

        worker = consumer(
            stream,
            pg,
            handler,
            mode="transactional",
            url=url,
            consumer_settings=settings(concurrency=2),
            ack_wait=timedelta(seconds=1),
        )
        async with running(worker) as task:
            await wait_until(lambda: len(ledger.counts()) >= 8, what="some messages processed")
            server.send_signal(signal.SIGKILL)
            server.wait()
            done_at_kill = len(ledger.counts())
            await asyncio.sleep(0.5)  # the consumer meets the dead connection
            server = _start_redis(port, tmp_path)
            later = [f"m-{i}" for i in range(40, 50)]
            for key in later:
                await _publish_until_confirmed(stream, key, url)
            keys += later
            admin = redis.Redis(port=port)
            try:
                await wait_until(
                    lambda: len(ledger.counts()) == 50 and settled(admin, stream),
                    what="every message after the restart",
                )
                assert_settled(admin, stream)
            finally:
                admin.close()
            assert not task.done()  # the same consumer rode the restart out
        assert done_at_kill < 40  # the kill really was mid-run
        assert any("unavailable" in r.getMessage() for r in caplog.records)  # and was noticed
        assert ledger.counts() == dict.fromkeys(keys, 1)
        assert worker.counts["processed"] == 50
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(server.pid, signal.SIGKILL)
        server.wait()


async def _publish_until_confirmed(stream: str, key: str, url: str) -> None:
    """A producer's retry loop: the same message id on every attempt (R2)."""
    for _ in range(100):
        try:
            await publish(stream, key, {"k": key}, url=url)
            return
        except oncely.BrokerUnavailable:
            await asyncio.sleep(0.05)
    raise AssertionError(f"could not publish {key}")
