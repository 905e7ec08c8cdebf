"""Dramatiq workers with and without oncely, side by side: ``python bench/dramatiq_bench.py``.

One Dramatiq worker (in process, ``--threads`` worker threads) on the machine's RabbitMQ
drains ``--messages`` pre-published messages of one actor whose effect is one Redis ``INCR``,
three ways, in rounds with a rotating order:

``bare``
    no middleware: the actor alone;
``by hand``
    a middleware of a few lines doing what a team would write by hand on the same Redis: a
    ``SET key NX PX`` claim before the actor, a ``SET key done`` after it, a duplicate
    acknowledged unrun (two round trips, as oncely's two-phase mode);
``oncely``
    ``oncely.integrations.dramatiq.Idempotency`` on the Redis store.

Reports messages per second (medians of the rounds) and each against ``by hand``; writes
``bench/results/dramatiq.md``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import dramatiq
import redis
from dramatiq.brokers.rabbitmq import RabbitmqBroker
from dramatiq.middleware import Middleware, SkipMessage
from worker_rounds import rotating_rounds, write_table

import oncely
from oncely.integrations.dramatiq import Idempotency

HERE = Path(__file__).resolve().parent
AMQP = os.environ.get("ONCELY_TEST_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/")
REDIS = os.environ.get("ONCELY_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
VARIANTS = ("bare", "by hand", "oncely")


class ByHand(Middleware):
    """A claim and a completion written by hand, on the same Redis."""

    def __init__(self, client: redis.Redis, prefix: str) -> None:
        self.client = client
        self.prefix = prefix

    def before_process_message(self, broker: Any, message: Any) -> None:
        key = f"{self.prefix}:{message.args[0]}"
        if not self.client.set(key, "running", nx=True, px=60_000):
            raise SkipMessage("duplicate")

    def after_process_message(
        self, broker: Any, message: Any, *, result: Any = None, exception: Any = None
    ) -> None:
        key = f"{self.prefix}:{message.args[0]}"
        if exception is None:
            self.client.set(key, "done", px=86_400_000)
        else:
            self.client.delete(key)


def one_round(variant: str, messages: int, threads: int) -> float:
    """Messages per second of one worker draining ``messages`` messages."""
    space = f"bench_dq_{uuid.uuid4().hex[:8]}"
    client = redis.Redis.from_url(REDIS)
    broker = RabbitmqBroker(url=AMQP)
    if variant == "by hand":
        broker.add_middleware(ByHand(client, space))
    elif variant == "oncely":
        store = oncely.open(f"{REDIS}?prefix={space}")
        broker.add_middleware(Idempotency(oncely.Inbox(store, consumer="bench")))
    dramatiq.set_broker(broker)
    options: dict[str, Any] = {"idempotency_key": lambda n: f"k{n}"} if variant == "oncely" else {}

    @dramatiq.actor(queue_name=space, actor_name=f"incr_{space}", max_retries=0, **options)
    def incr(n: int) -> None:
        client.incr(f"{space}:effects")

    for n in range(messages):
        incr.send(n)
    worker = dramatiq.Worker(broker, worker_threads=threads)
    began = time.perf_counter()
    worker.start()
    try:
        while int(client.get(f"{space}:effects") or 0) < messages:
            time.sleep(0.005)
        took = time.perf_counter() - began
    finally:
        worker.stop()
        for name in (space, f"{space}.DQ", f"{space}.XQ"):
            broker.channel.queue_delete(name)
        broker.close()
        for name in client.scan_iter(match=f"{space}*"):
            client.delete(name)
        client.close()
    return messages / took


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python bench/dramatiq_bench.py")
    p.add_argument("--messages", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--out", type=Path, default=HERE / "results")
    args = p.parse_args(argv)
    med = rotating_rounds(
        VARIANTS, args.rounds, lambda variant: one_round(variant, args.messages, args.threads)
    )
    write_table(
        med,
        title="Dramatiq workers with and without oncely",
        command="python bench/dramatiq_bench.py " + " ".join(argv or sys.argv[1:]),
        setup=f"{args.messages} messages a round, {args.threads} worker threads, "
        f"{args.rounds} rounds",
        out=args.out,
        name="dramatiq.md",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
