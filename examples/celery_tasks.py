"""Celery tasks that charge each order once, on RabbitMQ:
``python examples/celery_tasks.py [AMQP_URL] [DIRECTORY]``.

The app and its tasks are what a Celery project declares; a deployment runs them with
``celery -A examples.celery_tasks worker`` (prefork, from the repository's root). Imported so,
by each worker or by a producer's ``charge.delay(...)``, the module reads the broker's URL
from ``$ONCELY_EXAMPLE_AMQP`` (default: RabbitMQ on 127.0.0.1 as guest) and uses the queue
``celery_charges``, with the inbox and the ledger in ``$ONCELY_EXAMPLE_DIR/celery`` (default
``oncely-examples/celery`` in the system's temporary directory): every worker of the
deployment on this machine shares them, so an order is charged once however many run.

To be runnable on its own, this file also sends the tasks (a producer retrying ``delay()``, a
resend under the producer's key, a keyless one), runs a worker in this process (Celery's own
embedded test worker) until they are done, then prints what happened. Run so, it uses a queue
of its own, deleted at the end, and a new directory (or DIRECTORY), never a deployment's.
"""

from __future__ import annotations

import os
import sqlite3
import sys
import tempfile
import uuid
from pathlib import Path

from celery import Celery
from celery.contrib.testing.worker import start_worker

import oncely
from oncely.integrations.celery import DeadLettered, IdempotentTask, send_with_key

DEFAULT_AMQP = "amqp://guest:guest@127.0.0.1:5672//"
DEFAULT_DIR = Path(tempfile.gettempdir(), "oncely-examples")  # $ONCELY_EXAMPLE_DIR overrides it

if __name__ == "__main__":  # run on its own, by python: the arguments are this file's
    ARGS = sys.argv[1:]
    AMQP = ARGS[0] if ARGS else os.environ.get("ONCELY_EXAMPLE_AMQP", DEFAULT_AMQP)
    HERE = Path(ARGS[1] if len(ARGS) > 1 else tempfile.mkdtemp())
    QUEUE = f"celery_charges_{uuid.uuid4().hex[:6]}"
else:  # imported by the worker command (not its arguments): one deployment's settings
    AMQP = os.environ.get("ONCELY_EXAMPLE_AMQP", DEFAULT_AMQP)
    HERE = Path(os.environ.get("ONCELY_EXAMPLE_DIR", DEFAULT_DIR), "celery")
    QUEUE = "celery_charges"
HERE.mkdir(parents=True, exist_ok=True)

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
    app.conf.result_expires = 60  # the rpc:// reply queues of this run's threads: gone after
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
        for name in (QUEUE, f"{QUEUE}.dead"):  # each queue, and the exchange of its name
            channel.queue_delete(name)
            channel.exchange_delete(name)


if __name__ == "__main__":
    main()
