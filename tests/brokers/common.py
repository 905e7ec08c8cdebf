"""What every broker's end-to-end tests share: unique names and free ports, a ledger of effects
kept in PostgreSQL next to the dedup marker, a consumer run in the background until a
condition, a producer's retry loop, and a relay that cuts a test's own connections.

The ledger has no unique constraint on purpose: a duplicate effect would show as a second row
(a test that could not see a double effect could not fail).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Self
from urllib.parse import urlsplit, urlunsplit

import psycopg
import psycopg.types.json

import oncely
from oncely.brokers import BrokerConsumer, Producer
from tests.services import POSTGRES_DSN, require


def unique(prefix: str) -> str:
    """A name no other test (or earlier run) uses: queues, streams, subjects, tables."""
    return f"{prefix}_{uuid.uuid4().hex[:10]}"


def free_port() -> int:
    """A loopback port nothing listens on (once this returns): for a private server, or an
    address where no broker answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def with_port(url: str, port: int) -> str:
    """``url`` pointing at ``port`` on loopback (credentials, path and query kept)."""
    parts = urlsplit(url)
    userinfo, at, _address = parts.netloc.rpartition("@")
    return urlunsplit(parts._replace(netloc=f"{userinfo}{at}127.0.0.1:{port}"))


def require_postgres() -> None:
    require("PostgreSQL", POSTGRES_DSN, 5432)


class Ledger:
    """Effects as rows of a PostgreSQL table: ``apply`` writes one inside the handler's
    transaction (transactional mode) or on its own connection (two-phase mode)."""

    def __init__(self, table: str | None = None) -> None:
        self.table = table or unique("ledger")

    def create(self) -> None:
        with psycopg.connect(POSTGRES_DSN, autocommit=True) as conn:
            conn.execute(
                f"CREATE TABLE IF NOT EXISTS {self.table} "
                "(id bigserial PRIMARY KEY, key text NOT NULL, body jsonb NOT NULL, "
                "at timestamptz NOT NULL DEFAULT clock_timestamp())"
            )

    def drop(self) -> None:
        with psycopg.connect(POSTGRES_DSN, autocommit=True) as conn:
            conn.execute(f"DROP TABLE IF EXISTS {self.table}")

    async def apply_in(self, tx: psycopg.AsyncConnection[Any], key: str, body: object) -> None:
        await tx.execute(
            f"INSERT INTO {self.table} (key, body) VALUES (%s, %s)",
            (key, psycopg.types.json.Jsonb(body)),
        )

    async def apply(self, key: str, body: object) -> None:
        async with await psycopg.AsyncConnection.connect(POSTGRES_DSN, autocommit=True) as conn:
            await self.apply_in(conn, key, body)

    def counts(self) -> dict[str, int]:
        """Rows per key."""
        with psycopg.connect(POSTGRES_DSN) as conn:
            rows = conn.execute(f"SELECT key, count(*) FROM {self.table} GROUP BY key").fetchall()
        return dict(rows)


def pg_store(table: str | None = None) -> oncely.AsyncPostgresStore:
    """An async PostgreSQL store with its own table (dropped by :func:`drop_store_table`)."""
    return oncely.AsyncPostgresStore(POSTGRES_DSN, table=table or unique("inbox"))


def drop_store_table(table: str) -> None:
    """Drop a store's table and its schema-version table."""
    with psycopg.connect(POSTGRES_DSN, autocommit=True) as conn:
        conn.execute(f"DROP TABLE IF EXISTS {table}, {table}_meta, {table}_offsets")


@contextlib.asynccontextmanager
async def running(consumer: BrokerConsumer) -> AsyncIterator[asyncio.Task[None]]:
    """Run ``consumer`` in the background for the block; stop it (gracefully) after."""
    task = asyncio.create_task(consumer.run())
    try:
        yield task
    finally:
        consumer.stop()
        await asyncio.wait_for(task, 60)


async def wait_until(
    check: Callable[[], Awaitable[bool] | bool],
    *,
    timeout: timedelta = timedelta(seconds=60),
    what: str = "the condition",
) -> None:
    """Poll ``check`` until it is true; fail the test with ``what`` after ``timeout``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout.total_seconds()
    while True:
        value = check()
        if not isinstance(value, bool):
            value = await value
        if value:
            return
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout} waiting for {what}")
        await asyncio.sleep(0.05)


@dataclass
class Holder:
    """Another worker running a key's message, its handler waiting until :meth:`release`."""

    task: asyncio.Task[oncely.Handled[Any]]
    """The holder's ``handle``: its outcome once released."""
    _go: asyncio.Event

    def release(self) -> None:
        """Let the holder's handler go on to what it does then (and end its run)."""
        self._go.set()


