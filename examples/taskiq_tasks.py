"""taskiq tasks that charge each order once, on RabbitMQ:
``python examples/taskiq_tasks.py [AMQP_URL] [DIRECTORY]``.

The broker, the middleware and the tasks are what a taskiq app declares; a deployment runs
them with ``taskiq worker examples.taskiq_tasks:broker --receiver
oncely.integrations.taskiq:Receiver`` (from the repository's root). Imported so, by each
worker process or by a producer's ``charge.kiq(...)``, the module reads the broker's URL from
``$ONCELY_EXAMPLE_AMQP`` (default: RabbitMQ on 127.0.0.1 as guest) and uses the queue
``taskiq_charges``, with the inbox and the ledger in ``$ONCELY_EXAMPLE_DIR/taskiq`` (default
``oncely-examples/taskiq`` in the system's temporary directory): every process of the
deployment shares them, so an order is charged once however many processes run.

To be runnable on its own, this file also sends the tasks (a producer retrying ``kiq()``, a
resend under the producer's key, a keyless one), runs oncely's receiver in this process until
they are done, then prints what happened. Run so, it uses a queue of its own, deleted at the
end, and a new directory (or DIRECTORY), never a deployment's.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import sys
import tempfile
import uuid
from pathlib import Path

from taskiq.brokers.inmemory_broker import InmemoryResultBackend
from taskiq_aio_pika import AioPikaBroker, Queue, QueueType

import oncely
from oncely.integrations.taskiq import Idempotency, Receiver, send_with_key

DEFAULT_AMQP = "amqp://guest:guest@127.0.0.1:5672/"
DEFAULT_DIR = Path(tempfile.gettempdir(), "oncely-examples")  # $ONCELY_EXAMPLE_DIR overrides it

if __name__ == "__main__":  # run on its own, by python: the arguments are this file's
    ARGS = sys.argv[1:]
    AMQP = ARGS[0] if ARGS else os.environ.get("ONCELY_EXAMPLE_AMQP", DEFAULT_AMQP)
    HERE = Path(ARGS[1] if len(ARGS) > 1 else tempfile.mkdtemp())
    QUEUE = f"taskiq_charges_{uuid.uuid4().hex[:6]}"
else:  # imported by the worker command (not its arguments): one deployment's settings
    AMQP = os.environ.get("ONCELY_EXAMPLE_AMQP", DEFAULT_AMQP)
    HERE = Path(os.environ.get("ONCELY_EXAMPLE_DIR", DEFAULT_DIR), "taskiq")
    QUEUE = "taskiq_charges"
HERE.mkdir(parents=True, exist_ok=True)

inbox = oncely.AsyncInbox(oncely.open_async(f"sqlite:///{HERE / 'inbox.db'}"), consumer="billing")
broker = (
    AioPikaBroker(
        AMQP,
        task_queues=[Queue(name=QUEUE, type=QueueType.CLASSIC)],
        dead_letter_queue=Queue(name=f"{QUEUE}.dead", type=QueueType.CLASSIC),
    )
    .with_result_backend(InmemoryResultBackend())  # in one process; a deployment's: Redis
    .with_middlewares(Idempotency(inbox))
)
ledger = sqlite3.connect(HERE / "ledger.db", isolation_level=None, check_same_thread=False)
ledger.execute("CREATE TABLE IF NOT EXISTS charges (order_id TEXT, amount INTEGER)")


@broker.task(idempotency_key=lambda order, amount: f"charge:{order}")
async def charge(order: str, amount: int) -> int:
    ledger.execute("INSERT INTO charges VALUES (?, ?)", (order, amount))
    return amount


@broker.task(idempotency_key="sent")
async def receipt(order: str) -> None:
    print(f"receipt for {order}")


async def main() -> None:
    broker.is_worker_process = True  # this process is the worker as well as the producer
    receiver = Receiver(broker, run_startup=False, max_async_tasks=10)  # oncely's receiver
    await broker.startup()  # its queues declared: a task sent before would be lost
    stop = asyncio.Event()
    worker = asyncio.create_task(receiver.listen(stop))
    try:
        sent = [await charge.kiq("o-1", 42) for _ in range(3)]  # the producer retried
        results = [(await task.wait_result(timeout=30)).return_value for task in sent]
        print(f"results: {results}")  # the first result, thrice
        for _ in range(2):  # resent under the same key: one receipt
            await (await send_with_key(receipt, "receipt:o-1", "o-1")).wait_result(timeout=30)
        keyless = await (await receipt.kiq("o-2")).wait_result(timeout=30)  # no key
        print(f"dead-lettered: {keyless.error}")
    finally:
        stop.set()
        worker.cancel()
        await asyncio.gather(worker, return_exceptions=True)
        channel = broker.write_channel
        for name in (QUEUE, f"{QUEUE}.dead"):
            await channel.queue_delete(name)
        await broker.shutdown()
    print(f"charges: {ledger.execute('SELECT order_id, amount FROM charges').fetchall()}")


if __name__ == "__main__":
    asyncio.run(main())
