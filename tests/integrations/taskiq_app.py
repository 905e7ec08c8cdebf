"""The taskiq app ``tests/integrations/test_taskiq.py`` runs with the real ``taskiq worker``
on RabbitMQ (``taskiq-aio-pika``) and oncely's receiver: tasks behind
``oncely.integrations.taskiq.Idempotency``, results in Redis, effects counted in Redis
(``INCR``) so every worker process counts in one place. Configured by the environment:
``ONCELY_TEST_TASKIQ_QUEUE``, ``ONCELY_TEST_TASKIQ_STORE`` (the inbox's store URL),
``ONCELY_TEST_TASKIQ_NS`` (the Redis key prefix of the effects and results),
``ONCELY_TEST_TASKIQ_LEASE`` (seconds), ``ONCELY_TEST_TASKIQ_LETTERS`` (a dead-letter queue of
the middleware's own, when set), ``ONCELY_TEST_TASKIQ_LOG_KEYS`` (``hash`` for the inbox's
``log_keys="hash"``), ``ONCELY_TEST_TASKIQ_SLOW_ACKS`` (``1``: :class:`SlowAcks`)."""

from __future__ import annotations

import asyncio
import os
import time
from datetime import timedelta
from typing import Any

import redis.asyncio
from taskiq import (
    Context,
    TaskiqDepends,
    TaskiqEvents,
    TaskiqMessage,
    TaskiqMiddleware,
    TaskiqState,
)
from taskiq.exceptions import NoResultError
from taskiq_aio_pika import AioPikaBroker, Queue, QueueType
from taskiq_redis import RedisAsyncResultBackend

import oncely
from oncely.integrations.taskiq import Idempotency

QUEUE = os.environ["ONCELY_TEST_TASKIQ_QUEUE"]
NS = os.environ["ONCELY_TEST_TASKIQ_NS"]
REDIS_URL = os.environ.get("ONCELY_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
RABBITMQ = os.environ.get("ONCELY_TEST_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/")
REDIS = redis.asyncio.Redis.from_url(REDIS_URL)

inbox = oncely.AsyncInbox(
    oncely.open_async(os.environ["ONCELY_TEST_TASKIQ_STORE"]),
    consumer="billing",
    lease=oncely.Lease(
        duration=timedelta(seconds=float(os.environ.get("ONCELY_TEST_TASKIQ_LEASE", "30")))
    ),
    log_keys="hash" if os.environ.get("ONCELY_TEST_TASKIQ_LOG_KEYS") == "hash" else "plain",
)


class SlowAcks(TaskiqMiddleware):
    """A busy worker's slow acknowledgement, made sure of: a ``fatal`` copy that oncely sent
    again is acknowledged only once the copy it sent has run (a ``started`` count more), or
    after 3 s if that copy is not run meanwhile. taskiq runs ``post_execute`` between a
    task's end and its message's acknowledgement."""

    async def post_execute(self, message: TaskiqMessage, result: Any) -> None:
        if not message.task_name.endswith(":fatal") or not isinstance(result.error, NoResultError):
            return
        counted = f"{NS}:started:fatal:{message.args[0]}"
        before = int(await REDIS.get(counted) or 0)
        deadline = time.monotonic() + 3.0
        while int(await REDIS.get(counted) or 0) == before and time.monotonic() < deadline:
            await asyncio.sleep(0.02)


broker = (
    AioPikaBroker(
        RABBITMQ,
        task_queues=[Queue(name=QUEUE, type=QueueType.CLASSIC)],
        dead_letter_queue=Queue(name=f"{QUEUE}.dead", type=QueueType.CLASSIC),
    )
    .with_result_backend(RedisAsyncResultBackend(REDIS_URL, prefix_str=f"{NS}:results"))
    .with_middlewares(
        Idempotency(
            inbox,
            max_retries=2,
            retry_delay=0.2,
            retry_in_flight=1.0,
            dead_letter_queue=os.environ.get("ONCELY_TEST_TASKIQ_LETTERS") or None,
        ),
        *([SlowAcks()] if os.environ.get("ONCELY_TEST_TASKIQ_SLOW_ACKS") == "1" else []),
    )
)


@broker.task(idempotency_key=lambda order, amount, **options: f"charge:{order}")
async def charge(
    order: str, amount: int, sleep: float = 0, fail_times: int = 0, reject: bool = False
) -> dict[str, object]:
    await REDIS.set(f"{NS}:pid:{order}", os.getpid())
    await REDIS.incr(f"{NS}:started:{order}")
    await asyncio.sleep(sleep)
    if reject:
        raise oncely.Reject(f"order {order} is not billable")
    if await REDIS.incr(f"{NS}:attempts:{order}") <= fail_times:
        raise RuntimeError(f"the ledger is down (attempt for {order})")
    await REDIS.incr(f"{NS}:effects:{order}")
    return {"order": order, "amount": amount}


@broker.task(idempotency_key="sent")
def notify(order: str) -> None:  # a sync task: taskiq runs it in its thread pool
    import redis as sync_redis

    sync_redis.Redis.from_url(REDIS_URL).incr(f"{NS}:effects:mail:{order}")


@broker.task
async def plain(name: str) -> None:
    await REDIS.incr(f"{NS}:effects:plain:{name}")


@broker.task(idempotency_key=lambda order, sleep: f"ship:{order}")
def ship(order: str, sleep: float) -> str:  # sync: a timeout label cannot stop its thread
    import time

    import redis as sync_redis

    time.sleep(sleep)
    sync_redis.Redis.from_url(REDIS_URL).incr(f"{NS}:effects:ship:{order}")
    return order


@broker.task(idempotency_key=lambda order: f"later:{order}")
async def later(order: str, context: Context = TaskiqDepends()) -> str:  # noqa: B008
    """Puts itself back on the queue (taskiq's ``Context.requeue``) the first time, or
    rejects itself (``Context.reject``) for an order named ``bad``."""
    await REDIS.incr(f"{NS}:started:{order}")
    if order.startswith("bad"):
        context.reject()
    if await REDIS.incr(f"{NS}:attempts:{order}") == 1:
        await context.requeue()
    await REDIS.incr(f"{NS}:effects:{order}")
    return order


@broker.on_event(TaskiqEvents.WORKER_STARTUP)
async def _count_start(state: TaskiqState) -> None:
    """Each worker process that starts (taskiq starts a dead one again), counted."""
    await REDIS.incr(f"{NS}:worker_starts")


@broker.task(idempotency_key=lambda order, **options: f"fatal:{order}")
async def fatal(order: str, deaths: int = 0) -> str:
    """Its first ``deaths`` runs end the worker process at once (``os._exit``, as the OOM
    killer would); taskiq's worker command starts the process again."""
    if await REDIS.incr(f"{NS}:started:fatal:{order}") <= deaths:
        os._exit(1)
    await REDIS.incr(f"{NS}:effects:fatal:{order}")
    return order
