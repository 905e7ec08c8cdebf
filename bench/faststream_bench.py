"""FastStream subscribers with and without oncely, side by side:
``python bench/faststream_bench.py``.

One FastStream RabbitMQ broker (in process, its subscriber handling one message at a time,
FastStream's default) drains ``--messages`` pre-published messages of
one subscriber whose effect is one Redis ``INCR``, three ways, in rounds with a rotating
order:

``bare``
    no middleware: the subscriber alone;
``by hand``
    a broker middleware of a few lines doing what a team would write by hand on the same
    Redis (redis-py's asyncio client): a ``SET key NX PX`` claim before the handler, a
    ``SET key done`` after it, a duplicate acknowledged unrun (two round trips, as oncely's
    two-phase mode);
``oncely``
    ``oncely.integrations.faststream.Idempotency`` on the async Redis store.

Reports messages per second (medians of the rounds) and each against ``by hand``; writes
``bench/results/faststream.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aio_pika
import redis.asyncio as aioredis
from faststream import BaseMiddleware
from faststream.exceptions import AckMessage
from faststream.rabbit import RabbitBroker, RabbitQueue
from worker_rounds import rotating_rounds, write_table

import oncely
from oncely.integrations.faststream import Idempotency

HERE = Path(__file__).resolve().parent
AMQP = os.environ.get("ONCELY_TEST_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/")
REDIS = os.environ.get("ONCELY_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
VARIANTS = ("bare", "by hand", "oncely")


def by_hand(client: aioredis.Redis, prefix: str) -> Callable[..., BaseMiddleware]:
    """A claim and a completion written by hand, on the same Redis."""

    class ByHand(BaseMiddleware):
        async def consume_scope(self, call_next: Callable[[Any], Awaitable[Any]], msg: Any) -> Any:
            key = f"{prefix}:{msg.raw_message.message_id}"
            if not await client.set(key, "running", nx=True, px=60_000):
                raise AckMessage()
            try:
                result = await call_next(msg)
            except BaseException:
                await client.delete(key)
                raise
            await client.set(key, "done", px=86_400_000)
            return result

    return ByHand


async def one_round(variant: str, messages: int) -> float:
    """Messages per second of one broker draining ``messages`` messages."""
    space = f"bench_fs_{uuid.uuid4().hex[:8]}"
    client = aioredis.Redis.from_url(REDIS)
    middlewares: list[Any] = []
    inbox = None
    if variant == "by hand":
        middlewares.append(by_hand(client, space))
    elif variant == "oncely":
        inbox = oncely.AsyncInbox(oncely.open_async(f"{REDIS}?prefix={space}"), consumer="bench")
        middlewares.append(Idempotency(inbox))
    queue = RabbitQueue(space, durable=True)
    connection = await aio_pika.connect(AMQP)
    channel = await connection.channel()
    await channel.declare_queue(space, durable=True)
    for n in range(messages):
        await channel.default_exchange.publish(
            aio_pika.Message(b'{"n": %d}' % n, message_id=f"m-{n}-{space}"), routing_key=space
        )
    broker = RabbitBroker(AMQP, middlewares=middlewares)
    done = asyncio.Event()
    counted = 0

    @broker.subscriber(queue)
    async def incr(body: dict[str, int]) -> None:
        nonlocal counted
        await client.incr(f"{space}:effects")
        counted += 1
        if counted >= messages:
            done.set()

    began = time.perf_counter()
    try:
        async with broker:
            await broker.start()
            await asyncio.wait_for(done.wait(), timeout=600)
            took = time.perf_counter() - began
    finally:
        await channel.queue_delete(space)
        await connection.close()
        if inbox is not None:
            await inbox.aclose()
        async for name in client.scan_iter(match=f"{space}*"):
            await client.delete(name)
        await client.aclose()
    return messages / took


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python bench/faststream_bench.py")
    p.add_argument("--messages", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=HERE / "results")
    args = p.parse_args(argv)
    med = rotating_rounds(
        VARIANTS, args.rounds, lambda variant: asyncio.run(one_round(variant, args.messages))
    )
    write_table(
        med,
        title="FastStream subscribers with and without oncely",
        command="python bench/faststream_bench.py " + " ".join(argv or sys.argv[1:]),
        setup=f"{args.messages} messages a round, one subscriber (FastStream's default: one "
        f"message at a time), {args.rounds} rounds",
        out=args.out,
        name="faststream.md",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
