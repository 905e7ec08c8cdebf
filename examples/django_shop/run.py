"""A Django project whose worker charges each order once, on RabbitMQ:
``python examples/django_shop/run.py [AMQP_URL] [DIRECTORY]``.

``shop_site/settings.py`` adds ``oncely.integrations.django`` to ``INSTALLED_APPS``;
``manage.py migrate`` then creates the inbox table in the project's own database, and a
deployment runs the worker with::

    python manage.py oncely consume --broker amqp://... --source charges \\
        --handler orders.handlers:charge --consumer billing

To be runnable on its own, this file migrates a fresh SQLite database, starts that worker,
publishes an order three times (a producer retrying) and, once it is charged, its id once more
for another amount, calls a refund twice, stops the worker with SIGTERM and prints what happened.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import aio_pika
import django
from django.core.management import call_command

from oncely.brokers import open_producer

PROJECT = Path(__file__).resolve().parent
AMQP = sys.argv[1] if len(sys.argv) > 1 else "amqp://guest:guest@127.0.0.1:5672/"
HERE = Path(sys.argv[2] if len(sys.argv) > 2 else tempfile.mkdtemp())
HERE.mkdir(parents=True, exist_ok=True)
os.environ["SHOP_DIR"] = str(HERE)
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "shop_site.settings")
sys.path.insert(0, str(PROJECT))
QUEUE = f"charges_{uuid.uuid4().hex[:6]}"


async def publish(*bodies: bytes) -> None:
    producer = open_producer(AMQP, QUEUE)
    try:
        for body in bodies:
            await producer.publish(body, message_id="order-o-1")
    finally:
        await producer.close()


async def queue_stats(name: str, *, delete: bool = False) -> tuple[int, int, str]:
    """(messages, consumers, the first message's x-oncely-reason) of queue ``name``."""
    connection = await aio_pika.connect(AMQP)
    async with connection:
        channel = await connection.channel()
        queue = await channel.declare_queue(name, passive=True)
        found = queue.declaration_result
        reason = ""
        if delete:
            message = await queue.get(fail=False)
            reason = str(message.headers.get("x-oncely-reason", "")) if message else ""
            await queue.delete(if_unused=False, if_empty=False)
            if name.endswith(".dead"):  # and the dead-letter exchange, named as its queue
                await channel.exchange_delete(name)
        return found.message_count or 0, found.consumer_count or 0, reason


async def wait_for(name: str, *, messages: int = 0, consumers: int = 0) -> None:
    for _ in range(300):
        try:
            found = await queue_stats(name)
        except aio_pika.exceptions.ChannelNotFoundEntity:
            found = (0, 0, "")
        if found[0] >= messages and found[1] >= consumers:
            return
        await asyncio.sleep(0.1)
    raise SystemExit(f"timed out waiting for {name}")


def main() -> None:
    django.setup()
    call_command("migrate", verbosity=0)
    from orders.handlers import refund  # noqa: PLC0415 - after django.setup()
    from orders.models import Charge  # noqa: PLC0415

    worker = subprocess.Popen(
        [sys.executable, "manage.py", "oncely", "consume", "--broker", AMQP, "--source", QUEUE,
         "--handler", "orders.handlers:charge", "--consumer", "billing", "--log-level", "error"],
        cwd=PROJECT,
    )  # fmt: skip
    try:
        asyncio.run(wait_for(QUEUE, consumers=1))
        charge = b'{"order": "o-1", "amount": 42}'
        asyncio.run(publish(charge, charge, charge))  # a producer retried: three copies
        while Charge.objects.count() < 1:
            time.sleep(0.1)
        # The id reused for another amount, once the charge is recorded (sent with the
        # copies, it could be the one of the four the worker's threads claim first).
        asyncio.run(publish(b'{"order": "o-1", "amount": 99}'))
        asyncio.run(wait_for(f"{QUEUE}.dead", messages=1))
        print("refund:", refund("o-1", 42))
        print("refund again:", refund("o-1", 42))
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(timeout=60)
        _messages, _consumers, reason = asyncio.run(queue_stats(f"{QUEUE}.dead", delete=True))
        asyncio.run(queue_stats(QUEUE, delete=True))
    print(f"dead-lettered: {reason.split(':')[0]}")
    print("charges:", sorted(Charge.objects.values_list("order", "amount")))
    print("worker exit code:", worker.returncode)


if __name__ == "__main__":
    main()
