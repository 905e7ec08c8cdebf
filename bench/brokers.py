"""Broker consumers with and without oncely, side by side: ``python bench/brokers.py``.

For each broker (RabbitMQ, Redis Streams, NATS JetStream) the same ``BrokerConsumer`` loop, on
the same transport and with the same concurrency, drains a queue (stream, subject) of
pre-published messages four ways:

``plain tx``
    no oncely: each message's effect is the business transaction of the core benchmark (a
    ledger insert and a balance update) in its own PostgreSQL transaction, as a team writes it
    by hand;
``marker by hand``
    the same transaction plus a dedup marker written by hand (``INSERT ... ON CONFLICT DO
    NOTHING`` into a table keyed by the message id): what the marker statement itself costs;
``oncely tx``
    the same transaction with oncely's marker in it (transactional mode on the PostgreSQL
    store, R7);
``plain row`` / ``oncely two-phase row``
    an effect outside the store: a ledger row in its own PostgreSQL transaction, without
    oncely, then under a claim and completion on the Redis store (two-phase mode, R10);
``plain incr`` / ``oncely two-phase incr``
    the cheapest effect there is, one Redis ``INCR``, without and with the two-phase mode on
    the Redis store: the worst case for oncely's share, since the claim and the completion are
    two more round trips of the same size as the effect itself.

Messages per second is the count drained over the time from the consumer's start until the
last one is acknowledged. Variants run in rounds with a rotating order and each round uses a
fresh queue; the table reports the medians and the ratio plain/oncely (the target:
oncely costs at most 1.5x in throughput). Every run checks its effects: one ledger row or one
increment per message, or the run fails.

Writes ``bench/results/brokers.md`` and ``brokers.json``. A broker or store that does not answer
is skipped with the reason.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psycopg
import psycopg_pool
import redis.asyncio as aioredis

import oncely
from oncely import Envelope, Handled, Outcome
from oncely.brokers import (
    BrokerConsumer,
    ConsumerSettings,
    InboxProcessor,
    Processor,
    open_producer,
    open_transport,
)

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the tests' broker helpers, for cleaning up
TARGET_RATIO = 1.5

POSTGRES = os.environ.get("ONCELY_TEST_POSTGRES_DSN", "postgresql://postgres@127.0.0.1:5432/test")
REDIS = os.environ.get("ONCELY_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
BROKERS = {
    "rabbitmq": os.environ.get("ONCELY_TEST_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/"),
    "redis-streams": REDIS,
    "nats": os.environ.get("ONCELY_TEST_NATS_URL", "nats://127.0.0.1:4222"),
}
VARIANTS = (
    "plain tx",
    "marker by hand",
    "oncely tx",
    "plain row",
    "oncely two-phase row",
    "plain incr",
    "oncely two-phase incr",
)
PAIRS = (
    ("transactional (PostgreSQL)", "plain tx", "oncely tx"),
    ("(marker by hand, for scale)", "plain tx", "marker by hand"),
    ("two-phase (Redis), row effect", "plain row", "oncely two-phase row"),
    ("two-phase (Redis), INCR effect", "plain incr", "oncely two-phase incr"),
)


def answers(url: str, port: int) -> bool:
    parts = urlsplit(url)
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or port), 2):
            return True
    except OSError:
        return False


class Plain:
    """A processor without oncely: runs the effect, reports ``processed``."""

    consumer = "bench"

    def __init__(self, effect: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
        self.effect = effect

    async def process(self, envelope: Envelope) -> Handled[Any]:
        await self.effect(envelope.body)  # type: ignore[arg-type]
        return Handled(Outcome.PROCESSED, self.consumer, envelope.message_id)

    def refuse(
        self, reason: str, *, key: str | None = None, correlation_id: str | None = None
    ) -> Handled[Any]:
        return Handled(Outcome.REJECTED, self.consumer, key, reason=reason)


class Setup:
    """The shared clients of one run: a PostgreSQL pool and ledger, a Redis client, stores."""

    def __init__(self, run: str) -> None:
        self.run = run
        self.ledger = f"bench_ledger_{run}"
        self.inbox_table = f"bench_inbox_{run}"
        self.counter = f"bench:{run}:effects"

    async def open(self) -> None:
        self.pool = psycopg_pool.AsyncConnectionPool(POSTGRES, min_size=4, max_size=16, open=False)
        await self.pool.open()
        async with self.pool.connection() as conn:
            await conn.execute(
                f"CREATE TABLE {self.ledger} (id bigserial PRIMARY KEY, n bigint NOT NULL)"
            )
            await conn.execute(
                f"CREATE TABLE {self.ledger}_accounts (id int PRIMARY KEY, balance bigint NOT NULL)"
            )
            await conn.execute(
                f"INSERT INTO {self.ledger}_accounts SELECT g, 0 FROM generate_series(0, 999) g"
            )
            await conn.execute(
                f"CREATE TABLE {self.ledger}_marks (consumer text, key text, "
                "PRIMARY KEY (consumer, key))"
            )
        self.redis = aioredis.Redis.from_url(REDIS)
        self.pg_store = oncely.AsyncPostgresStore(POSTGRES, table=self.inbox_table, pool_max=16)
        self.prefix = f"oncelybench{self.run}"
        self.redis_store = oncely.AsyncRedisStore.from_url(f"{REDIS}?prefix={self.prefix}")

    async def close(self) -> None:
        async with self.pool.connection() as conn:
            await conn.execute(
                f"DROP TABLE IF EXISTS {self.ledger}, {self.ledger}_accounts, {self.ledger}_marks"
            )
            await conn.execute(f"DROP TABLE IF EXISTS {self.inbox_table}")
        await self.pool.close()
        await self.redis.delete(self.counter)
        # The run's dedup records and, on Redis Streams, its streams: nothing left behind.
        for pattern in (f"{self.prefix}:*", f"bench_{self.run}_*"):
            async for name in self.redis.scan_iter(match=pattern, count=1000):
                await self.redis.unlink(name)
        await self.redis.aclose()
        await self.pg_store.aclose()
        await self.redis_store.aclose()

    async def ledger_rows(self) -> int:
        async with self.pool.connection() as conn:
            row = await (await conn.execute(f"SELECT count(*) FROM {self.ledger}")).fetchone()
        return int(row[0]) if row else 0

    def processor(self, variant: str, consumer: str) -> Processor:
        ledger = self.ledger
        insert = f"INSERT INTO {ledger} (n) VALUES (%s)".encode()

        update = f"UPDATE {ledger}_accounts SET balance = balance + 1 WHERE id = %s".encode()
        mark = f"INSERT INTO {ledger}_marks VALUES (%s, %s) ON CONFLICT DO NOTHING".encode()

        async def row_in(tx: psycopg.AsyncConnection[Any], body: dict[str, Any]) -> None:
            await tx.execute(insert, (body["n"],))
            await tx.execute(update, (body["n"] % 1000,))

        async def row(body: dict[str, Any]) -> None:
            async with self.pool.connection() as conn, conn.transaction():
                await row_in(conn, body)

        async def marked(body: dict[str, Any]) -> None:
            async with self.pool.connection() as conn, conn.transaction():
                await conn.execute(mark, (consumer, str(body["n"])))
                await row_in(conn, body)

        async def incr(body: dict[str, Any]) -> None:
            await self.redis.incr(self.counter)

        if variant == "plain tx" or variant == "plain row":
            return Plain(row)
        if variant == "oncely tx":
            inbox = oncely.AsyncInbox(self.pg_store, consumer=consumer)
            return InboxProcessor(inbox, row_in, mode="transactional")
        if variant == "marker by hand":
            return Plain(marked)
        if variant == "plain incr":
            return Plain(incr)
        inbox = oncely.AsyncInbox(self.redis_store, consumer=consumer)
        return InboxProcessor(inbox, row if variant == "oncely two-phase row" else incr)


async def publish(url: str, source: str, messages: int) -> None:
    producer = open_producer(url, source)
    try:
        for start in range(0, messages, 100):
            await asyncio.gather(
                *(
                    producer.publish(json.dumps({"n": n}).encode(), message_id=f"{source}-{n}")
                    for n in range(start, min(messages, start + 100))
                )
            )
    finally:
        await producer.close()


async def drain(
    url: str, source: str, processor: Processor, messages: int, concurrency: int
) -> float:
    """Seconds to consume ``messages`` already waiting in ``source``."""
    consumer = BrokerConsumer(
        open_transport(url, source, group=f"{source}-g", ack_wait=timedelta(seconds=30)),
        processor,
        settings=ConsumerSettings(concurrency=concurrency, poll=timedelta(milliseconds=100)),
    )
    started = time.perf_counter()
    task = asyncio.create_task(consumer.run())
    while sum(consumer.counts.values()) < messages:
        if task.done():
            await task
            raise RuntimeError(f"the consumer stopped after {dict(consumer.counts)}")
        await asyncio.sleep(0.002)
    elapsed = time.perf_counter() - started
    consumer.stop()
    await task
    bad = {k: n for k, n in consumer.counts.items() if k != "processed"}
    if bad:
        raise RuntimeError(f"unexpected outcomes {bad}")
    return elapsed


async def run_broker(
    name: str, url: str, messages: int, rounds: int, concurrency: int
) -> dict[str, Any]:
    from tests.brokers.common import remove_destinations  # noqa: PLC0415 - after the path

    run = uuid.uuid4().hex[:8]
    setup = Setup(run)
    await setup.open()
    rates: dict[str, list[float]] = {v: [] for v in VARIANTS}
    try:
        for r in range(rounds):
            order = VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]
            for variant in order:
                source = f"bench_{run}_{r}_{variant.replace(' ', '_').replace('-', '_')}"
                await publish(url, source, messages)
                rows_before = await setup.ledger_rows()
                count_before = int(await setup.redis.get(setup.counter) or 0)
                processor = setup.processor(variant, consumer=source)
                seconds = await drain(url, source, processor, messages, concurrency)
                await remove_destinations(url, source)
                rows = await setup.ledger_rows() - rows_before
                incr = int(await setup.redis.get(setup.counter) or 0) - count_before
                effects = incr if variant.endswith("incr") else rows
                if effects != messages:
                    raise RuntimeError(f"{name} {variant}: {effects} effects for {messages}")
                rates[variant].append(messages / seconds)
                print(f"  {name:<14} {variant:<17} {messages / seconds:8,.0f} msg/s", flush=True)
    finally:
        await setup.close()
    return {v: rates[v] for v in VARIANTS}


def table(results: dict[str, Any]) -> str:
    lines = [
        "| broker | mode and effect | without oncely (msg/s) | with oncely (msg/s) | cost |",
        "|---|---|---:|---:|---:|",
    ]
    for name, data in results["brokers"].items():
        if "skipped" in data:
            lines.append(f"| {name} | skipped: {data['skipped']} ||||")
            continue
        m = {v: statistics.median(data[v]) for v in VARIANTS}
        for label, plain, with_oncely in PAIRS:
            cost = m[plain] / m[with_oncely]
            verdict = "met" if cost <= TARGET_RATIO else "NOT met"
            lines.append(
                f"| {name} | {label} | {m[plain]:,.0f} | {m[with_oncely]:,.0f} | "
                f"{cost:.2f}x ({verdict}) |"
            )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python bench/brokers.py", description=__doc__.split("\n")[0])
    p.add_argument("--messages", type=int, default=2000, help="messages per run (default 2000)")
    p.add_argument("--rounds", type=int, default=3, help="rounds per broker (default 3)")
    p.add_argument("--concurrency", type=int, default=16, help="consumer concurrency (16)")
    p.add_argument("--only", action="append", choices=list(BROKERS), help="one broker")
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--no-save", action="store_true")
    args = p.parse_args(argv)
    command = "python bench/brokers.py" + (" " + " ".join(sys.argv[1:]) if sys.argv[1:] else "")
    results: dict[str, Any] = {
        "command": command,
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "messages": args.messages,
        "rounds": args.rounds,
        "concurrency": args.concurrency,
        "cpus": os.cpu_count(),
        "brokers": {},
    }
    ports = {"rabbitmq": 5672, "redis-streams": 6379, "nats": 4222}
    for name, url in BROKERS.items():
        if args.only and name not in args.only:
            continue
        if not answers(url, ports[name]) or not answers(POSTGRES, 5432) or not answers(REDIS, 6379):
            results["brokers"][name] = {"skipped": f"{name}, PostgreSQL or Redis does not answer"}
            continue
        print(f"{name}:", flush=True)
        results["brokers"][name] = asyncio.run(
            run_broker(name, url, args.messages, args.rounds, args.concurrency)
        )
    text = table(results)
    print()
    print(text)
    if not args.no_save:
        args.out.mkdir(parents=True, exist_ok=True)
        header = (
            f"# Broker consumers with and without oncely\n\n`{command}` on {results['date']}, "
            f"{results['cpus']} CPUs, {args.messages} messages per run, {args.rounds} rounds, "
            f"concurrency {args.concurrency}; medians of messages per second. Cost is plain / "
            f"oncely (target: at most {TARGET_RATIO}x).\n\n"
        )
        (args.out / "brokers.md").write_text(header + text + "\n")
        (args.out / "brokers.json").write_text(json.dumps(results, indent=1) + "\n")
        print(f"wrote {args.out / 'brokers.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
