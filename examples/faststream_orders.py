"""A FastStream subscriber that charges each order once, on RabbitMQ:
``python examples/faststream_orders.py [AMQP_URL] [DIRECTORY]``.

The broker, the middleware and the subscriber are what a FastStream app declares; a
deployment runs them with ``faststream run examples.faststream_orders:app``. To be runnable on
its own, this file also publishes the messages (a producer retrying, a keyless one), serves
the broker in process until they are handled, then prints what happened.
"""

from __future__ import annotations

import asyncio
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

AMQP = sys.argv[1] if len(sys.argv) > 1 else "amqp://guest:guest@127.0.0.1:5672/"
HERE = Path(sys.argv[2] if len(sys.argv) > 2 else tempfile.mkdtemp())
QUEUE = f"orders_{uuid.uuid4().hex[:6]}"

inbox = oncely.AsyncInbox(oncely.open_async(f"sqlite:///{HERE / 'inbox.db'}"), consumer="billing")
broker = RabbitBroker(AMQP, middlewares=[Idempotency(inbox)])
app = FastStream(broker)
ledger = sqlite3.connect(HERE / "ledger.db", isolation_level=None)
ledger.execute("CREATE TABLE IF NOT EXISTS charges (order_id TEXT, amount INTEGER)")
dead_letters: asyncio.Queue[str] = asyncio.Queue()


@broker.subscriber(RabbitQueue(QUEUE, durable=True))
async def charge(order: dict[str, object]) -> None:
    ledger.execute("INSERT INTO charges VALUES (?, ?)", (order["id"], order["amount"]))


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
