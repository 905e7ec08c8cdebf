"""A FastStream subscriber that charges each order once, on RabbitMQ:
``python examples/faststream_orders.py [AMQP_URL] [DIRECTORY]``.

The broker, the middleware and the subscriber are what a FastStream app declares; a
deployment runs them with ``faststream run examples.faststream_orders:app`` (``--workers N``
for N processes, from the repository's root). Imported so, by each worker process or by a
producer's ``broker.publish(...)``, the module reads the broker's URL from
``$ONCELY_EXAMPLE_AMQP`` (default: RabbitMQ on 127.0.0.1 as guest) and subscribes to the
queue ``faststream_orders``, with the inbox and the ledger in
``$ONCELY_EXAMPLE_DIR/faststream`` (default ``oncely-examples/faststream`` in the system's
temporary directory): every process of the deployment shares them, so an order is charged
once however many processes run.

To be runnable on its own, this file also publishes the messages (a producer retrying, a
keyless one), serves the broker in process until they are handled, then prints what
happened. Run so, it uses a queue of its own, deleted at the end, and a new directory (or
DIRECTORY), never a deployment's.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import sys
import tempfile
import uuid
from pathlib import Path

from faststream import FastStream
from faststream.rabbit import RabbitBroker, RabbitMessage, RabbitQueue

import oncely
from oncely.brokers import new_message_id
from oncely.integrations.faststream import Idempotency

DEFAULT_AMQP = "amqp://guest:guest@127.0.0.1:5672/"
DEFAULT_DIR = Path(tempfile.gettempdir(), "oncely-examples")  # $ONCELY_EXAMPLE_DIR overrides it

if __name__ == "__main__":  # run on its own, by python: the arguments are this file's
    ARGS = sys.argv[1:]
    AMQP = ARGS[0] if ARGS else os.environ.get("ONCELY_EXAMPLE_AMQP", DEFAULT_AMQP)
    HERE = Path(ARGS[1] if len(ARGS) > 1 else tempfile.mkdtemp())
    QUEUE = f"faststream_orders_{uuid.uuid4().hex[:6]}"
else:  # imported by the run command (not its arguments): one deployment's settings
    AMQP = os.environ.get("ONCELY_EXAMPLE_AMQP", DEFAULT_AMQP)
    HERE = Path(os.environ.get("ONCELY_EXAMPLE_DIR", DEFAULT_DIR), "faststream")
    QUEUE = "faststream_orders"
HERE.mkdir(parents=True, exist_ok=True)

inbox = oncely.AsyncInbox(oncely.open_async(f"sqlite:///{HERE / 'inbox.db'}"), consumer="billing")
idempotency = Idempotency(inbox)
broker = RabbitBroker(AMQP, middlewares=[idempotency])
app = FastStream(broker, on_startup=[idempotency.prepare])  # the store checked at start
ledger = sqlite3.connect(HERE / "ledger.db", isolation_level=None)
ledger.execute("CREATE TABLE IF NOT EXISTS charges (order_id TEXT, amount INTEGER)")
dead_letters: asyncio.Queue[str] = asyncio.Queue()


@broker.subscriber(RabbitQueue(QUEUE, durable=True))
async def charge(order: dict[str, object]) -> None:
    ledger.execute("INSERT INTO charges VALUES (?, ?)", (order["id"], order["amount"]))


if __name__ == "__main__":  # the demonstration reads its dead letter back; a deployment
    # leaves dead letters on their queue for a person (a subscriber there would take them).

    @broker.subscriber(f"{QUEUE}.dead")  # a dead-letter queue's subscriber is left alone
    async def dead(message: RabbitMessage) -> None:
        await dead_letters.put(message.headers["x-oncely-reason"])


async def main() -> None:
    async with broker:
        await broker.start()
        message_id = new_message_id()  # once per logical message, reused on every retry
        for _ in range(3):  # the producer retried: one logical message
            await broker.publish({"id": "o-1", "amount": 42}, QUEUE, message_id=message_id)
        await broker.publish({"id": "o-2", "amount": 7}, QUEUE)  # no id: dead-lettered
        reason = await asyncio.wait_for(dead_letters.get(), timeout=30)
        await asyncio.sleep(0.5)  # the retries behind it
        print(f"charges: {ledger.execute('SELECT * FROM charges').fetchall()}")
        print(f"dead-lettered: the id {reason.split(chr(39) + ' ', 1)[1].split(' (')[0]}")
        for name in (QUEUE, f"{QUEUE}.dead"):
            await (await broker.declare_queue(RabbitQueue(name, durable=True))).delete(
                if_unused=False, if_empty=False
            )


if __name__ == "__main__":
    asyncio.run(main())
