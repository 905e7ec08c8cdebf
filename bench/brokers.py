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

On Kafka (Tansu) and SQS (moto's server), which the consumer reads in batches by default,
these seven run per message (``batch=1``) and five more variants compare the batch mode with
the same loop doing the same batch statements by hand; the effect is one Redis ``INCR``:

``hand batch pg`` / ``oncely batch pg``
    per polled batch, one claim statement for every key (``INSERT ... SELECT FROM unnest ...
    ON CONFLICT DO NOTHING RETURNING``), the effects (a partition's in order, partitions side by
    side), one completion statement (``UPDATE ... FROM unnest``), by hand on a table of its
    own; and oncely's two-phase batch on the PostgreSQL store (``claim_many`` and
    ``complete_many``);
``hand batch redis`` / ``oncely batch redis``
    the same on Redis: one pipeline of ``SET NX PX`` claims, the effects, one pipeline of
    completions; and oncely's batch on the Redis store;
``hand batch pg, oncely's sql``
    the same loop running oncely's own two batch statements (the PostgreSQL store's
    ``claim_many`` and ``complete_many`` SQL, same parameters) by hand on the store's table:
    what the store's statements cost without oncely's Python, the floor for ``oncely batch pg``;
``oncely per-message pg``
    oncely's two-phase mode on the PostgreSQL store with ``batch=1``: the batch mode's gain.

``--effect count`` replaces the ``INCR`` of every variant that has one with an increment of a
counter in the consumer's own memory: the loop's and oncely's own cost, with no effect's round
trip to bound them.

Messages per second is the count drained over the time from the first settled message until
the last one (scaled up by the messages settled at that first moment), so that a consumer
group's join is not counted. Variants run in rounds with a rotating order and each round uses a
fresh queue; the table reports the medians and the ratio plain/oncely (the target:
oncely costs at most 1.5x in throughput). Every run checks its effects: one ledger row or one
increment per message, or the run fails.

Writes ``bench/results/brokers.md`` and ``brokers.json`` (with ``--only NAME``:
``brokers-NAME.md`` and ``.json``). A broker or store that does not answer
is skipped with the reason.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
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
    "kafka": "started by the tests' helper (Tansu)",
    "sqs": "started by the tests' helper (moto's server)",
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
BATCH_VARIANTS = (
    "hand batch pg",
    "hand batch pg, oncely's sql",
    "oncely batch pg",
    "hand batch redis",
    "oncely batch redis",
    "oncely per-message pg",
)
BATCH_PAIRS = (
    ("batch, two-phase (PostgreSQL), {effect}", "hand batch pg", "oncely batch pg", 1.25),
    (
        "batch, two-phase (PostgreSQL), oncely's statements by hand, {effect}",
        "hand batch pg, oncely's sql",
        "oncely batch pg",
        1.25,
    ),
    ("batch, two-phase (Redis), {effect}", "hand batch redis", "oncely batch redis", 1.25),
    (
        "batch gain (PostgreSQL): per message / batch",
        "oncely per-message pg",
        "oncely batch pg",
        0.1,
    ),
)
BATCHED = ("kafka", "sqs")
EFFECTS = {"incr": "INCR effect", "count": "in-memory count effect"}
ALL = VARIANTS + BATCH_VARIANTS
PAIRS = (
    ("transactional (PostgreSQL)", "plain tx", "oncely tx"),
    ("(marker by hand, for scale)", "plain tx", "marker by hand"),
    ("two-phase (Redis), row effect", "plain row", "oncely two-phase row"),
    ("two-phase (Redis), {effect}", "plain incr", "oncely two-phase incr"),
)


def started(name: str) -> str:
    """The URL of the Kafka (Tansu) or SQS (moto) broker the tests' helpers start."""
    if name == "kafka":
        from tests.brokers.kafka_broker import kafka_url  # noqa: PLC0415 - after the path

        return kafka_url()
    from tests.brokers.sqs_broker import sqs_url  # noqa: PLC0415 - after the path

    return sqs_url()


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


