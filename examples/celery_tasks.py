"""Celery tasks that charge each order once, on RabbitMQ:
``python examples/celery_tasks.py [AMQP_URL] [DIRECTORY]``.

The app and its tasks are what a Celery project declares; a deployment runs them with
``celery -A examples.celery_tasks worker`` (prefork). To be runnable on its own, this file
also sends the tasks (a producer retrying ``delay()``, a resend under the producer's key, a
keyless one), runs a worker in this process (Celery's own embedded test worker) until they
are done, then prints what happened.
"""

from __future__ import annotations

import sqlite3
import sys
import tempfile
import uuid
from pathlib import Path

from celery import Celery
from celery.contrib.testing.worker import start_worker

import oncely
from oncely.integrations.celery import DeadLettered, IdempotentTask, send_with_key

ARGS = sys.argv[1:] if __name__ == "__main__" else []  # not celery's own arguments
AMQP = ARGS[0] if ARGS else "amqp://guest:guest@127.0.0.1:5672//"
HERE = Path(ARGS[1] if len(ARGS) > 1 else tempfile.mkdtemp())
HERE.mkdir(parents=True, exist_ok=True)
QUEUE = f"charges_{uuid.uuid4().hex[:6]}" if ARGS else "charges"

app = Celery("billing", broker=AMQP, backend="rpc://")
app.conf.task_default_queue = QUEUE
inbox = oncely.Inbox(oncely.open(f"sqlite:///{HERE / 'inbox.db'}"), consumer="billing")
ledger = sqlite3.connect(HERE / "ledger.db", isolation_level=None, check_same_thread=False)
ledger.execute("CREATE TABLE IF NOT EXISTS charges (order_id TEXT, amount INTEGER)")


@app.task(base=IdempotentTask, inbox=inbox, idempotency_key=lambda order, amount: f"charge:{order}")
def charge(order: str, amount: int) -> dict[str, object]:
    ledger.execute("INSERT INTO charges VALUES (?, ?)", (order, amount))
    return {"order": order, "charged": amount}


@app.task(base=IdempotentTask, inbox=inbox, idempotency_key="sent")
def receipt(order: str) -> str:
    print(f"receipt for {order}")
    return order


def main() -> None:
    with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=30):
        sent = [charge.delay("o-1", 42) for _ in range(3)]  # the producer retried
        results = [result.get(timeout=30) for result in sent]  # the first result, thrice
        print(f"results: {len(results)}, all {results[0]}: {results.count(results[0]) == 3}")
        for _ in range(2):  # resent under the same key: one receipt
            send_with_key(receipt, "receipt:o-1", args=("o-1",)).get(timeout=30)
        try:
            receipt.delay("o-2").get(timeout=30)  # no key: dead-lettered, with the reason
        except DeadLettered as exc:
            print(f"dead-lettered: {exc}")
    rows = ledger.execute("SELECT order_id, amount FROM charges").fetchall()
    print(f"charges: {rows}")
    with app.connection_for_write() as connection:
        channel = connection.default_channel
        for name in (QUEUE, f"{QUEUE}.dead"):
            channel.queue_delete(name)


if __name__ == "__main__":
    main()
