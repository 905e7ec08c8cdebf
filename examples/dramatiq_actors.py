"""Dramatiq actors that charge each order once, on RabbitMQ:
``python examples/dramatiq_actors.py [AMQP_URL] [DIRECTORY]``.

The actors and the middleware are what a Dramatiq app declares; a deployment runs them with
``dramatiq examples.dramatiq_actors``. To be runnable on its own, this file also sends the
messages (a producer retrying, a resend under the producer's key, a keyless one) and runs a
worker in process until the queue is drained, then prints what happened.
"""

from __future__ import annotations

import json
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

AMQP = sys.argv[1] if len(sys.argv) > 1 else "amqp://guest:guest@127.0.0.1:5672/"
HERE = Path(sys.argv[2] if len(sys.argv) > 2 else tempfile.mkdtemp())
QUEUE = f"charges_{uuid.uuid4().hex[:6]}"

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