class HandBatch:
    """The batch mode written by hand: one claim statement (or pipeline) for the batch, the
    effects (a group's in order, groups side by side), one completion statement."""

    consumer = "bench"

    def __init__(
        self,
        claim: Callable[[list[str]], Awaitable[set[str]]],
        complete: Callable[[list[str]], Awaitable[None]],
        effect: Callable[[dict[str, Any]], Awaitable[None]],
    ) -> None:
        self.claim, self.complete, self.effect = claim, complete, effect

    async def process(self, envelope: Envelope) -> Handled[Any]:
        raise NotImplementedError("a batch processor")

    async def process_batch(
        self, envelopes: Sequence[Envelope], groups: Sequence[Any], concurrency: int, stop: Any
    ) -> list[Handled[Any]]:
        keys = [str(e.message_id) for e in envelopes]
        won = await self.claim(keys)
        runs: dict[Any, list[Envelope]] = {}
        for envelope, group in zip(envelopes, groups, strict=True):
            if envelope.message_id in won:
                runs.setdefault(group, []).append(envelope)

        async def run(members: list[Envelope]) -> None:
            for envelope in members:
                await self.effect(envelope.body)  # type: ignore[arg-type]

        await asyncio.gather(*(run(m) for m in runs.values()))
        await self.complete([k for k in keys if k in won])
        return [
            Handled(Outcome.PROCESSED if k in won else Outcome.DUPLICATE, self.consumer, k)
            for k in keys
        ]

    def refuse(
        self, reason: str, *, key: str | None = None, correlation_id: str | None = None
    ) -> Handled[Any]:
        return Handled(Outcome.REJECTED, self.consumer, key, reason=reason)


