"""A RabbitMQ consumer whose ledger row and dedup marker commit together in PostgreSQL (R7).

    python examples/broker_consumer.py [AMQP_URL] [POSTGRES_URL]

It publishes three payments (the second one twice, as a producer retry would), consumes them
with oncely in the transactional mode until each is settled, and prints the ledger: one row per
payment. The README's broker example is this file's consumer part.
"""

from __future__ import annotations

import asyncio
import json
import sys
import uuid
from typing import Any

import aio_pika
import psycopg

import oncely
from oncely.brokers import BrokerConsumer, open_producer, open_transport


async def main(amqp: str, postgres: str) -> None:
    queue = f"payments_{uuid.uuid4().hex[:8]}"
    run = uuid.uuid4().hex[:8]
    table = f"ledger_{run}"
    store_url = f"{postgres}?table=inbox_{run}"  # a fresh inbox table for each run
    async with await psycopg.AsyncConnection.connect(postgres, autocommit=True) as admin:
        await admin.execute(f"CREATE TABLE {table} (payment_id text PRIMARY KEY, amount int)")
    producer = open_producer(amqp, queue)
    consumer: BrokerConsumer | None = None
    try:
        inbox = oncely.AsyncInbox(oncely.open_async(store_url), consumer="billing")

        async def book(tx: Any, payment: dict[str, Any]) -> None:  # marker and row commit together
            await tx.execute(
                f"INSERT INTO {table} (payment_id, amount) VALUES (%s, %s)",
                (payment["id"], payment["amount"]),
            )

        transport = open_transport(amqp, queue, group="billing")
        consumer = BrokerConsumer(transport, inbox, book, mode="transactional")
        running = asyncio.create_task(consumer.run())
        await asyncio.sleep(1)  # the consumer declares the queue
        for n, copies in ((1, 1), (2, 2), (3, 1)):
            for _ in range(copies):  # the same message id on every retry (R2)
                body = json.dumps({"id": f"pay-{n}", "amount": 10 * n}).encode()
                await producer.publish(body, message_id=f"pay-{n}")
        while sum(consumer.counts.values()) < 4:
            await asyncio.sleep(0.1)
        consumer.stop()
        await running
        await inbox.aclose()
        await inbox.store.aclose()
        async with await psycopg.AsyncConnection.connect(postgres) as conn:
            rows = await (await conn.execute(f"SELECT * FROM {table} ORDER BY 1")).fetchall()
        print("outcomes:", dict(sorted(consumer.counts.items())))
        print("ledger:", rows)
    finally:
        await producer.close()
        async with await psycopg.AsyncConnection.connect(postgres, autocommit=True) as admin:
            await admin.execute(f"DROP TABLE IF EXISTS {table}, inbox_{run}, inbox_{run}_meta")
        await _remove(amqp, queue)


async def _remove(amqp: str, queue: str) -> None:
    """Delete what the example made on RabbitMQ: the queue and its dead-letter queue and
    exchange (the consumer declared them)."""
    connection = await aio_pika.connect(amqp)
    async with connection:
        channel = await connection.channel()
        for name in (queue, f"{queue}.dead"):
            await channel.queue_delete(name)
        await channel.exchange_delete(f"{queue}.dead")


if __name__ == "__main__":
    asyncio.run(
        main(
            sys.argv[1] if len(sys.argv) > 1 else "amqp://guest:guest@127.0.0.1/",
            sys.argv[2] if len(sys.argv) > 2 else "postgresql://postgres@127.0.0.1/test",
        )
    )
