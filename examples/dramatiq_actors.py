"""Dramatiq actors that charge each order once, on RabbitMQ:
``python examples/dramatiq_actors.py [AMQP_URL] [DIRECTORY]``.

The actors and the middleware are what a Dramatiq app declares; a deployment runs them with
``dramatiq examples.dramatiq_actors`` (worker processes, from the repository's root). Imported
so, by each worker process or by a producer's ``charge.send(...)``, the module reads the
broker's URL from ``$ONCELY_EXAMPLE_AMQP`` (default: RabbitMQ on 127.0.0.1 as guest) and
uses the queue ``dramatiq_charges``, with the inbox and the ledger in
``$ONCELY_EXAMPLE_DIR/dramatiq`` (default ``oncely-examples/dramatiq`` in the system's
temporary directory): every process of the deployment shares them, so an order is charged
once however many processes run.

To be runnable on its own, this file also sends the messages (a producer retrying, a resend
under the producer's key, a keyless one) and runs a worker in process until the queue is
drained, then prints what happened. Run so, it uses a queue of its own, deleted at the end,
and a new directory (or DIRECTORY), never a deployment's.
"""

from __future__ import annotations

import json
import os
import sqlite3
import sys
import tempfile
import time
import uuid
from pathlib import Path

import dramatiq
from dramatiq.brokers.rabbitmq import RabbitmqBroker

import oncely
from oncely.integrations.dramatiq import Idempotency, send_with_key

DEFAULT_AMQP = "amqp://guest:guest@127.0.0.1:5672/"
DEFAULT_DIR = Path(tempfile.gettempdir(), "oncely-examples")  # $ONCELY_EXAMPLE_DIR overrides it

if __name__ == "__main__":  # run on its own, by python: the arguments are this file's
    ARGS = sys.argv[1:]
    AMQP = ARGS[0] if ARGS else os.environ.get("ONCELY_EXAMPLE_AMQP", DEFAULT_AMQP)
    HERE = Path(ARGS[1] if len(ARGS) > 1 else tempfile.mkdtemp())
    QUEUE = f"dramatiq_charges_{uuid.uuid4().hex[:6]}"
else:  # imported by the worker command (not its arguments): one deployment's settings
    AMQP = os.environ.get("ONCELY_EXAMPLE_AMQP", DEFAULT_AMQP)
    HERE = Path(os.environ.get("ONCELY_EXAMPLE_DIR", DEFAULT_DIR), "dramatiq")
    QUEUE = "dramatiq_charges"
HERE.mkdir(parents=True, exist_ok=True)

broker = RabbitmqBroker(url=AMQP)
inbox = oncely.Inbox(oncely.open(f"sqlite:///{HERE / 'inbox.db'}"), consumer="billing")
broker.add_middleware(Idempotency(inbox))
dramatiq.set_broker(broker)
ledger = sqlite3.connect(HERE / "ledger.db", isolation_level=None, check_same_thread=False)
ledger.execute("CREATE TABLE IF NOT EXISTS charges (order_id TEXT, amount INTEGER)")


@dramatiq.actor(queue_name=QUEUE, idempotency_key=lambda order, amount: f"charge:{order}")
def charge(order: str, amount: int) -> None:
    ledger.execute("INSERT INTO charges VALUES (?, ?)", (order, amount))


@dramatiq.actor(queue_name=QUEUE, max_retries=0, idempotency_key="sent")
def receipt(order: str) -> None:
    print(f"receipt for {order}")


def main() -> None:
    for _ in range(3):
        charge.send("o-1", 42)  # the producer retried: one logical message
    send_with_key(receipt, "receipt:o-1", "o-1")
    send_with_key(receipt, "receipt:o-1", "o-1")  # resent under the same key
    receipt.send("o-2")  # no key: dead-lettered, with the reason
    worker = dramatiq.Worker(broker, worker_threads=2)
    worker.start()
    try:
        broker.join(QUEUE, timeout=30_000)
        worker.join()
        time.sleep(0.5)
    finally:
        worker.stop()
    rows = ledger.execute("SELECT order_id, amount FROM charges").fetchall()
    print(f"charges: {rows}")
    channel = broker.channel
    method, _, body = channel.basic_get(f"{QUEUE}.XQ", auto_ack=True)
    reason = json.loads(body)["options"]["oncely_reason"] if method else None
    print(f"dead-lettered: {reason}")
    for name in (QUEUE, f"{QUEUE}.DQ", f"{QUEUE}.XQ"):
        channel.queue_delete(name)
    broker.close()


if __name__ == "__main__":
    main()