class Setup:
    """The shared clients of one run: a PostgreSQL pool and ledger, a Redis client, stores."""

    def __init__(self, run: str, effect: str = "incr") -> None:
        self.run = run
        self.effect = effect
        self.local = 0  # the in-memory counter of --effect count
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
            await conn.execute(
                f"CREATE TABLE {self.ledger}_claims (consumer text, key text, status text, "
                "expires_ms bigint, PRIMARY KEY (consumer, key))"
            )
        self.redis = aioredis.Redis.from_url(REDIS)
        self.pg_store = oncely.AsyncPostgresStore(POSTGRES, table=self.inbox_table, pool_max=16)
        self.prefix = f"oncelybench{self.run}"
        self.redis_store = oncely.AsyncRedisStore.from_url(f"{REDIS}?prefix={self.prefix}")
        await self.pg_store.release("bench", "warm-up", token="-")  # creates the store's table

    async def close(self) -> None:
        async with self.pool.connection() as conn:
            await conn.execute(
                f"DROP TABLE IF EXISTS {self.ledger}, {self.ledger}_accounts, "
                f"{self.ledger}_marks, {self.ledger}_claims"
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

    async def increments(self) -> int:
        """The effects counted so far: in Redis, or in memory with ``--effect count``."""
        if self.effect == "count":
            return self.local
        return int(await self.redis.get(self.counter) or 0)

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
            if self.effect == "count":
                self.local += 1
            else:
                await self.redis.incr(self.counter)

        if variant.startswith("hand batch"):
            return self.hand_batch(variant, consumer, incr)
        if variant in ("oncely batch pg", "oncely per-message pg"):
            return InboxProcessor(oncely.AsyncInbox(self.pg_store, consumer=consumer), incr)
        if variant == "oncely batch redis":
            return InboxProcessor(oncely.AsyncInbox(self.redis_store, consumer=consumer), incr)
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

    def hand_batch(
        self, variant: str, consumer: str, effect: Callable[[dict[str, Any]], Awaitable[None]]
    ) -> HandBatch:
        table = f"{self.ledger}_claims"
        claim_sql = (
            f"INSERT INTO {table} SELECT %s, k, 'p', 0 FROM unnest(%s::text[]) k "
            "ON CONFLICT DO NOTHING RETURNING key"
        ).encode()
        done_sql = (
            f"UPDATE {table} t SET status = 'd', expires_ms = 1 FROM unnest(%s::text[]) k "
            "WHERE t.consumer = %s AND t.key = k"
        ).encode()
        prefix = f"{self.prefix}:hand:{consumer}:"

        async def claim_pg(keys: list[str]) -> set[str]:
            async with self.pool.connection() as conn:
                cur = await conn.execute(claim_sql, (consumer, keys))
                return {row[0] for row in await cur.fetchall()}

        async def done_pg(keys: list[str]) -> None:
            async with self.pool.connection() as conn:
                await conn.execute(done_sql, (keys, consumer))

        async def claim_redis(keys: list[str]) -> set[str]:
            pipe = self.redis.pipeline(transaction=False)
            for k in keys:
                pipe.set(prefix + k, "p", nx=True, px=60_000)
            return {k for k, ok in zip(keys, await pipe.execute(), strict=True) if ok}

        async def done_redis(keys: list[str]) -> None:
            pipe = self.redis.pipeline(transaction=False)
            for k in keys:
                pipe.set(prefix + k, "d", px=600_000)
            await pipe.execute()

        if variant == "hand batch pg":
            return HandBatch(claim_pg, done_pg, effect)
        if variant == "hand batch pg, oncely's sql":
            return self.store_sql_batch(consumer, effect)
        return HandBatch(claim_redis, done_redis, effect)

    def store_sql_batch(
        self, consumer: str, effect: Callable[[dict[str, Any]], Awaitable[None]]
    ) -> HandBatch:
        """The PostgreSQL store's own ``claim_many`` and ``complete_many`` statements, sent by
        hand with the parameters the store sends (a 35-character fingerprint and a fresh
        32-character token per key, the server's clock), on the store's table."""
        from oncely.stores.postgres.dialect import text_array  # noqa: PLC0415 - internals

        dialect = self.pg_store._dialect  # the store's statements, sent by hand
        tokens: dict[str, str] = {}

        async def claim(keys: list[str]) -> set[str]:
            for k in keys:
                tokens[k] = os.urandom(16).hex()
            params = {
                "now": None,
                "consumer": consumer,
                "keys": text_array(keys),
                "fingerprints": text_array(["f" * 35] * len(keys)),
                "tokens": text_array([tokens[k] for k in keys]),
                "lease": 60_000,
                "span": 600_000,
            }
            async with self.pool.connection() as conn:
                rows = await (await conn.execute(dialect.claim_many, params)).fetchall()
            return {k for k, row in zip(keys, rows, strict=True) if row[1]}

        async def complete(keys: list[str]) -> None:
            params = {
                "now": None,
                "consumer": consumer,
                "keys": text_array(keys),
                "tokens": text_array([tokens.pop(k) for k in keys]),
                "results": [None] * len(keys),
                "notes": text_array([None] * len(keys)),
                "keep": 600_000,
            }
            async with self.pool.connection() as conn:
                done = await (await conn.execute(dialect.complete_many, params)).fetchall()
            if len(done) != len(keys):
                raise RuntimeError(f"completed {len(done)} of {len(keys)} by hand")

        return HandBatch(claim, complete, effect)


async def publish(url: str, source: str, messages: int) -> None:
    if url.startswith("kafka://"):
        from tests.brokers.kafka_broker import create_topic  # noqa: PLC0415 - optional

        create_topic(source, 4)
        url += "?linger=0.02"  # records travel in batches, as a busy producer sends them
    elif url.startswith("sqs://"):
        from tests.brokers.sqs_broker import create_queue  # noqa: PLC0415 - optional

        create_queue(source)
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
    url: str,
    source: str,
    processor: Processor | HandBatch,
    messages: int,
    concurrency: int,
    batch: int | None = None,
) -> float:
    """Seconds to consume ``messages`` already waiting in ``source``."""
    consumer = BrokerConsumer(
        open_transport(url, source, group=f"{source}-g", ack_wait=timedelta(seconds=30)),
        processor,  # type: ignore[arg-type]
        settings=ConsumerSettings(
            concurrency=concurrency, poll=timedelta(milliseconds=100), batch=batch
        ),
    )
    task = asyncio.create_task(consumer.run())
    started: float | None = None  # from the first settled message: a group join is not timed
    first = 0
    while (done := sum(consumer.counts.values())) < messages:
        if task.done():
            await task
            raise RuntimeError(f"the consumer stopped after {dict(consumer.counts)}")
        if started is None and done:
            started, first = time.perf_counter(), done
        await asyncio.sleep(0.002)
    if started is None:  # everything in the first batch
        raise RuntimeError("increase --messages: one batch held them all")
    elapsed = (time.perf_counter() - started) * messages / (messages - first)
    consumer.stop()
    await task
    bad = {k: n for k, n in consumer.counts.items() if k != "processed"}
    if bad:
        raise RuntimeError(f"unexpected outcomes {bad}")
    return elapsed


