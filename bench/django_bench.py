"""The Django worker with and without oncely, side by side: ``python bench/django_bench.py``.

One worker (the broker loop ``manage.py oncely consume`` runs, in process, ``--concurrency``
Django threads each on its own connection) on the machine's RabbitMQ drains ``--messages``
pre-published messages whose handler writes one ``Charge`` row through Django's ORM on
PostgreSQL, in its own ``transaction.atomic()``, three ways, in rounds with a rotating order:

``bare``
    the handler in ``transaction.atomic()``, nothing recorded;
``by hand``
    what a team would write by hand in the same ``atomic()``: an ``INSERT ... ON CONFLICT DO
    NOTHING RETURNING`` claim of the message id on a table of its own (a duplicate is
    acknowledged unrun), the handler, then an ``UPDATE`` marking the row done with the
    result;
``oncely``
    :class:`oncely.integrations.django.consumer.AtomicProcessor`, as ``manage.py oncely
    consume`` runs it.

Reports messages per second (medians of the rounds) and each against ``by hand``; writes
``bench/results/django.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psycopg
from worker_rounds import rotating_rounds, write_table

HERE = Path(__file__).resolve().parent
AMQP = os.environ.get("ONCELY_TEST_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/")
POSTGRES = os.environ.get("ONCELY_TEST_POSTGRES_DSN", "postgresql://postgres@127.0.0.1:5432/test")
DATABASE = f"oncely_bench_dj_{uuid.uuid4().hex[:6]}"
VARIANTS = ("bare", "by hand", "oncely")
sys.path.insert(0, str(HERE.parent / "examples" / "django_shop"))  # its orders app


def setup_django() -> None:
    import django  # noqa: PLC0415 - configured once, here
    from django.conf import settings  # noqa: PLC0415

    url = psycopg.conninfo.conninfo_to_dict(POSTGRES)
    settings.configure(
        INSTALLED_APPS=["oncely.integrations.django", "orders"],
        DEFAULT_AUTO_FIELD="django.db.models.BigAutoField",
        USE_TZ=True,
        DATABASES={
            "default": {
                "ENGINE": "django.db.backends.postgresql",
                "NAME": DATABASE,
                "USER": url.get("user", ""),
                "HOST": url.get("host", ""),
                "PORT": str(url.get("port", "")),
                "CONN_MAX_AGE": None,
            }
        },
    )
    django.setup()


class Plain:
    """A processor running the handler in Django worker threads, ``bare`` or ``by hand``."""

    def __init__(self, variant: str, handler: Callable[[Any], object], threads: int) -> None:
        self.consumer = "bench"
        self._variant = variant
        self._handler = handler
        self._pool = ThreadPoolExecutor(threads)

    async def process(self, envelope: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(self._one, envelope))

    def _one(self, envelope: Any) -> Any:
        from django.db import close_old_connections, connection, transaction  # noqa: PLC0415

        import oncely  # noqa: PLC0415

        close_old_connections()
        key = envelope.message_id
        payload = envelope.body  # decoded by the broker loop
        with transaction.atomic():
            if self._variant == "by hand":
                with connection.cursor() as cursor:
                    cursor.execute(
                        "INSERT INTO bench_claims (key, status) VALUES (%s, 'running') "
                        "ON CONFLICT (key) DO NOTHING RETURNING 1",
                        (key,),
                    )
                    if cursor.fetchone() is None:
                        return oncely.Handled(oncely.Outcome.DUPLICATE, "bench", key)
                    result = self._handler(payload)
                    cursor.execute(
                        "UPDATE bench_claims SET status = 'done', result = %s WHERE key = %s",
                        (json.dumps(result), key),
                    )
            else:
                result = self._handler(payload)
        return oncely.Handled(oncely.Outcome.PROCESSED, "bench", key, value=result)

    def refuse(
        self, reason: str, *, key: str | None = None, correlation_id: str | None = None
    ) -> Any:
        import oncely  # noqa: PLC0415

        return oncely.Handled(oncely.Outcome.REJECTED, "bench", key, reason=reason)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


async def one_round(variant: str, messages: int, concurrency: int) -> float:
    """Messages per second of one worker draining ``messages`` messages."""
    from orders.models import Charge  # noqa: PLC0415

    from oncely.brokers import BrokerConsumer, ConsumerSettings, open_producer, open_transport  # noqa: PLC0415
    from oncely.integrations.django import get_inbox  # noqa: PLC0415
    from oncely.integrations.django.consumer import AtomicProcessor  # noqa: PLC0415

    queue = f"bench_dj_{uuid.uuid4().hex[:8]}"
    done = threading.Semaphore(0)

    def charge(order: dict[str, Any]) -> dict[str, Any]:
        Charge.objects.create(order=order["order"], amount=order["amount"])
        done.release()
        return {"charged": order["amount"]}

    transport = open_transport(AMQP, queue, group="bench")
    processor: Any
    if variant == "oncely":
        processor = AtomicProcessor(get_inbox(f"bench-{queue}"), charge, threads=concurrency)
    else:
        processor = Plain(variant, charge, concurrency)
    runner = BrokerConsumer(
        transport, processor, settings=ConsumerSettings(concurrency=concurrency)
    )
    producer = open_producer(AMQP, queue)
    try:
        warm = b'{"order": "warm-up", "amount": 0}'
        await producer.publish(warm, message_id=f"{queue}-warm-up")  # declares the queue
        for n in range(messages):
            body = json.dumps({"order": f"o-{n}", "amount": n}).encode()
            await producer.publish(body, message_id=f"{queue}-{n}")
    finally:
        await producer.close()
    began = time.perf_counter()  # the worker's start (one connection) is on the clock
    task = asyncio.create_task(runner.run())
    loop = asyncio.get_running_loop()
    for _ in range(messages + 1):
        while not await loop.run_in_executor(None, functools.partial(done.acquire, timeout=1)):
            if task.done():
                task.result()  # the worker stopped: say why
                raise RuntimeError("the worker stopped before draining the queue")
    took = time.perf_counter() - began
    runner.stop()
    await task
    processor.close()
    return messages / took


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python bench/django_bench.py")
    p.add_argument("--messages", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--out", type=Path, default=HERE / "results")
    args = p.parse_args(argv)
    with psycopg.connect(POSTGRES, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {DATABASE}")
    try:
        setup_django()
        from django.core.management import call_command  # noqa: PLC0415
        from django.db import connection  # noqa: PLC0415

        call_command("migrate", verbosity=0)
        with connection.cursor() as cursor:
            cursor.execute(
                "CREATE TABLE bench_claims (key TEXT PRIMARY KEY, status TEXT NOT NULL, "
                "result TEXT)"
            )
        connection.close()
        med = rotating_rounds(
            VARIANTS,
            args.rounds,
            lambda variant: asyncio.run(one_round(variant, args.messages, args.concurrency)),
        )
    finally:
        from django.db import connections  # noqa: PLC0415

        from oncely.integrations.django.databases import close_stores  # noqa: PLC0415

        close_stores()
        connections.close_all()
        with psycopg.connect(POSTGRES, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {DATABASE} WITH (FORCE)")
    write_table(
        med,
        title="The Django worker with and without oncely",
        command="python bench/django_bench.py " + " ".join(argv or sys.argv[1:]),
        setup=f"{args.messages} messages a round on RabbitMQ, one worker running up to "
        f"{args.concurrency} handlers at once in Django threads, PostgreSQL, {args.rounds} "
        "rounds",
        out=args.out,
        name="django.md",
        effect="one Charge row written through Django's ORM in transaction.atomic()",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
