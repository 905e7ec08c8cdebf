"""taskiq workers with and without oncely, side by side: ``python bench/taskiq_bench.py``.

One taskiq receiver (in process, up to ``--concurrency`` tasks at once, as ``taskiq worker``
runs in each worker process) on the machine's RabbitMQ through ``taskiq-aio-pika`` drains
``--messages`` pre-published messages of one async task whose effect is one Redis ``INCR``
(redis-py's asyncio client), three ways, in rounds with a rotating order:

``bare``
    taskiq's own receiver, no middleware;
``by hand``
    taskiq's own receiver, the task wrapped in what a team would write by hand on the same
    Redis: a ``SET key NX PX`` claim before it, a ``SET key done`` after it, a duplicate
    returned unrun (two round trips, as oncely's two-phase mode);
``oncely``
    ``oncely.integrations.taskiq``'s middleware and receiver on the async Redis store.

Reports messages per second (medians of the rounds) and each against ``by hand``; writes
``bench/results/taskiq.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
from taskiq.api import run_receiver_task
from taskiq.receiver import Receiver as TaskiqReceiver
from taskiq_aio_pika import AioPikaBroker, Queue, QueueType
from worker_rounds import rotating_rounds, write_table

import oncely
from oncely.integrations.taskiq import Idempotency, Receiver

HERE = Path(__file__).resolve().parent
AMQP = os.environ.get("ONCELY_TEST_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/")
REDIS = os.environ.get("ONCELY_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
VARIANTS = ("bare", "by hand", "oncely")


def by_hand(
    client: aioredis.Redis, prefix: str
) -> Callable[[Callable[[int], Awaitable[None]]], Callable[[int], Awaitable[None]]]:
    """A claim and a completion written by hand around the task, on the same Redis."""

    def wrap(task: Callable[[int], Awaitable[None]]) -> Callable[[int], Awaitable[None]]:
        @functools.wraps(task)
        async def claimed(n: int) -> None:
            key = f"{prefix}:hand:{n}"
            if not await client.set(key, "running", nx=True, px=60_000):
                return
            try:
                await task(n)
            except Exception:
                await client.delete(key)
                raise
            await client.set(key, "done", px=86_400_000)

        return claimed

    return wrap


async def one_round(variant: str, messages: int, concurrency: int) -> float:
    """Messages per second of one receiver draining ``messages`` messages."""
    space = f"bench_tq_{uuid.uuid4().hex[:8]}"
    client = aioredis.Redis.from_url(REDIS)
    broker = AioPikaBroker(
        AMQP,
        qos=concurrency,
        task_queues=[Queue(name=space, type=QueueType.CLASSIC)],
        dead_letter_queue=Queue(name=f"{space}.dead", type=QueueType.CLASSIC),
    )
    receiver: type[TaskiqReceiver] = TaskiqReceiver
    options: dict[str, Any] = {}
    if variant == "oncely":
        store = oncely.open_async(f"{REDIS}?prefix={space}")
        broker = broker.with_middlewares(Idempotency(oncely.AsyncInbox(store, consumer="bench")))
        receiver = Receiver
        options = {"idempotency_key": lambda n: f"k{n}"}

    async def incr(n: int) -> None:
        await client.incr(f"{space}:effects")

    body = by_hand(client, space)(incr) if variant == "by hand" else incr
    task = broker.task(task_name=f"incr_{space}", **options)(body)
    await broker.startup()  # as a client: publish, then hand the broker to the worker
    for n in range(messages):
        await task.kiq(n)
    await broker.shutdown()
    try:
        began = time.perf_counter()  # the worker's start (one connection) is on the clock
        worker = asyncio.create_task(
            run_receiver_task(broker, receiver, max_async_tasks=concurrency, run_startup=True)
        )
        while int(await client.get(f"{space}:effects") or 0) < messages:
            await asyncio.sleep(0.005)
        took = time.perf_counter() - began
        worker.cancel()
        await asyncio.gather(worker, return_exceptions=True)
        channel: Any = broker.write_channel
        for name in (space, f"{space}.dead"):
            await channel.queue_delete(name)
    finally:
        await broker.shutdown()
        async for name in client.scan_iter(match=f"{space}*"):
            await client.delete(name)
        await client.aclose()
    return messages / took


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python bench/taskiq_bench.py")
    p.add_argument("--messages", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--out", type=Path, default=HERE / "results")
    args = p.parse_args(argv)
    med = rotating_rounds(
        VARIANTS,
        args.rounds,
        lambda variant: asyncio.run(one_round(variant, args.messages, args.concurrency)),
    )
    write_table(
        med,
        title="taskiq workers with and without oncely",
        command="python bench/taskiq_bench.py " + " ".join(argv or sys.argv[1:]),
        setup=f"{args.messages} messages a round, one receiver running up to "
        f"{args.concurrency} tasks at once, {args.rounds} rounds",
        out=args.out,
        name="taskiq.md",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
