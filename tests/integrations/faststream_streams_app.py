"""The FastStream app ``tests/integrations/test_faststream_streams.py`` runs with the
``faststream run`` worker command on NATS JetStream, Redis streams or Kafka (Tansu): a
subscriber behind ``oncely.integrations.faststream.Idempotency``, its effects counted in
Redis (``INCR``) so every worker process counts in one place, its results published to
``<source>.receipts``, and a subscriber of ``<source>.plain`` the middleware leaves alone.

Configured by the environment: ``ONCELY_TEST_FASTSTREAM_BROKER`` (``nats`` for a pull consumer,
``nats-push`` for a push consumer read by a queue group, ``redis`` or ``kafka``, at
``ONCELY_TEST_KAFKA_URL``),
``ONCELY_TEST_FASTSTREAM_QUEUE`` (the subject or stream), ``ONCELY_TEST_FASTSTREAM_STORE``
(the inbox's store URL), ``ONCELY_TEST_FASTSTREAM_NS`` (the Redis key prefix of the
effects), ``ONCELY_TEST_FASTSTREAM_LEASE`` (the lease, seconds) and
``ONCELY_TEST_FASTSTREAM_TAKEOVER`` (seconds: the JetStream consumer's ack wait, or the idle
time after which the Redis takeover subscriber claims an entry a worker left pending) and
``ONCELY_TEST_FASTSTREAM_MAX_DELIVER`` (the JetStream consumer's ``max_deliver``; default
none)."""

from __future__ import annotations

import asyncio
import os
from datetime import timedelta
from typing import Any

import redis
from faststream import FastStream
from pydantic import BaseModel

import oncely
from oncely.brokers import Backoff
from oncely.integrations.faststream import Idempotency
from tests.integrations.faststream_logs import count_give_backs

