"""NATS JetStream end to end, against a real nats-server: every scenario ends with each logical
message's effect applied exactly once (a ledger row per effect, no unique constraint), nothing
lost, and the durable consumer holding nothing pending or unacknowledged.

Two inbox flavours: the transactional mode on PostgreSQL (the ledger row is written in the
marker's transaction) and the two-phase mode on Redis. The restart tests run a private
nats-server of their own (a port and store directory per test), never the shared one.

Here the faults: a graceful stop giving back buffered messages, the server killed and
restarted mid-run, fetch and ack on a dropped connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

import oncely
from oncely.brokers import BrokerConsumer
from oncely.brokers.nats import JetStreamProducer
from tests.brokers.common import running, wait_until
from tests.brokers.nats_helpers import World, body, consumer_state, settings
from tests.services import REQUIRED

# ---------------------------------------------------------------------------- graceful stop


async def test_stop_gives_back_fetched_messages_no_handler_started(world: World) -> None:
    """Messages fetched from the server but never handed to a handler are given back (-NAK)
    at a graceful stop, so another consumer gets them at once rather than after ack_wait; the
    delivery whose handler is running is left alone and settled after the stop."""
    ack_wait = timedelta(seconds=60)
    producer = world.producer()
    first = world.transport(ack_wait=ack_wait)
    world.closers.append(first)
    await first.open(8)
    await producer.publish(body("started"), message_id="started")
    [started] = await first.fetch(8, timedelta(milliseconds=500))  # its handler "runs"
    # A fetch abandoned while it waits leaves its pull request open: what arrives for it
    # lands in nats-py's buffer, fetched from the server and never handed out.
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(first.fetch(8, timedelta(seconds=30)), 0.3)
    keys = [f"buffered-{i}" for i in range(3)]
    for key in keys:
        await producer.publish(body(key), message_id=key)

    async def some_buffered() -> bool:
        unacked, undelivered = await consumer_state(world.url, world.stream, world.group)
        return unacked >= 2 and unacked + undelivered == 1 + len(keys)

    await wait_until(some_buffered, what="messages delivered to the first consumer's buffer")
    await asyncio.sleep(0.2)  # let whatever else the server sends for that pull arrive
    await first.stop()
    second = BrokerConsumer(
        world.transport(ack_wait=ack_wait),
        world.pg_inbox(),
        world.in_tx,
        mode="transactional",
        settings=settings(),
    )
    async with running(second):
        # Far sooner than ack_wait (60 s): given back, not left to time out.
        await wait_until(
            world.has(len(keys)), timeout=timedelta(seconds=15), what="the buffered messages"
        )
        await started.ack()  # the running handler finishes after the stop
        await wait_until(world.settled, what="nothing pending")
    assert world.ledger.counts() == dict.fromkeys(keys, 1)  # "started" was never given back
    assert second.counts["processed"] == len(keys)


# ---------------------------------------------------------------------------- f. restarts


class PrivateNats:
    """A nats-server of this test's own: a free port and a store directory that outlive a
    kill, so the stream and the consumer's state survive a restart."""

    def __init__(self, store: Path) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.store = store
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> None:
        binary = shutil.which("nats-server")
        assert binary is not None
        self.proc = subprocess.Popen(
            [binary, "-js", "-a", "127.0.0.1", "-p", str(self.port), "-sd", str(self.store)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 20
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), 0.5):
                    return
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise AssertionError("the private nats-server did not start") from None
                time.sleep(0.05)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
            self.proc.wait(10)
        self.proc = None


@pytest.fixture
def private_nats(tmp_path: Path) -> Iterator[PrivateNats]:
    if shutil.which("nats-server") is None:
        reason = "nats-server is not installed; the restart tests run a private one"
        if REQUIRED:
            pytest.fail(reason)
        pytest.skip(reason)
    server = PrivateNats(tmp_path / "jetstream")
    server.start()
    try:
        yield server
    finally:
        server.kill()


async def publish_retrying(producer: JetStreamProducer, key: str) -> None:
    """What a producer does when the broker is away: retry with the same id (R2)."""
    while True:
        try:
            await producer.publish(body(key), message_id=key)
            return
        except oncely.BrokerUnavailable:
            await asyncio.sleep(0.1)


@pytest.mark.slow
async def test_f_server_killed_and_restarted_mid_run(
    private_nats: PrivateNats, world: World
) -> None:
    world.url = private_nats.url
    producer = world.producer()
    first = [f"k{i:03}" for i in range(60)]
    for key in first:
        await publish_retrying(producer, key)

    async def handler(tx: Any, payload: dict[str, Any]) -> None:
        await asyncio.sleep(0.02)
        await world.in_tx(tx, payload)

    transport = world.transport(ack_wait=timedelta(seconds=2))
    consumer = BrokerConsumer(
        transport, world.pg_inbox(), handler, mode="transactional", settings=settings()
    )
    async with running(consumer):
        await wait_until(world.has(15), what="a quarter of the messages")
        private_nats.kill(signal.SIGKILL)
        await wait_until(lambda: not transport.connected, what="the consumer to notice")
        await asyncio.sleep(0.5)  # a few fetches fail while the server is away
        private_nats.start()
        later = [f"k{i:03}" for i in range(60, 80)]
        for key in later:
            await publish_retrying(producer, key)
        await wait_until(world.has(80), what="every message after the restart")
        await wait_until(world.settled, what="nothing pending")
    assert world.ledger.counts() == dict.fromkeys(first + later, 1)
    assert consumer.counts["processed"] == 80


@pytest.mark.slow
async def test_f_fetch_and_ack_on_a_dropped_connection(
    private_nats: PrivateNats, world: World
) -> None:
    """An empty fetch returns []; with the server gone, fetch and ack raise BrokerUnavailable
    (never a raw client error, never a silent buffer); after the restart the unacknowledged
    message comes back and is acknowledged."""
    world.url = private_nats.url
    transport = world.transport(ack_wait=timedelta(seconds=1))
    await transport.open(4)
    try:
        assert await transport.fetch(4, timedelta(milliseconds=300)) == []
        producer = world.producer()
        await producer.publish(body("x"), message_id="x")
        [delivery] = await transport.fetch(4, timedelta(seconds=2))
        assert delivery.envelope.message_id == "x" and delivery.delivery_count == 1
        assert "stream_seq" in delivery.describe()
        private_nats.kill(signal.SIGTERM)
        await wait_until(lambda: not transport.connected, what="the connection to drop")
        with pytest.raises(oncely.BrokerUnavailable):
            await delivery.ack()
        with pytest.raises(oncely.BrokerUnavailable):
            await transport.fetch(4, timedelta(milliseconds=300))
        private_nats.start()
        again: list[Any] = []

        async def redelivered() -> bool:
            with contextlib.suppress(oncely.BrokerUnavailable):
                again.extend(await transport.fetch(4, timedelta(milliseconds=300)))
            return bool(again)

        await wait_until(redelivered, what="the redelivery")
        [copy] = again
        assert copy.envelope.message_id == "x" and (copy.delivery_count or 0) >= 2
        await copy.ack()
        await wait_until(world.settled, what="nothing pending")
    finally:
        await transport.close()
