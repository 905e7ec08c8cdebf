"""A fleet of consumer processes on a real broker, killed with SIGKILL and restarted.

The parent publishes the messages (some twice, as a producer retry does), runs consumer
processes that apply each message's effect as a row of a PostgreSQL ledger in the same
transaction as the dedup marker (transactional mode, R7), SIGKILLs them at random moments
(mostly mid-handler: each handler holds its transaction open for a few milliseconds), restarts
them, and reads back the facts: effects per key, and what the broker still holds.

Used by ``test_fleet.py`` for every broker whose transport is registered in
:func:`oncely.brokers.open_transport`.
"""

from __future__ import annotations

import asyncio
import faulthandler
import json
import logging
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg

import oncely
from oncely.brokers import BrokerConsumer, ConsumerSettings, open_producer, open_transport
from tests.brokers.common import Ledger
from tests.chaos.harness import Processes
from tests.services import POSTGRES_DSN


@dataclass(frozen=True)
class FleetConfig:
    broker_url: str
    source: str
    group: str
    ledger: str
    store_table: str
    consumer: str = "fleet"
    concurrency: int = 8
    ack_wait_s: float = 2.0
    hold_ms: float = 3.0  # how long a handler keeps its transaction open: the kill window
    sigterm_log: str = ""
    ready_dir: str = ""  # each worker touches <ready_dir>/<pid> once SIGTERM stops it cleanly


def worker(config_json: str, index: int) -> None:
    """One consumer process: runs until SIGTERM (a clean stop) or SIGKILL (a crash)."""
    config = FleetConfig(**json.loads(config_json))
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(_consume(config, index))


async def _consume(config: FleetConfig, index: int) -> None:
    store = oncely.AsyncPostgresStore(POSTGRES_DSN, table=config.store_table, pool_max=4)
    inbox = oncely.AsyncInbox(store, consumer=config.consumer)
    ledger = Ledger(config.ledger)
    hold = config.hold_ms / 1000

    async def apply(tx: psycopg.AsyncConnection[Any], payload: dict[str, Any]) -> None:
        await ledger.apply_in(tx, str(payload["n"]), payload)
        marker = payload.get("hold_once")
        if marker and not Path(marker).exists():
            # The first delivery of this message stops here, its effect written and not yet
            # committed, and says so: the test SIGKILLs the process now.
            Path(marker).touch()
            await asyncio.sleep(600)
        await asyncio.sleep(random.uniform(0, hold))

    transport = open_transport(
        config.broker_url,
        config.source,
        group=config.group,
        ack_wait=timedelta(seconds=config.ack_wait_s),
    )
    consumer = BrokerConsumer(
        transport,
        inbox,
        apply,
        mode="transactional",
        settings=ConsumerSettings(
            concurrency=config.concurrency,
            requeue_delay=timedelta(milliseconds=200),
            poll=timedelta(milliseconds=200),
            shutdown_grace=timedelta(seconds=10),
        ),
    )
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, consumer.stop)
    # What a worker that does not stop is doing: the parent sends SIGUSR1 before it fails,
    # and the stacks of every thread (a blocked loop) and every task land on stderr.
    loop.add_signal_handler(signal.SIGUSR1, _dump_tasks)
    faulthandler.register(signal.SIGUSR1, chain=True)  # after: it chains to the loop's
    if config.ready_dir:  # from here on SIGTERM is a graceful stop
        (Path(config.ready_dir) / str(os.getpid())).touch()
    try:
        await consumer.run()
    finally:
        await inbox.aclose()
    if config.sigterm_log:
        with Path(config.sigterm_log).open("a") as out:
            out.write(json.dumps({"worker": index, "counts": dict(consumer.counts)}) + "\n")


def _dump_tasks() -> None:
    """Every task and the whole chain of awaits it is suspended in (``print_stack`` shows
    only a suspended task's outermost frame), down to the future it waits for."""
    for task in asyncio.all_tasks():
        print(f"--- {task!r}", file=sys.stderr)
        awaited: Any = task.get_coro()
        while awaited is not None:
            frame = getattr(awaited, "cr_frame", None) or getattr(awaited, "gi_frame", None)
            if frame is None:
                print(f"    waits for {awaited!r}"[:600], file=sys.stderr)
                break
            print(f"    {frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name}",
                  file=sys.stderr)  # fmt: skip
            awaited = getattr(awaited, "cr_await", None) or getattr(awaited, "gi_yieldfrom", None)
    sys.stderr.flush()


@dataclass
class FleetResult:
    messages: int
    published: int
    kills: int
    effects: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def extra(self) -> int:
        return sum(n - 1 for n in self.effects.values() if n > 1)

    @property
    def lost(self) -> int:
        return self.messages - len(self.effects)

    def summary(self) -> str:
        return (
            f"messages={self.messages} published={self.published} "
            f"(producer duplicates={self.published - self.messages}) kills={self.kills} "
            f"extra_effects={self.extra} lost={self.lost} seconds={self.seconds:.1f}"
        )