async def run_broker(
    name: str,
    url: str,
    messages: int,
    rounds: int,
    concurrency: int,
    chosen: Sequence[str],
    effect: str = "incr",
) -> dict[str, Any]:
    from tests.brokers.common import remove_destinations  # noqa: PLC0415 - after the path

    run = uuid.uuid4().hex[:8]
    setup = Setup(run, effect)
    await setup.open()
    variants = tuple(
        v for v in VARIANTS + (BATCH_VARIANTS if name in BATCHED else ()) if v in chosen
    )
    rates: dict[str, list[float]] = {v: [] for v in variants}
    try:
        for r in range(rounds):
            order = variants[r % len(variants) :] + variants[: r % len(variants)]
            for variant in order:
                source = f"bench_{run}_{r}_{re.sub('[^a-z0-9]+', '_', variant)}"
                await publish(url, source, messages)
                rows_before = await setup.ledger_rows()
                count_before = await setup.increments()
                processor = setup.processor(variant, consumer=source)
                batch = None if "batch" in variant.split() else 1  # batch mode
                seconds = await drain(url, source, processor, messages, concurrency, batch)
                await remove_destinations(url, source)
                rows = await setup.ledger_rows() - rows_before
                incr = await setup.increments() - count_before
                effects = incr if variant.endswith("incr") or variant in BATCH_VARIANTS else rows
                if effects != messages:
                    raise RuntimeError(f"{name} {variant}: {effects} effects for {messages}")
                rates[variant].append(messages / seconds)
                print(f"  {name:<14} {variant:<17} {messages / seconds:8,.0f} msg/s", flush=True)
    finally:
        await setup.close()
    return {v: rates[v] for v in variants}


def table(results: dict[str, Any]) -> str:
    lines = [
        "| broker | mode and effect | without oncely (msg/s) | with oncely (msg/s) | cost |",
        "|---|---|---:|---:|---:|",
    ]
    for name, data in results["brokers"].items():
        if "skipped" in data:
            lines.append(f"| {name} | skipped: {data['skipped']} ||||")
            continue
        m = {v: statistics.median(rates) for v, rates in data.items()}
        pairs = [(*pair, TARGET_RATIO) for pair in PAIRS]
        if name in BATCHED:
            pairs = [(f"per message, {label}", a, b, t) for label, a, b, t in pairs]
            pairs += list(BATCH_PAIRS)
        effect = EFFECTS[results.get("effect", "incr")]
        for shape, plain, with_oncely, target in pairs:
            label = shape.format(effect=effect)
            if plain not in m or with_oncely not in m:
                continue
            cost = m[plain] / m[with_oncely]
            verdict = "met" if cost <= target else "NOT met"
            lines.append(
                f"| {name} | {label} | {m[plain]:,.0f} | {m[with_oncely]:,.0f} | "
                f"{cost:.2f}x ({verdict}, target {target:g}x) |"
            )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python bench/brokers.py", description=__doc__.split("\n")[0])
    p.add_argument("--messages", type=int, default=2000, help="messages per run (default 2000)")
    p.add_argument("--rounds", type=int, default=3, help="rounds per broker (default 3)")
    p.add_argument("--concurrency", type=int, default=16, help="consumer concurrency (16)")
    p.add_argument("--only", action="append", choices=list(BROKERS), help="one broker")
    p.add_argument(
        "--effect",
        choices=list(EFFECTS),
        default="incr",
        help="the effect of the INCR variants: a Redis INCR (default) or an in-memory count",
    )
    p.add_argument("--variant", action="append", choices=ALL, help="one variant (repeatable)")
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
        "effect": args.effect,
        "cpus": os.cpu_count(),
        "brokers": {},
    }
    ports = {"rabbitmq": 5672, "redis-streams": 6379, "nats": 4222}
    for name, url in BROKERS.items():
        if args.only and name not in args.only:
            continue
        where = url
        if name in BATCHED:
            try:
                where = started(name)
            except BaseException as exc:  # the helpers skip (a pytest exception) when missing
                results["brokers"][name] = {"skipped": f"{name}: {exc}"}
                continue
        elif not answers(url, ports[name]):
            results["brokers"][name] = {"skipped": f"{name} does not answer"}
            continue
        if not answers(POSTGRES, 5432) or not answers(REDIS, 6379):
            results["brokers"][name] = {"skipped": f"{name}, PostgreSQL or Redis does not answer"}
            continue
        print(f"{name}:", flush=True)
        results["brokers"][name] = asyncio.run(
            run_broker(
                name,
                where,
                args.messages,
                args.rounds,
                args.concurrency,
                args.variant or ALL,
                args.effect,
            )
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
            f"oncely (target: at most {TARGET_RATIO}x; batch rows: by hand / oncely at most "
            "1.25x, i.e. oncely at least 0.8x; the batch gain row: per message / batch at most "
            "0.1x, i.e. batches at least 10x).\n\n"
        )
        stem = "brokers" + "".join(f"-{name}" for name in args.only or ())
        (args.out / f"{stem}.md").write_text(header + text + "\n")
        (args.out / f"{stem}.json").write_text(json.dumps(results, indent=1) + "\n")
        print(f"wrote {args.out / f'{stem}.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
