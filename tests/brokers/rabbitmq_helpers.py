"""What the RabbitMQ end-to-end tests (``test_rabbitmq_*.py``) share: fast consumer
settings, one test's queue read back with a plain client, a publisher that sets no message id,
a transport that notes delivery counts, and small helpers. Their fixtures (``rabbit``,
``pg_inbox``, ``redis_inbox``) are in ``conftest.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import unquote, urlsplit

import aio_pika
import aiormq
import pamqp.body
import pamqp.exceptions
import pamqp.frame
import pamqp.header
import psycopg
import pytest
from pamqp import commands

from oncely.brokers import Backoff, ConsumerSettings, Delivery, open_transport
from oncely.brokers.rabbitmq import RabbitMQ
from tests.brokers.common import Ledger, wait_until
from tests.services import RABBITMQ_URL, require

CONSUMER = "rmq-tests"

FAST = ConsumerSettings(
    concurrency=4,
    requeue_delay=timedelta(milliseconds=200),
    backoff=Backoff(first=timedelta(milliseconds=100), most=timedelta(milliseconds=400)),
    max_deliveries=3,
    poll=timedelta(milliseconds=200),
    reconnect=Backoff(first=timedelta(milliseconds=200), most=timedelta(seconds=1)),
    shutdown_grace=timedelta(seconds=5),
)


def _require_rabbitmq() -> None:
    require("RabbitMQ", RABBITMQ_URL, 5672)


async def rabbitmqctl(*args: str) -> str:
    """Run ``rabbitmqctl`` without blocking the event loop the consumers run on."""
    if shutil.which("rabbitmqctl") is None:
        pytest.skip("rabbitmqctl is not installed here")
    proc = await asyncio.create_subprocess_exec(
        "rabbitmqctl",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate()
    if proc.returncode != 0:
        raise AssertionError(f"rabbitmqctl {' '.join(args)} failed: {err.decode()}")
    return out.decode()


@dataclass
class Rabbit:
    """One test's queue (and its dead-letter queue), read back with a plain client."""

    queue: str

    @property
    def dead(self) -> str:
        return f"{self.queue}.dead"

    @property
    def consumer_name(self) -> str:
        """The connection name a transport opened with ``group=CONSUMER`` uses."""
        return f"oncely {CONSUMER} {self.queue}"

    async def _declare(self, name: str, *, missing_ok: bool = False) -> tuple[int, int]:
        connection = await aio_pika.connect(RABBITMQ_URL)
        async with connection:
            channel = await connection.channel()
            try:
                queue = await channel.declare_queue(name, passive=True)
            except aiormq.exceptions.ChannelNotFoundEntity:
                if missing_ok:  # the consumer has not declared it yet
                    return 0, 0
                raise
            result = queue.declaration_result
            return result.message_count or 0, result.consumer_count or 0

    async def ready(self) -> int:
        return (await self._declare(self.queue))[0]

    async def consumers(self) -> int:
        return (await self._declare(self.queue, missing_ok=True))[1]

    async def dead_count(self) -> int:
        return (await self._declare(self.dead))[0]

    async def assert_settled(self) -> None:
        """Nothing left on the broker: once the queue has no consumer, whatever a consumer
        had not acknowledged is back in the queue, so an empty queue means all were acked."""
        await wait_until(self.consumers_gone, what="the queue to have no consumer left")
        assert await self.ready() == 0, "messages were left in the queue (unacknowledged)"

    async def consumers_gone(self) -> bool:
        return await self.consumers() == 0

    async def drain_dead(self) -> list[aio_pika.abc.AbstractIncomingMessage]:
        """Every message in the dead-letter queue, acknowledged (so the queue ends empty)."""
        found = []
        connection = await aio_pika.connect(RABBITMQ_URL)
        async with connection:
            channel = await connection.channel()
            queue = await channel.declare_queue(self.dead, passive=True)
            while (message := await queue.get(fail=False)) is not None:
                await message.ack()
                found.append(message)
            queue = await channel.declare_queue(self.dead, passive=True)
            assert queue.declaration_result.message_count == 0
        return found

    async def publish_without_message_id(self, body: bytes) -> None:
        """Publish a message that has no ``message_id`` property at all. aiormq gives every
        message it publishes without one a random id, so this speaks AMQP 0-9-1 itself."""
        await asyncio.to_thread(_publish_bare, self.queue, body)

    async def kill_consumer_connections(self) -> int:
        """Close this test's consumer connections from the broker's side."""
        table = await rabbitmqctl(
            "-q", "--no-table-headers", "list_connections", "pid", "client_properties"
        )
        pids = [row.split("\t", 1)[0] for row in table.splitlines() if self.consumer_name in row]
        for pid in pids:
            await rabbitmqctl("close_connection", pid, "oncely test: connection killed")
        return len(pids)

    async def delete(self) -> None:
        connection = await aio_pika.connect(RABBITMQ_URL)
        async with connection:
            for name in (self.queue, self.dead):
                channel = await connection.channel()
                with contextlib.suppress(aiormq.exceptions.AMQPError):
                    await channel.queue_delete(name)
            channel = await connection.channel()
            with contextlib.suppress(aiormq.exceptions.AMQPError):
                await channel.exchange_delete(self.dead)