async def publish_all(
    url: str,
    destination: str,
    messages: int,
    duplicate_every: int,
    *,
    seed: int,
    ahead: Callable[[int], bool] | None = None,
) -> int:
    """Publish ``messages`` logical messages; every ``duplicate_every``-th one twice (a
    producer retry with the same message id), in a shuffled order. Returns the copies sent.
    ``ahead(sent)``: whether the producer is too far ahead of the consumers to send more now
    (it waits until it is not)."""
    rng = random.Random(seed)
    copies = list(range(messages))
    copies += list(range(0, messages, duplicate_every))
    rng.shuffle(copies)
    producer = open_producer(url, destination)
    try:
        window = 64
        for start in range(0, len(copies), window):
            while ahead is not None and ahead(start):
                await asyncio.sleep(0.2)
            await asyncio.gather(
                *(
                    producer.publish(json.dumps({"n": n}).encode(), message_id=f"fleet-{n}")
                    for n in copies[start : start + window]
                )
            )
    finally:
        await producer.close()
    return len(copies)


def _wait(check: Callable[[], Awaitable[bool]] | None, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while check is not None and not asyncio.run(check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {seconds}s waiting for {what}")
        time.sleep(0.2)


def _wait_ready(config: FleetConfig, processes: Iterable[Any]) -> None:
    if not config.ready_dir:
        return
    deadline = time.monotonic() + 60
    for process in processes:
        while not (Path(config.ready_dir) / str(process.pid)).exists():
            if time.monotonic() > deadline:
                raise AssertionError(f"{process.name} never became ready")
            time.sleep(0.05)


def run_fleet(
    config: FleetConfig,
    *,
    messages: int,
    workers: int = 3,
    duplicate_every: int = 10,
    kill_every_s: tuple[float, float] = (0.3, 1.2),
    timeout_s: float = 600.0,
    settled: Callable[[], Awaitable[bool]] | None = None,
    seed: int = 7,
    max_backlog: int | None = None,
) -> FleetResult:
    """Publish, consume with ``workers`` processes under random SIGKILLs until every message
    has its effect, then stop the fleet with SIGTERM and wait until ``settled`` (the broker
    holds nothing unacknowledged). Returns the facts. ``max_backlog``: the producer sends no
    more while that many of the copies it sent have no effect yet (moto's server reads its
    whole queue at each receive: a backlog of thousands makes a receive take seconds, the
    consumers fall further behind, and the run never catches up)."""
    rng = random.Random(seed)
    ledger = Ledger(config.ledger)
    processes = Processes()
    started = time.monotonic()
    config_json = json.dumps(config.__dict__)
    live: dict[int, Any] = {}
    kills = 0
    try:
        for index in range(workers):
            live[index] = processes.start(worker, config_json, index, name=f"fleet-{index}")
        # Published from a thread of its own: the kills start while messages still arrive (a
        # batch consumer may keep up with a slow producer until the last one is sent).
        sent: list[int] = []
        failed: list[BaseException] = []

        def ahead(copies: int) -> bool:
            return max_backlog is not None and copies - len(ledger.counts()) > max_backlog

        def produce() -> None:
            try:
                sent.append(
                    asyncio.run(
                        publish_all(
                            config.broker_url,
                            config.source,
                            messages,
                            duplicate_every,
                            seed=seed,
                            ahead=ahead,
                        )
                    )
                )
            except BaseException as exc:
                failed.append(exc)

        producer = threading.Thread(target=produce, name="fleet-producer", daemon=True)
        producer.start()
        next_kill = time.monotonic() + rng.uniform(*kill_every_s)
        while True:
            if failed:
                raise failed[0]
            done = len(ledger.counts())
            if done >= messages:
                break
            if time.monotonic() - started > timeout_s:
                raise AssertionError(f"the fleet processed {done} of {messages} in {timeout_s}s")
            if time.monotonic() >= next_kill:
                index = rng.randrange(workers)
                live[index].kill()  # SIGKILL: no finally, no ack, no rollback message
                live[index].join(10)
                kills += 1
                live[index] = processes.start(
                    worker, config_json, index, name=f"fleet-{index}-{kills}"
                )
                next_kill = time.monotonic() + rng.uniform(*kill_every_s)
            time.sleep(0.05)
        producer.join(60)
        if failed:
            raise failed[0]
        published = sent[0]
        # Let the survivors ack what they finished, then stop them cleanly. A clean stop gives
        # back what a consumer had prefetched but not started; the broker must then hold
        # nothing, or another round of consumers takes what is left (a handful of duplicates).
        for _round in range(3):
            _wait(settled, 120, "the broker to hold no unacknowledged message")
            _wait_ready(config, live.values())
            for process in live.values():
                process.terminate()  # SIGTERM: the graceful stop
            for process in live.values():
                process.join(120)  # a Kafka member may be mid-rebalance: bounded, not instant
                if process.exitcode is None and process.pid is not None:
                    os.kill(process.pid, signal.SIGUSR1)  # its stacks, on stderr
                    time.sleep(3)
                assert process.exitcode == 0, f"{process.name} exited with {process.exitcode}"
            if settled is None or asyncio.run(settled()):
                break
            for index in range(workers):
                live[index] = processes.start(worker, config_json, index, name=f"fleet-{index}-r")
        else:
            raise AssertionError("messages were left on the broker after three clean stops")
    finally:
        processes.reap()
    return FleetResult(
        messages=messages,
        published=published,
        kills=kills,
        effects=ledger.counts(),
        seconds=time.monotonic() - started,
    )
