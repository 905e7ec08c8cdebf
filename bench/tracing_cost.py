"""What tracing costs a broker consumer per message: python bench/tracing_cost.py

One ``BrokerConsumer`` over the in-memory broker and store (no server, so what is measured is
oncely's and OpenTelemetry's Python alone), a trivial handler, ``MESSAGES`` messages per run,
in alternating runs: tracing off, then on (an OpenTelemetry SDK ``TracerProvider`` with a
``BatchSpanProcessor`` exporting to memory, as the README advises). Prints the medians of the
per-message process CPU (``time.process_time``) and wall time, and checks that every traced
message made exactly one span. Needs the ``dev`` extra (the OpenTelemetry SDK).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import oncely
from oncely.brokers import BrokerConsumer, ConsumerSettings
from oncely.testing import MemoryBroker

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


async def main() -> int:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(exporter))
    off: list[tuple[float, float]] = []
    on: list[tuple[float, float]] = []
    await _run(False)  # warm-up
    for _ in range(ROUNDS):
        off.append(await _run(False))
        on.append(await _run(provider))
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
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
