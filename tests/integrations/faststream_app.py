"""The FastStream app ``tests/integrations/test_faststream.py`` runs with the ``faststream
run`` worker command on RabbitMQ: a subscriber behind
``oncely.integrations.faststream.Idempotency``, its effects counted in Redis (``INCR``) so
every worker process counts in one place, its results published to ``<queue>.receipts``.
Configured by the environment: ``ONCELY_TEST_FASTSTREAM_QUEUE`` (the queue),
``ONCELY_TEST_FASTSTREAM_STORE`` (the inbox's store URL), ``ONCELY_TEST_FASTSTREAM_NS`` (the
Redis key prefix of the effects), ``ONCELY_TEST_FASTSTREAM_LEASE`` (the lease, seconds),
``ONCELY_TEST_FASTSTREAM_ACK_FIRST`` (when set, a subscriber the middleware refuses)."""

from __future__ import annotations

import asyncio
import os
from datetime import timedelta

import redis
from faststream import AckPolicy, FastStream
from faststream.rabbit import QueueType, RabbitBroker, RabbitQueue
from pydantic import BaseModel

import oncely
from oncely.brokers import Backoff
from oncely.integrations.faststream import Idempotency
from tests.integrations.faststream_logs import count_give_backs

QUEUE = os.environ["ONCELY_TEST_FASTSTREAM_QUEUE"]
NS = os.environ["ONCELY_TEST_FASTSTREAM_NS"]
RABBITMQ = os.environ.get("ONCELY_TEST_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/")
REDIS = redis.Redis.from_url(os.environ.get("ONCELY_TEST_REDIS_URL", "redis://127.0.0.1:6379/0"))
LEASE = timedelta(seconds=float(os.environ.get("ONCELY_TEST_FASTSTREAM_LEASE", "30")))

inbox = oncely.AsyncInbox(
    oncely.open_async(os.environ["ONCELY_TEST_FASTSTREAM_STORE"]),
    consumer="billing",
    lease=oncely.Lease(duration=LEASE),
)
idempotency = Idempotency(
    {QUEUE: inbox, QUEUE + ".files": inbox, QUEUE + ".first": inbox, QUEUE + ".quorum": inbox},
    max_deliveries=3,
    backoff=Backoff(first=timedelta(seconds=0.1), most=timedelta(seconds=0.3)),
    requeue_delay=timedelta(seconds=0.5),
)


count_give_backs(REDIS, NS)
broker = RabbitBroker(RABBITMQ, middlewares=[idempotency])
app = FastStream(broker, on_startup=[idempotency.prepare])


class Charge(BaseModel):
    order: str
    amount: int
    sleep: float = 0
    fail_times: int = 0
    exit_times: int = 0
    reject: bool = False


@broker.subscriber(QUEUE)
@broker.publisher(QUEUE + ".receipts")
async def charge(charge: Charge) -> dict[str, object]:
    REDIS.incr(f"{NS}:started:{charge.order}")
    REDIS.sadd(f"{NS}:pids", os.getpid())  # which worker process ran it
    await asyncio.sleep(charge.sleep)
    if charge.reject:
        raise oncely.Reject(f"order {charge.order} is not billable")
    if REDIS.incr(f"{NS}:attempts:{charge.order}") <= charge.fail_times:
        raise RuntimeError(f"the ledger is down (attempt for {charge.order})")
    if REDIS.incr(f"{NS}:exits:{charge.order}") <= charge.exit_times:
        os._exit(70)  # the whole worker dies mid-run, as killed by the OOM killer
    REDIS.incr(f"{NS}:effects:{charge.order}")
    return {"order": charge.order, "charged": charge.amount}


@broker.subscriber(QUEUE + ".plain")
async def plain(order: str) -> None:  # not in the mapping: untouched by the middleware
    REDIS.incr(f"{NS}:effects:plain:{order}")


@broker.subscriber(QUEUE + ".files")
@broker.publisher(QUEUE + ".copies")
async def render(order: str) -> bytes:  # bytes: published as they are, duplicates' too
    REDIS.incr(f"{NS}:effects:file:{order}")
    if order == "huge":  # over the inbox's max_result_bytes: not kept
        return b"x" * (300 * 1024)
    return b"\x00\x01 the file of " + order.encode()


if os.environ.get("ONCELY_TEST_FASTSTREAM_ACK_FIRST"):  # a subscriber oncely cannot protect

    @broker.subscriber(QUEUE + ".first", ack_policy=AckPolicy.ACK_FIRST)
    async def acked_first(order: str) -> None:
        REDIS.incr(f"{NS}:effects:first:{order}")


# A quorum queue that RabbitMQ lets deliver a message 3 times at most (then drops it).
QUORUM = RabbitQueue(
    QUEUE + ".quorum",
    durable=True,
    queue_type=QueueType.QUORUM,
    arguments={"x-delivery-limit": 3},
)


@broker.subscriber(QUORUM)
async def charge_quorum(charge: Charge) -> None:
    REDIS.incr(f"{NS}:started:{charge.order}")
    await asyncio.sleep(charge.sleep)
    if REDIS.incr(f"{NS}:attempts:{charge.order}") <= charge.fail_times:
        raise RuntimeError(f"the ledger is down (attempt for {charge.order})")
    REDIS.incr(f"{NS}:effects:{charge.order}")
