"""Run the orders example end to end: python examples/orders/run.py [--broker URL]

Starts the order consumer on a fresh queue (or stream, or subject), publishes the traffic of
``producer.traffic`` (orders, producer retries, a flaky SKU, a reused order id), waits until the
broker has nothing left for the consumer, stops it gracefully and prints what happened. Exits 1
if any order was lost or created twice.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import uuid
from datetime import timedelta
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine

sys.path.insert(0, str(Path(__file__).resolve().parent))

from consumer import OrderConsumer, StockService, metadata, order_lines, orders, outbox
from producer import publish_order, traffic

from oncely.brokers import (
    Backoff,
    BrokerConsumer,
    ConsumerSettings,
    open_producer,
    open_transport,
)

DEFAULT_BROKER = "amqp://guest:guest@127.0.0.1:5672/"
DEFAULT_DATABASE = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


async def main(broker: str, database: str, count: int) -> int:
    source = f"orders_{uuid.uuid4().hex[:8]}"
    schema = "oncely_orders_example"
    engine = create_async_engine(database, connect_args={"options": f"-c search_path={schema}"})
    async with engine.begin() as conn:
        await conn.execute(sa.text(f"DROP SCHEMA IF EXISTS {schema} CASCADE"))
        await conn.execute(sa.text(f"CREATE SCHEMA {schema}"))
        await conn.run_sync(metadata.create_all)

    stock = StockService()
    consumer = BrokerConsumer(
        open_transport(broker, source, group="orders", ack_wait=timedelta(seconds=10)),
        OrderConsumer(engine, stock),
        settings=ConsumerSettings(
            concurrency=8,
            backoff=Backoff(first=timedelta(milliseconds=200)),
            poll=timedelta(milliseconds=200),
        ),
    )
    running = asyncio.create_task(consumer.run())
    sent = traffic(count)
    producer = open_producer(broker, source)
    try:
        for order_id, order in sent:
            await publish_order(producer, order_id, order)
    finally:
        await producer.close()
    # JetStream's duplicate window (Nats-Msg-Id, R14) drops the producer's retries before any
    # consumer sees them. oncely's producer puts a hash of the body in Nats-Msg-Id, so the
    # reused id (other content) is not dropped: it reaches the consumer as a key conflict.
    # Every other broker delivers every copy and oncely sorts them out.
    window = broker.startswith(("nats:", "tls:"))
    dropped = len(sent) - count - 1 if window else 0
    expected = len(sent) - dropped + 1  # every delivered copy, plus the flaky order's retry
    for _ in range(600):
        if (
            sum(consumer.counts[o] for o in ("processed", "duplicate", "key_conflict", "failed"))
            >= expected
        ):
            break
        await asyncio.sleep(0.1)
    consumer.stop()
    await running

    async with engine.connect() as conn:
        rows = {
            table.name: await conn.scalar(sa.select(sa.func.count()).select_from(table))
            for table in (orders, order_lines, outbox)
        }
        amount = await conn.scalar(
            sa.select(orders.c.amount).where(orders.c.order_id == "order-0001")
        )
    await engine.dispose()

    counts = consumer.counts
    print(f"broker: {broker.split('://', maxsplit=1)[0]}  source: {source}")
    print(f"copies published: {len(sent)} for {count} orders")
    if dropped:
        print(f"  dropped by the stream's duplicate window: {dropped}")
    for outcome in ("processed", "duplicate", "key_conflict", "failed", "rejected"):
        print(f"  {outcome:<13} {counts[outcome]}")
    print(f"orders: {rows['orders']}  lines: {rows['order_lines']}  events: {rows['order_events']}")
    print(f"order-0001 amount kept: {amount} (the reused id's 999.00 was dead-lettered)")
    ok = (
        rows == {"orders": count, "order_lines": 2 * count, "order_events": count}
        and counts["processed"] == count
        and counts["duplicate"] == (0 if window else count // 4)
        and counts["key_conflict"] == 1
        and counts["failed"] == 1
        and str(amount) == "11.50"
    )
    print("every order created exactly once: " + ("yes" if ok else "NO"))
    return 0 if ok else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--broker", default=os.environ.get("ONCELY_BROKER", DEFAULT_BROKER))
    parser.add_argument("--database", default=DEFAULT_DATABASE)
    parser.add_argument("--orders", type=int, default=40)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s %(message)s")
    sys.exit(asyncio.run(main(args.broker, args.database, args.orders)))
