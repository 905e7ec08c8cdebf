"""What tracing costs a broker consumer per message: python bench/tracing_cost.py

One ``BrokerConsumer`` over the in-memory broker and store (no server, so what is measured is
oncely's and OpenTelemetry's Python alone), a trivial handler, ``MESSAGES`` messages per run,
in alternating runs: tracing off, then on (an OpenTelemetry SDK ``TracerProvider`` with a
``BatchSpanProcessor`` exporting to memory, as the README advises). Prints the medians of the
per-message process CPU (``time.process_time``) and wall time, and checks that every traced
message made exactly one span. Needs the ``dev`` extra (the OpenTelemetry SDK).

``--broker URL`` runs the same on a real broker and store instead (``redis://HOST:PORT/DB``:
Redis Streams with the Redis store; ``amqp://...``: RabbitMQ with the in-memory store), the
messages published beforehand by oncely's producer with tracing off: what tracing costs in
throughput where each message also takes its round trips.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import oncely
from oncely.brokers import BrokerConsumer, ConsumerSettings, open_producer, open_transport
from oncely.testing import MemoryBroker

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.brokers.common

MESSAGES = 4000
ROUNDS = 5


async def _run(tracing: bool | TracerProvider) -> tuple[float, float]:
    """Per-message (CPU, wall) microseconds of one run."""
    inbox = oncely.AsyncInbox(oncely.AsyncMemoryStore(), consumer="bench")
    broker = MemoryBroker()

    async def handler(payload: object) -> None:
        return None

    for i in range(MESSAGES):
        broker.publish(json.dumps({"i": i}).encode(), message_id=f"m-{i}")
    consumer = BrokerConsumer(
        broker, inbox, handler, tracing=tracing, settings=ConsumerSettings(concurrency=16)
    )
    wall, cpu = time.perf_counter(), time.process_time()
    await broker.run_until_idle(consumer)
    cpu = time.process_time() - cpu
    wall = time.perf_counter() - wall
    if consumer.counts["processed"] != MESSAGES:
        raise SystemExit(f"processed {consumer.counts['processed']} of {MESSAGES}")
    return cpu / MESSAGES * 1e6, wall / MESSAGES * 1e6


async def _run_on(url: str, tracing: bool | TracerProvider) -> tuple[float, float]:
    """Per-message (CPU, wall) microseconds of one run on the broker at ``url``."""
    from tests.brokers.common import remove_destinations  # noqa: PLC0415 - after the path

    source = f"bench_tracing_{uuid.uuid4().hex[:8]}"
    if url.startswith("redis://"):
        joiner = "&" if "?" in url else "?"
        store: oncely.AsyncStore = oncely.AsyncRedisStore.from_url(f"{url}{joiner}prefix={source}")
    else:
        store = oncely.AsyncMemoryStore()
    inbox = oncely.AsyncInbox(store, consumer="bench")

    async def handler(payload: object) -> None:
        return None

    producer = open_producer(url, source)  # first, as bench/brokers.py does
    try:
        for start in range(0, MESSAGES, 100):
            await asyncio.gather(
                *(
                    producer.publish(json.dumps({"i": i}).encode(), message_id=f"m-{i}")
                    for i in range(start, min(MESSAGES, start + 100))
                )
            )
    finally:
        await producer.close()
    transport = open_transport(url, source, group="bench", ack_wait=timedelta(seconds=30))
    consumer = BrokerConsumer(
        transport, inbox, handler, tracing=tracing, settings=ConsumerSettings(concurrency=16)
    )
    task = asyncio.create_task(consumer.run())
    try:
        while not (first := consumer.counts["processed"]):  # a group's set-up is not timed
            await asyncio.sleep(0.001)
        wall, cpu = time.perf_counter(), time.process_time()
        while consumer.counts["processed"] < MESSAGES:
            if task.done():
                await task
                raise SystemExit(f"the consumer stopped after {dict(consumer.counts)}")
            await asyncio.sleep(0.002)
        cpu = time.process_time() - cpu
        wall = time.perf_counter() - wall
    finally:
        consumer.stop()
        await task
        await remove_destinations(url, source)
        await store.aclose()
        if url.startswith("redis://"):
            await _drop_keys(url, source)
    timed = MESSAGES - first
    return cpu / timed * 1e6, wall / timed * 1e6


async def _drop_keys(url: str, prefix: str) -> None:
    """Delete the store's records of a run (they would stay for the retention)."""
    import redis.asyncio  # noqa: PLC0415 - only for a Redis run

    client = redis.asyncio.Redis.from_url(url)
    try:
        keys = [key async for key in client.scan_iter(match=f"{prefix}*", count=1000)]
        for start in range(0, len(keys), 1000):
            await client.delete(*keys[start : start + 1000])
    finally:
        await client.aclose()


async def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python bench/tracing_cost.py", description=__doc__)
    p.add_argument("--broker", help="a real broker's URL (redis://... or amqp://...)")
    args = p.parse_args(argv)
    url: str | None = args.broker

    async def run(tracing: bool | TracerProvider) -> tuple[float, float]:
        return await (_run(tracing) if url is None else _run_on(url, tracing))

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(exporter))
    off: list[tuple[float, float]] = []
    on: list[tuple[float, float]] = []
    await run(False)  # warm-up
    for _ in range(ROUNDS):
        off.append(await run(False))
        on.append(await run(provider))
    provider.shutdown()
    spans = len(exporter.get_finished_spans())
    if spans != ROUNDS * MESSAGES:
        raise SystemExit(f"{spans} spans for {ROUNDS * MESSAGES} traced messages")
    for name, runs in (("tracing off", off), ("tracing on", on)):
        cpu = statistics.median(c for c, _ in runs)
        wall = statistics.median(w for _, w in runs)
        print(f"{name:12} {cpu:7.1f} us CPU per message, {wall:7.1f} us wall")
    added = statistics.median(c for c, _ in on) - statistics.median(c for c, _ in off)
    print(f"tracing adds {added:.1f} us of CPU per message ({ROUNDS} rounds of {MESSAGES})")
    if url is not None:
        rate_off = 1e6 / statistics.median(w for _, w in off)
        rate_on = 1e6 / statistics.median(w for _, w in on)
        print(
            f"throughput {rate_off:,.0f} msg/s off, {rate_on:,.0f} msg/s on "
            f"({rate_off / rate_on:.2f}x) on {url.split('://', 1)[0]}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