BROKER = os.environ["ONCELY_TEST_FASTSTREAM_BROKER"]
SOURCE = os.environ["ONCELY_TEST_FASTSTREAM_QUEUE"]
NS = os.environ["ONCELY_TEST_FASTSTREAM_NS"]
REDIS_URL = os.environ.get("ONCELY_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
NATS_URL = os.environ.get("ONCELY_TEST_NATS_URL", "nats://127.0.0.1:4222")
REDIS = redis.Redis.from_url(REDIS_URL)
LEASE = timedelta(seconds=float(os.environ.get("ONCELY_TEST_FASTSTREAM_LEASE", "30")))
TAKEOVER = float(os.environ.get("ONCELY_TEST_FASTSTREAM_TAKEOVER", "30"))
MAX_DELIVER = int(os.environ.get("ONCELY_TEST_FASTSTREAM_MAX_DELIVER") or 0) or None

inbox = oncely.AsyncInbox(
    oncely.open_async(os.environ["ONCELY_TEST_FASTSTREAM_STORE"]),
    consumer="billing",
    lease=oncely.Lease(duration=LEASE),
)
idempotency = Idempotency(
    {SOURCE: inbox},
    max_deliveries=3,
    backoff=Backoff(first=timedelta(seconds=0.1), most=timedelta(seconds=0.3)),
    requeue_delay=timedelta(seconds=0.5),
)


count_give_backs(REDIS, NS)


class Charge(BaseModel):
    order: str
    amount: int
    sleep: float = 0
    fail_times: int = 0
    exit_times: int = 0
    reject: bool = False


async def charge(charge: Charge) -> dict[str, object]:
    REDIS.incr(f"{NS}:started:{charge.order}")
    await asyncio.sleep(charge.sleep)
    if charge.reject:
        raise oncely.Reject(f"order {charge.order} is not billable")
    if REDIS.incr(f"{NS}:attempts:{charge.order}") <= charge.fail_times:
        raise RuntimeError(f"the ledger is down (attempt for {charge.order})")
    if REDIS.incr(f"{NS}:exits:{charge.order}") <= charge.exit_times:
        os._exit(70)  # the whole worker dies mid-run, as killed by the OOM killer
    REDIS.incr(f"{NS}:effects:{charge.order}")
    return {"order": charge.order, "charged": charge.amount}


async def plain(order: str) -> None:  # not in the mapping: untouched by the middleware
    REDIS.incr(f"{NS}:effects:plain:{order}")


broker: Any
if BROKER in ("nats", "nats-push"):
    from faststream.nats import JStream, NatsBroker, PullSub
    from nats.js.api import ConsumerConfig

    from oncely.brokers.nats import stream_name_for

    broker = NatsBroker(NATS_URL, middlewares=[idempotency])
    receipts = JStream(stream_name_for(f"{SOURCE}.receipts"), subjects=[f"{SOURCE}.receipts"])
    # A pull consumer ("nats"), or a push consumer shared by a queue group ("nats-push": the
    # queue names the durable consumer and its deliver group, and the server hands each
    # message to one member of the group). The push consumer's deliver subject is fixed, as
    # the docs say: members that start at once both create the consumer, and with a random
    # inbox each the last one's wins, so the other member never receives a message.
    push = BROKER == "nats-push"
    reading: dict[str, Any] = (
        {"queue": "billing"} if push else {"durable": "billing", "pull_sub": PullSub(timeout=1.0)}
    )
    broker.subscriber(
        SOURCE,
        stream=JStream(stream_name_for(SOURCE), subjects=[SOURCE]),
        config=ConsumerConfig(
            ack_wait=TAKEOVER,
            deliver_subject=f"deliver.{SOURCE}" if push else None,
            max_deliver=MAX_DELIVER,
        ),
        **reading,
    )(broker.publisher(f"{SOURCE}.receipts", stream=receipts)(charge))
    broker.subscriber(
        f"{SOURCE}.plain",
        stream=JStream(stream_name_for(f"{SOURCE}.plain"), subjects=[f"{SOURCE}.plain"]),
        durable="plain",
        pull_sub=PullSub(timeout=1.0),
    )(plain)
elif BROKER == "redis":
    from faststream.redis import RedisBroker, StreamSub

    broker = RedisBroker(REDIS_URL, middlewares=[idempotency])
    worker = f"worker-{os.getpid()}"
    published = broker.publisher(stream=f"{SOURCE}.receipts")(charge)
    # The group's reader, and its takeover: what a killed worker left pending for TAKEOVER
    # seconds is claimed (XAUTOCLAIM) and delivered again.
    broker.subscriber(stream=StreamSub(SOURCE, group="billing", consumer=worker))(published)
    broker.subscriber(
        stream=StreamSub(
            SOURCE,
            group="billing",
            consumer=f"{worker}-takeover",
            min_idle_time=int(TAKEOVER * 1000),
        )
    )(published)
    broker.subscriber(stream=StreamSub(f"{SOURCE}.plain", group="plain", consumer=worker))(plain)
elif BROKER == "kafka":
    from faststream import AckPolicy
    from faststream.kafka import KafkaBroker

    broker = KafkaBroker(
        os.environ["ONCELY_TEST_KAFKA_URL"].removeprefix("kafka://"), middlewares=[idempotency]
    )
    # Manual commits (AckPolicy.ACK); a member that died is out of the group after the
    # session timeout, and its partition goes to the next worker.
    group: dict[str, Any] = {
        "auto_offset_reset": "earliest",
        "ack_policy": AckPolicy.ACK,
        "session_timeout_ms": 6000,
        "heartbeat_interval_ms": 1000,
    }
    published = broker.publisher(f"{SOURCE}.receipts")(charge)
    broker.subscriber(SOURCE, group_id="billing", **group)(published)
    broker.subscriber(f"{SOURCE}.plain", group_id="plain", **group)(plain)
else:  # pragma: no cover - a test configured it
    raise SystemExit(f"ONCELY_TEST_FASTSTREAM_BROKER={BROKER!r}: nats, nats-push, redis or kafka")

app = FastStream(broker, on_startup=[idempotency.prepare])