def _publish_bare(queue: str, payload: bytes) -> None:
    """A minimal AMQP 0-9-1 publisher (confirmed) that sets only ``content_type``."""
    parts = urlsplit(RABBITMQ_URL)
    vhost = unquote(parts.path[1:]) if len(parts.path) > 1 else "/"
    buffer = b""

    def receive(sock: socket.socket) -> Any:
        nonlocal buffer
        while True:
            if buffer:
                with contextlib.suppress(pamqp.exceptions.UnmarshalingException):
                    used, _channel, frame = pamqp.frame.unmarshal(buffer)
                    buffer = buffer[used:]
                    if frame.name == "Heartbeat":
                        continue
                    return frame
            chunk = sock.recv(65536)
            if not chunk:
                raise AssertionError("RabbitMQ closed the connection")
            buffer += chunk

    def send(sock: socket.socket, frame: Any, channel: int = 0) -> None:
        sock.sendall(pamqp.frame.marshal(frame, channel))

    with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 5672), 10) as sock:
        sock.sendall(pamqp.header.ProtocolHeader().marshal())
        assert receive(sock).name == "Connection.Start"
        login = f"\0{unquote(parts.username or 'guest')}\0{unquote(parts.password or 'guest')}"
        send(sock, commands.Connection.StartOk(client_properties={}, response=login))
        tune = receive(sock)
        send(sock, commands.Connection.TuneOk(tune.channel_max, tune.frame_max, 0))
        send(sock, commands.Connection.Open(virtual_host=vhost))
        assert receive(sock).name == "Connection.OpenOk"
        send(sock, commands.Channel.Open(), 1)
        assert receive(sock).name == "Channel.OpenOk"
        send(sock, commands.Confirm.Select(), 1)
        assert receive(sock).name == "Confirm.SelectOk"
        send(sock, commands.Basic.Publish(exchange="", routing_key=queue, mandatory=True), 1)
        properties = commands.Basic.Properties(content_type="application/json", delivery_mode=2)
        send(sock, pamqp.header.ContentHeader(0, len(payload), properties), 1)
        send(sock, pamqp.body.ContentBody(payload), 1)
        assert receive(sock).name == "Basic.Ack", "the broker did not confirm the message"
        send(sock, commands.Connection.Close(200, "done", 0, 0))
        assert receive(sock).name == "Connection.CloseOk"


class Watching(RabbitMQ):
    """The transport, noting the delivery count of every delivery it hands out."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[tuple[str | None, int | None]] = []

    async def fetch(self, limit: int, timeout: timedelta) -> list[Delivery]:
        found = await super().fetch(limit, timeout)
        self.seen.extend((d.envelope.message_id, d.delivery_count) for d in found)
        return found

    def counts(self, message_id: str) -> list[int | None]:
        return [count for seen_id, count in self.seen if seen_id == message_id]


def transport(rabbit: Rabbit, **options: Any) -> RabbitMQ:
    made = open_transport(RABBITMQ_URL, rabbit.queue, group=CONSUMER, **options)
    assert isinstance(made, RabbitMQ)
    return made


def body(n: str, **extra: object) -> bytes:
    return json.dumps({"n": n, **extra}).encode()


def transactional(ledger: Ledger) -> Callable[[psycopg.AsyncConnection[Any], Any], Awaitable[None]]:
    async def apply(tx: psycopg.AsyncConnection[Any], payload: Any) -> None:
        await ledger.apply_in(tx, payload["n"], payload)

    return apply


@contextlib.asynccontextmanager
async def released_on_exit(release: asyncio.Event) -> AsyncIterator[None]:
    """Let blocked handlers finish before the consumers stop, even when the test fails."""
    try:
        yield
    finally:
        release.set()


async def _equals(value: Awaitable[int], expected: int) -> bool:
    return await value == expected
