"""What every broker's end-to-end tests share: unique names, a ledger of effects kept in
PostgreSQL next to the dedup marker, and a consumer run in the background until a condition.

The ledger has no unique constraint on purpose: a duplicate effect would show as a second row
(a test that could not see a double effect could not fail).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import timedelta
from typing import Any

import psycopg
import psycopg.types.json

import oncely
from oncely.brokers import BrokerConsumer
from tests.services import POSTGRES_DSN, require


def unique(prefix: str) -> str:
    """A name no other test (or earlier run) uses: queues, streams, subjects, tables."""
    return f"{prefix}_{uuid.uuid4().hex[:10]}"


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
        conn.execute(f"DROP TABLE IF EXISTS {table}, {table}_meta")


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