@contextlib.asynccontextmanager
async def key_held(
    inbox: oncely.AsyncInbox, key: str, then: Callable[[dict[str, Any]], Awaitable[None]]
) -> AsyncIterator[Holder]:
    """Another worker holding ``key``'s claim on ``inbox`` (a live lease, renewed) for the
    block, which starts once the claim is taken: its handler (given ``{"k": key}``) waits
    until :meth:`Holder.release`, then runs ``then``. At the block's end the holder is
    released and awaited, whatever it raised."""
    go = asyncio.Event()

    async def holder(payload: dict[str, Any]) -> None:
        await go.wait()
        await then(payload)

    task = asyncio.create_task(inbox.handle(key, {"k": key}, holder))
    try:
        await wait_until(lambda: _claimed(inbox, key), what="the holder's claim")
        yield Holder(task, go)
    finally:
        go.set()
        with contextlib.suppress(Exception):
            await task


async def holder_fails(payload: dict[str, Any]) -> None:
    """What a :func:`key_held` holder may do once released: fail (its claim released)."""
    raise RuntimeError("the holder failed")


async def _claimed(inbox: oncely.AsyncInbox, key: str) -> bool:
    return await inbox.get(key) is not None


async def remove_destinations(url: str, source: str) -> None:
    """Delete what a test made on a broker for ``source``: the queue or stream, its
    dead-letter destination (``<source>.dead``) and, on RabbitMQ, the dead-letter exchange,
    so repeated runs leave nothing behind. Missing ones are skipped."""
    scheme = url.split("://", 1)[0]
    dead = f"{source}.dead"
    if scheme.startswith("amqp"):
        import aio_pika

        connection = await aio_pika.connect(url)
        async with connection:
            channel = await connection.channel()
            for name in (source, dead):
                with contextlib.suppress(Exception):
                    await channel.queue_delete(name)
            with contextlib.suppress(Exception):
                await channel.exchange_delete(dead)
    elif scheme.startswith("redis"):
        import redis.asyncio as aioredis

        client = aioredis.Redis.from_url(url)
        try:
            await client.delete(source, dead)
        finally:
            await client.aclose()
    elif scheme in ("nats", "tls"):
        import nats

        connection = await nats.connect(url)
        try:
            js = connection.jetstream()
            for subject in (source, dead):
                with contextlib.suppress(Exception):
                    await js.delete_stream(await js.find_stream_name_by_subject(subject))
        finally:
            await connection.close()
    elif scheme == "sqs":
        from tests.brokers.sqs_broker import delete_queues

        await delete_queues(url, source, f"{source}-dead")
    elif scheme == "kafka":
        from aiokafka.admin import AIOKafkaAdminClient

        admin = AIOKafkaAdminClient(
            bootstrap_servers=url.split("://", 1)[1].split("?", maxsplit=1)[0]
        )
        await admin.start()
        try:
            existing = set(await admin.list_topics())
            gone = [name for name in (source, dead) if name in existing]
            if gone:
                with contextlib.suppress(Exception):
                    await admin.delete_topics(gone)
        finally:
            await admin.close()


async def publish_until_confirmed(
    producer: Producer, body: bytes, message_id: str, *, tries: int = 200
) -> None:
    """What a producer does while the broker is away: retry with the same id (R2) until the
    broker confirms."""
    for _ in range(tries):
        try:
            await producer.publish(body, message_id=message_id)
            return
        except oncely.BrokerUnavailable:
            await asyncio.sleep(0.1)
    raise AssertionError(f"could not publish {message_id}")


class Proxy:
    """A TCP relay on loopback in front of a broker, so a test can cut its own clients'
    connections (:meth:`cut`) and refuse new ones (``refusing``), or go silent (``silent``:
    connections, new and open, are held but nothing is relayed either way, as a host that
    stopped answering behind a dead route would), without touching the server other tests
    share. Point a client at :meth:`url`."""

    def __init__(self, url: str, *, port: int = 0) -> None:
        self._parts = urlsplit(url)
        self._port = port
        self.accepted = 0
        self.refusing = False
        self.silent = False
        self._open: set[asyncio.StreamWriter] = set()
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> Self:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", self._port)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        self.cut()
        await self._server.wait_closed()

    @property
    def url(self) -> str:
        """The broker's URL with this relay's address in it."""
        assert self._server is not None
        return with_port(urlunsplit(self._parts), self._server.sockets[0].getsockname()[1])

    def cut(self) -> int:
        """Abort every relayed connection, both sides at once, as a network fault would;
        how many clients were connected."""
        clients = len(self._open) // 2
        for writer in list(self._open):
            writer.transport.abort()
        self._open.clear()
        return clients

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.refusing:
            writer.transport.abort()
            return
        if self.silent:
            self._open.add(writer)
            with contextlib.suppress(OSError):
                while await reader.read(65536):
                    pass  # swallowed: the client waits for an answer that never comes
            self._open.discard(writer)
            writer.transport.abort()
            return
        try:
            upstream_reader, upstream = await asyncio.open_connection(
                self._parts.hostname or "127.0.0.1", self._parts.port
            )
        except OSError:
            writer.transport.abort()
            return
        self.accepted += 1
        self._open |= {writer, upstream}

        async def pump(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError):
                while data := await source.read(65536):
                    if self.silent:
                        continue  # swallowed, as a dead route would
                    sink.write(data)
                    await sink.drain()
            sink.transport.abort()  # either side gone: the other goes too

        await asyncio.gather(pump(reader, upstream), pump(upstream_reader, writer))
        self._open -= {writer, upstream}
